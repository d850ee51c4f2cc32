"""The figures of the report, each a base64 PNG to embed in the page: matplotlib's object API on the
Agg canvas (no pyplot, no global state), imported inside the functions that draw.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from sdcwatch.core.incident import Incident
from sdcwatch.report.data import ENTROPY, RunData, attention_layer, is_localised
from sdcwatch.report.deviation import (
    MIN_RANKS,
    Z_ALARM,
    Z_FLAG,
    Deviation,
    bin_columns,
    global_series,
    quiet_nan_warnings,
    rank_deviation,
)

_Z_CAP = 10.0  # top of the heat map's colour scale; beyond it a rank is plainly off
_MAX_LAYER_PANELS = 16
_SAMPLED = 0.5  # a series measured on fewer than this share of the steps is drawn as points
_OFF_SCALE = {"linestyle": "none", "color": "#d62728", "markersize": 6, "clip_on": False}  # markers of blow-ups
_SEVERITY_COLOUR = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, facecolor="white")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _robust_limits(values: np.ndarray) -> tuple[float, float] | None:
    """y-limits that show the bulk of a series and leave blow-ups (1e10) to off-scale markers."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return None
    # Only blow-ups (an order of magnitude beyond the bulk) go off scale; the early, high loss
    # of a healthy run and a real loss spike stay on it.
    q05, q95 = np.percentile(finite, [5, 95])
    bound = 10 * max(abs(q05), abs(q95), q95 - q05, 1e-12)
    kept = finite[np.abs(finite) <= bound]
    lo, hi = float(kept.min()), float(kept.max())
    pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
    return lo - pad, hi + pad


def _style_axes(ax: Any) -> None:
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(True, color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.tick_params(labelsize=8.5, colors="#444")


def _min_span(steps: np.ndarray) -> float:
    return max(0.5, (float(steps[-1]) - float(steps[0])) * 0.002) if len(steps) else 0.5


def _shade_incidents(ax: Any, incidents: Sequence[Incident], steps: np.ndarray, world: int, *, labels: bool) -> None:
    half = _min_span(steps)
    for n, inc in enumerate(incidents, 1):
        colour = _SEVERITY_COLOUR[inc.severity.value]
        ax.axvspan(inc.first_step - half, inc.last_step + half, color=colour, alpha=0.16, linewidth=0, zorder=0)
        ax.axvline(inc.first_step, color=colour, linewidth=1.0, alpha=0.8, zorder=1)
        if labels:
            if is_localised(inc, world):
                text = f"#{n} {inc.kind} r{','.join(map(str, inc.ranks))}"
            else:
                text = f"#{n} {inc.kind}" + (f" ({len(inc.ranks)} ranks)" if inc.ranks else "")
            if len(incidents) > 8:
                text = f"#{n}"
            ax.annotate(
                text,
                xy=(inc.first_step, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -17 - 11 * ((n - 1) % 3)),
                textcoords="offset points",
                fontsize=8,
                color=colour,
                fontweight="bold",
                clip_on=True,
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.75),
            )


def _mark_injected(ax: Any, faults: Sequence[Mapping[str, Any]], steps: np.ndarray, *, label: bool) -> None:
    last = float(steps[-1]) if len(steps) else 0.0
    for f in faults:
        start = f["step"]
        duration = f.get("duration", 1)
        end = last if duration == 0 else start + max(duration, 1) - 1
        ax.axvspan(
            start - 0.5,
            end + 0.5,
            facecolor="none",
            edgecolor="#8a8a8a",
            hatch="///",
            linewidth=0,
            alpha=0.22,
            zorder=0,
        )
        ax.axvline(start, color="#333", linestyle="--", linewidth=1.0, zorder=1)
        if label:
            ax.annotate(
                f"injected: {f.get('kind', 'fault')}" + ("" if f.get("rank") is None else f" r{f['rank']}"),
                xy=(start, 0.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, 4),
                textcoords="offset points",
                fontsize=8,
                color="#333",
                style="italic",
            )


def _mark_nonfinite(ax: Any, steps: np.ndarray, bad: np.ndarray, colour: str, label: str | None = None) -> None:
    """A strip along the top of the axes over the steps with a non-finite value (runs merged)."""
    if not bad.any():
        return
    idx = np.flatnonzero(bad)
    breaks = np.flatnonzero(np.diff(idx) > 1)
    first = idx[np.r_[0, breaks + 1]]
    last = idx[np.r_[breaks, len(idx) - 1]]
    half = _min_span(steps)
    spans = [(float(steps[a]) - half, float(steps[b]) - float(steps[a]) + 2 * half) for a, b in zip(first, last)]
    ax.broken_barh(spans, (0.955, 0.045), transform=ax.get_xaxis_transform(), facecolors=colour, zorder=4, label=label)


def _plot_series(
    ax: Any,
    steps: np.ndarray,
    series: np.ndarray,
    per_rank: np.ndarray | None,
    present: np.ndarray,
    colour: str,
    label: str,
) -> None:
    limits = _robust_limits(series if per_rank is None else np.concatenate([series, per_rank[present]]))
    if per_rank is not None and per_rank.shape[1] > 1:
        masked = np.where(present & np.isfinite(per_rank), per_rank, np.nan)
        with quiet_nan_warnings():
            lo, hi = np.nanmin(masked, axis=1), np.nanmax(masked, axis=1)
        ax.fill_between(steps, lo, hi, color=colour, alpha=0.14, linewidth=0, label="min-max over ranks")
    ax.plot(steps, np.where(np.isfinite(series), series, np.nan), color=colour, linewidth=1.3, label=label)
    if limits is not None:
        ax.set_ylim(*limits)
        over = np.isfinite(series) & (series > limits[1])
        under = np.isfinite(series) & (series < limits[0])
        for off, edge, marker in ((over, limits[1], "^"), (under, limits[0], "v")):
            if off.any():
                note = f"off scale (max {np.max(series[off]):.3g})" if marker == "^" else "off scale (below)"
                ax.plot(steps[off], np.full(off.sum(), edge), marker=marker, label=note, **_OFF_SCALE)
    _mark_nonfinite(ax, steps, ~np.isfinite(series) & present.any(axis=1), "#7b1fa2", label="non-finite")
    ax.set_ylabel(label, fontsize=9.5)
    _style_axes(ax)


def plot_training(data: RunData, incidents: Sequence[Incident], faults: Sequence[Mapping[str, Any]]) -> str | None:
    series = global_series(data)
    if not series:
        return None
    fig = _new_figure(11.5, 2.5 * len(series) + 0.6)
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    colours = ("#1f5fa8", "#5b3c99")
    for k, (ax, (label, values, per_rank)) in enumerate(zip(axes, series)):
        _shade_incidents(ax, incidents, data.steps, data.world, labels=k == 0)
        _mark_injected(ax, faults, data.steps, label=k == len(series) - 1)
        _plot_series(ax, data.steps, values, per_rank, data.present, colours[k % 2], label)
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False, ncols=4, borderaxespad=0.1)
    axes[-1].set_xlabel("step", fontsize=9.5)
    axes[0].set_xlim(data.steps[0] - 0.5, data.steps[-1] + 0.5)
    return _png(fig)


def _flagged_share(score: np.ndarray, data: RunData) -> np.ndarray:
    """The percentage of steps each rank was flagged (|z| > Z_FLAG before calibration: a persistent
    shift shows here even where one cell's colour stays calm), over the steps where ranks can be
    compared at all (when every rank is non-finite, nobody stands out)."""
    comparable = np.isfinite(score).any(axis=1)
    flags = np.where(data.present, np.where(np.isnan(score), False, score > Z_FLAG), np.nan)[comparable]
    with quiet_nan_warnings():
        return np.nan_to_num(np.nanmean(flags, axis=0) * 100) if len(flags) else np.zeros(data.world)


def _deviation_cmap() -> Any:
    """The heat map's colours on the calibrated score: white up to 2 and pale to Z_FLAG (what
    healthy ranks of this run show among themselves), orange beyond it (rarer than a typical rank's
    1 cell in 200), red from Z_ALARM (alarming) to dark red at _Z_CAP and beyond."""
    from matplotlib.colors import LinearSegmentedColormap

    return LinearSegmentedColormap.from_list(
        "sdc_deviation",
        [
            (0.0, "#ffffff"),
            (2.0 / _Z_CAP, "#ffffff"),
            (Z_FLAG / _Z_CAP, "#fff1c1"),
            ((Z_FLAG + Z_ALARM) / 2 / _Z_CAP, "#fdae61"),
            (Z_ALARM / _Z_CAP, "#e34a33"),
            (1.0, "#7f0000"),
        ],
    ).with_extremes(over="#7f0000", bad="#c8c8c8")  # bad: no record


def _draw_deviation(
    fig: Any, ax: Any, bar: Any, data: RunData, binned: np.ndarray, starts: np.ndarray, widespread: np.ndarray
) -> float:
    """The heat map itself, its non-finite overlay and its colour bar; returns a column's width in steps."""
    from matplotlib.colors import ListedColormap

    world = data.world
    step_w = (float(data.steps[-1]) - float(data.steps[0])) / max(len(starts) - 1, 1) if len(starts) > 1 else 1.0
    extent = (float(starts[0]) - step_w / 2, float(starts[-1]) + step_w / 2, world - 0.5, -0.5)
    cells = {"aspect": "auto", "interpolation": "nearest", "extent": extent}
    capped = np.ma.masked_invalid(np.where(np.isinf(binned), _Z_CAP, binned).T)
    mesh = ax.imshow(capped, cmap=_deviation_cmap(), vmin=0, vmax=_Z_CAP, **cells)
    # Non-finite values get their own colours on top, never confused with a large z: dark purple
    # for a rank that alone went non-finite, light purple once most ranks did.
    spread, _ = bin_columns(widespread.astype(float), data.steps)
    nonfinite = np.where(np.isinf(binned), 2.0, np.where(spread > 0, 1.0, np.nan)).T
    if np.isfinite(nonfinite).any():
        ax.imshow(
            np.ma.masked_invalid(nonfinite), cmap=ListedColormap(["#c9b6e4", "#4a148c"]), vmin=0.5, vmax=2.5, **cells
        )
    cbar = fig.colorbar(mesh, ax=bar, extend="max", fraction=0.25, pad=0.05, shrink=0.9 if world <= 16 else 0.6)
    cbar.set_label("deviation vs other ranks\n(robust z, calibrated)", fontsize=8.5)
    cbar.ax.tick_params(labelsize=8)
    return step_w


def _box_named_ranks(ax: Any, incidents: Sequence[Incident], world: int, half: float) -> None:
    """A blue box round each rank an incident named, over its steps (a dotted line for a run-wide
    one), numbered as in the table."""
    from matplotlib.patches import Rectangle

    colour = "#1565c0"
    for n, inc in enumerate(incidents, 1):
        width = inc.last_step - inc.first_step + 2 * half
        for r in (r for r in inc.ranks if 0 <= r < world):
            box = Rectangle((inc.first_step - half, r - 0.5), width, 1.0, fill=False, edgecolor=colour, linewidth=1.6)
            ax.add_patch(box)
        if not inc.ranks:
            ax.axvline(inc.first_step, color=colour, linestyle=":", linewidth=1.2)
        ax.annotate(
            f"#{n}",
            xy=(inc.first_step, -0.5),
            xytext=(0, 2),
            textcoords="offset points",
            annotation_clip=False,
            fontsize=7.5,
            color=colour,
            ha="center",
            va="bottom",
            fontweight="bold",
        )


def _point_at_injected_ranks(ax: Any, faults: Sequence[Mapping[str, Any]], world: int) -> None:
    for f in faults:
        if f.get("rank") is not None and 0 <= f["rank"] < world:
            ax.annotate(
                "injected ▸",
                xy=(f["step"], f["rank"]),
                xytext=(-4, 0),
                textcoords="offset points",
                ha="right",
                va="center",
                fontsize=7.5,
                color="#222",
                style="italic",
            )


def _label_heatmap_axes(ax: Any, data: RunData, starts: np.ndarray) -> None:
    """The step axis (saying when columns are binned) and the rank axis (with hosts on small runs)."""
    world = data.world
    binned = len(starts) < len(data.steps)
    per_column = f"  (binned: worst of ~{len(data.steps) // len(starts)} steps per column)" if binned else ""
    ax.set_xlabel("step" + per_column, fontsize=9.5)
    ax.set_ylabel("rank", fontsize=9.5)
    tick_every = 1 if world <= 24 else (2 if world <= 48 else 4)
    ticks = list(range(0, world, tick_every))
    ax.set_yticks(ticks)
    show_hosts = world <= 24 and any(data.hosts)
    ax.set_yticklabels(
        [f"{r} · {data.hosts[r]}" if show_hosts and data.hosts[r] else str(r) for r in ticks], fontsize=7.5
    )
    ax.tick_params(labelsize=8)


def _draw_flag_bar(bar: Any, flagged: np.ndarray, world: int) -> None:
    """The share of steps each rank was flagged, red for a rank flagged far more often than its
    peers (not for the noisiest of equals)."""
    standout = max(10.0, 3 * float(np.median(flagged)))
    bar.barh(range(world), flagged, color=["#d62728" if v >= standout else "#9e9e9e" for v in flagged], height=0.7)
    bar.set_xlabel(f"% of steps\n|z| > {Z_FLAG:g}", fontsize=8.5)
    bar.tick_params(labelleft=False, labelsize=8)
    bar.set_xlim(0, max(5.0, float(flagged.max()) * 1.15))
    bar.spines[["top", "right"]].set_visible(False)
    bar.grid(True, axis="x", color="#e6e6e6")


def plot_heatmap(
    data: RunData, incidents: Sequence[Incident], faults: Sequence[Mapping[str, Any]]
) -> tuple[str | None, Deviation, np.ndarray]:
    """The rank x step heat map of deviation with the share of steps each rank was flagged beside
    it; returns (the PNG or None, the deviation it draws, the share per rank)."""
    deviation = rank_deviation(data)
    score, used, widespread = deviation.score, deviation.metrics, deviation.widespread
    if not used or data.world < MIN_RANKS:
        return None, deviation, np.zeros(data.world)
    flagged = _flagged_share(deviation.z, data)
    binned, starts = bin_columns(score, data.steps)
    fig = _new_figure(11.5, min(6.0, 1.6 + 0.16 * data.world))
    grid = fig.add_gridspec(1, 2, width_ratios=(6.4, 1))
    ax = fig.add_subplot(grid[0, 0])
    bar = fig.add_subplot(grid[0, 1], sharey=ax)
    step_w = _draw_deviation(fig, ax, bar, data, binned, starts, widespread)
    _box_named_ranks(ax, incidents, data.world, max(_min_span(data.steps), step_w / 2))
    _point_at_injected_ranks(ax, faults, data.world)
    _label_heatmap_axes(ax, data, starts)
    _draw_flag_bar(bar, flagged, data.world)
    return _png(fig), deviation, flagged


_SUSPECT_COLOURS = ("#d62728", "#e377c2", "#ff7f0e")


class _Measured(NamedTuple):
    """A layer metric at the steps it was measured on: (M,) steps, (M, R, L) values (NaN where a
    rank did not measure it or reported NaN), their mean, min and max over ranks (M, L), and the
    non-finite values ranks really reported (M, R, L)."""

    steps: np.ndarray
    values: np.ndarray
    mean: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    nonfinite: np.ndarray
    points: bool  # sampled (a step in 16 by default): each measurement drawn as a point


def _measured(data: RunData, name: str) -> _Measured:
    """``name`` at the steps some rank measured it: a step it was not measured on is no value, not
    a NaN (and never an off-scale mark)."""
    raw = data.layers[name]
    measured = data.measured.get(name, data.present) & data.present
    at = np.flatnonzero(measured.any(axis=1))
    ok = measured[at][:, :, None]
    values = np.where(ok & np.isfinite(raw[at]), raw[at], np.nan).astype(np.float64)
    with quiet_nan_warnings():
        mean, lo, hi = np.nanmean(values, axis=1), np.nanmin(values, axis=1), np.nanmax(values, axis=1)
    points = len(at) < _SAMPLED * len(data.steps)
    return _Measured(data.steps[at], values, mean, lo, hi, ok & ~np.isfinite(raw[at]), points)


def _layers_shown(n_layers: int, incidents: Sequence[Incident]) -> tuple[list[int], list[int]]:
    """(the layers drawn, the attention layers incidents named): every layer up to
    _MAX_LAYER_PANELS, else an even spread plus the named ones. An incident names an attention
    layer only when its metric counts attention layers (:func:`attention_layer`)."""
    named = {attention_layer(i) for i in incidents}
    named_layers = sorted(n for n in named if n is not None and 0 <= n < n_layers)
    if n_layers <= _MAX_LAYER_PANELS:
        return list(range(n_layers)), named_layers
    spread = np.linspace(0, n_layers - 1, _MAX_LAYER_PANELS - len(named_layers)).astype(int)
    return sorted(set(spread) | set(named_layers)), named_layers


def _draw_measured(ax: Any, m: _Measured, y: np.ndarray, colour: str, **style: Any) -> None:
    """One series at its measured steps: a line joining the measurements (broken at a NaN), with
    a point at each when sampled."""
    marker = dict(marker="o", markersize=3.2, markeredgewidth=0) if m.points else {}
    ax.plot(m.steps, y, color=colour, **marker, **style)


def _shade_layer_incidents(ax: Any, layer: int, steps: np.ndarray, incidents: Sequence[Incident]) -> None:
    """Incidents on one layer's panel: strong where the incident names this attention layer,
    light where it names none (a product, a block, a scalar: it concerns every layer)."""
    for inc in incidents:
        named = attention_layer(inc)
        if named is None or named == layer:
            ax.axvspan(
                inc.first_step - _min_span(steps),
                inc.last_step + _min_span(steps),
                color=_SEVERITY_COLOUR[inc.severity.value],
                alpha=0.12 if named == layer else 0.06,
                linewidth=0,
            )


def _draw_layer_panel(
    ax: Any,
    layer: int,
    data: RunData,
    m: _Measured,
    incidents: Sequence[Incident],
    ranks: tuple[Sequence[int], Sequence[int]],
    faults: Sequence[Mapping[str, Any]],
    named_layers: Sequence[int],
) -> None:
    """One layer's entropy: the mean and spread over ranks, the suspect and injected ranks, the
    incidents and faults; a layer an incident named is titled and framed in red."""
    suspects, injected_ranks = ranks
    ax.fill_between(m.steps, m.lo[:, layer], m.hi[:, layer], color="#1f5fa8", alpha=0.15, linewidth=0)
    _draw_measured(ax, m, m.mean[:, layer], "#1f5fa8", linewidth=1.4, zorder=3)
    for colour, rank in zip(_SUSPECT_COLOURS, suspects):
        alpha = 0.8 if layer in named_layers or not named_layers else 0.45
        _draw_measured(ax, m, m.values[:, rank, layer], colour, linewidth=0.9, alpha=alpha, zorder=2)
        _mark_nonfinite(ax, m.steps, m.nonfinite[:, rank, layer], colour)
    for rank in injected_ranks:  # ground truth the incidents did not name: drawn, but apart
        dashed = (0, (3, 1.5))
        _draw_measured(ax, m, m.values[:, rank, layer], "#333", linewidth=0.9, linestyle=dashed, alpha=0.7, zorder=2)
        _mark_nonfinite(ax, m.steps, m.nonfinite[:, rank, layer], "#333")
    _shade_layer_incidents(ax, layer, data.steps, incidents)
    for f in faults:
        ax.axvline(f["step"], color="#333", linestyle="--", linewidth=0.8)
    limits = _robust_limits(
        np.concatenate([m.mean[:, layer], *(m.values[:, r, layer] for r in [*suspects, *injected_ranks])])
    )
    if limits is not None:
        ax.set_ylim(*limits)
    is_named = layer in named_layers
    ax.set_title(
        f"layer {layer}" + ("  ◀ named by an incident" if is_named else ""),
        fontsize=9,
        color="#d62728" if is_named else "#222",
        fontweight="bold" if is_named else "normal",
        loc="left",
    )
    if is_named:
        for side in ("left", "bottom"):
            ax.spines[side].set_color("#d62728")
    _style_axes(ax)


def _attention_legend(
    fig: Any, data: RunData, suspects: Sequence[int], injected_ranks: Sequence[int], points: bool
) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    marker = dict(marker="o", markersize=3.2, markeredgewidth=0) if points else {}
    handles = [
        Line2D([], [], color="#1f5fa8", label="mean over ranks" + (" (• a measurement)" if points else ""), **marker),
        Patch(color="#1f5fa8", alpha=0.15, label="min-max over ranks"),
    ]
    handles += [
        Line2D([], [], color=c, label=f"rank {r}" + (f" ({data.host_of(r)})" if data.host_of(r) else ""), **marker)
        for c, r in zip(_SUSPECT_COLOURS, suspects)
    ]
    handles += [
        Line2D([], [], color="#333", linestyle=(0, (3, 1.5)), label=f"rank {r} (injected)", **marker)
        for r in injected_ranks
    ]
    fig.legend(handles=handles, loc="outside upper right", ncols=len(handles), fontsize=8.5, frameon=False)


def plot_attention(
    data: RunData, incidents: Sequence[Incident], suspects: Sequence[int], faults: Sequence[Mapping[str, Any]]
) -> tuple[str | None, list[int], list[int]]:
    """Attention entropy per layer, one panel a layer, at the steps it was measured on; returns
    (the PNG or None, the layers drawn, the attention layers incidents named)."""
    entropy = data.layers.get(ENTROPY)
    if entropy is None or entropy.shape[2] == 0:
        return None, [], []
    m = _measured(data, ENTROPY)
    if len(m.steps) == 0:
        return None, [], []
    shown, named_layers = _layers_shown(entropy.shape[2], incidents)
    cols = min(4, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig = _new_figure(11.5, 0.5 + 1.9 * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, squeeze=False).ravel())
    injected_ranks = [
        f["rank"]
        for f in faults
        if isinstance(f.get("rank"), int) and 0 <= f["rank"] < data.world and f["rank"] not in suspects
    ][:1]
    for ax, layer in zip(axes, shown):
        _draw_layer_panel(ax, layer, data, m, incidents, (suspects, injected_ranks), faults, named_layers)
    axes[0].set_xlim(data.steps[0] - 0.5, data.steps[-1] + 0.5)
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    for ax in axes[(rows - 1) * cols :]:
        ax.set_xlabel("step", fontsize=8.5)
    _attention_legend(fig, data, suspects, injected_ranks, m.points)
    fig.supylabel("attention entropy (nats)", fontsize=9.5)
    return _png(fig), shown, named_layers
