"""The run report: one self-contained HTML page a person would rather look at than read.

From a captured run (the JSON-lines records of the file transport, plus the incidents the
service raised) it draws the global loss and gradient norm with the incidents shaded, a rank x
step heat map of how far each rank strays from the others, and the attention entropy of every
layer; a header sums the run up and a table lists the incidents. The plots are PNGs embedded as
base64, so the one file can be mailed, attached to a ticket or opened offline.

The deviation score is computed here from the records with numpy (robust z against the
cross-rank median and MAD); it deliberately does not reuse the detectors, so the picture is an
independent view of the data the detectors saw.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import html
import io
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from sdcwatch.detectors.types import Incident, Severity
from sdcwatch.errors import RecordError, ReplayError, SdcwatchError
from sdcwatch.telemetry.record import from_json

__all__ = [
    "RunData",
    "load_records",
    "load_incidents",
    "incident_from_dict",
    "robust_z",
    "rank_deviation",
    "Deviation",
    "write_report",
    "render_report",
    "report_main",
    "build_parser",
    "DEVIATION_METRICS",
]

#: Per-rank scalars whose cross-rank deviation the heat map shows (those present are used).
DEVIATION_METRICS = ("loss", "grad_norm_local", "grad_cosine")
_SCALARS = ("loss", "loss_global", "grad_norm_local", "grad_norm_global", "grad_cosine", "nonfinite", "step_time")
_ENTROPY = "attn_entropy"
_Z_CAP = 10.0  # top of the heat map's colour scale; beyond it a rank is plainly off
_Z_FLAG = 3.5  # |z| counted as "flagged" in the per-rank bar
_HEATMAP_COLUMNS = 720  # at most this many step columns; longer runs are binned (max per bin)
_MAX_LAYER_PANELS = 16
_MIN_RANKS = 3  # a median and a MAD over fewer ranks say nothing about which one is odd
_SEVERITY_COLOUR = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}


# ---------------------------------------------------------------------------------------------
# input


@dataclass
class RunData:
    """One run's records as dense arrays: ``steps`` (S,), per-rank scalars (S, R), layers (S, R, L).

    A missing record is NaN in every array and False in ``present``; a non-finite value the rank
    really reported stays NaN/Inf with ``present`` True, so the two are never confused.
    """

    run: str
    world: int
    steps: np.ndarray
    present: np.ndarray
    scalars: dict[str, np.ndarray]
    layers: dict[str, np.ndarray]
    hosts: list[str]
    records: int
    duplicates: int = 0
    other_runs: dict[str, int] = field(default_factory=dict)
    wall_start: float = 0.0
    wall_end: float = 0.0

    @property
    def missing(self) -> int:
        """Rank-steps with no record."""
        return int(self.present.size - self.present.sum())

    def host_of(self, rank: int) -> str:
        return self.hosts[rank] if 0 <= rank < len(self.hosts) else ""


def load_records(path: str | Path, *, run: str | None = None) -> RunData:
    """Read a JSON-lines record file into :class:`RunData`.

    When the file holds several runs, ``run`` picks one; by default the run with the most
    records is shown and the others are listed in :attr:`RunData.other_runs`. A malformed line
    raises :class:`ReplayError` naming the file and the line.
    """
    path = Path(path)
    rows: dict[str, list[tuple]] = {}
    hosts: dict[str, dict[int, str]] = {}
    worlds: dict[str, int] = {}
    seen: dict[str, set[str]] = {}  # scalar names each run reported at least once
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ReplayError(str(path), 0, f"cannot read records: {exc.strerror or exc}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = from_json(line)
            except RecordError as exc:
                raise ReplayError(str(path), lineno, str(exc)) from None
            layer = rec.layers.get(_ENTROPY)
            rows.setdefault(rec.run, []).append(
                (rec.step, rec.rank, rec.time, tuple(rec.scalars.get(k, math.nan) for k in _SCALARS),
                 tuple(layer) if layer is not None else None)
            )
            worlds[rec.run] = max(worlds.get(rec.run, 0), rec.world)
            seen.setdefault(rec.run, set()).update(rec.scalars)
            if rec.host:
                hosts.setdefault(rec.run, {})[rec.rank] = rec.host
    if not rows:
        raise ReplayError(str(path), 0, "holds no records")
    if run is None:
        run = max(rows, key=lambda r: len(rows[r]))
    elif run not in rows:
        raise ReplayError(str(path), 0, f"holds no records of run {run!r} (runs: {', '.join(sorted(rows))})")
    data = _densify(run, rows[run], worlds[run], hosts.get(run, {}), seen[run])
    data.other_runs = {r: len(v) for r, v in rows.items() if r != run}
    return data


def _densify(run: str, rows: list[tuple], world: int, hosts: Mapping[int, str], seen: set[str]) -> RunData:
    steps = np.unique(np.fromiter((r[0] for r in rows), dtype=np.uint64, count=len(rows)))
    step_index = {int(s): i for i, s in enumerate(steps)}
    n_steps = len(steps)
    present = np.zeros((n_steps, world), dtype=bool)
    values = np.full((len(_SCALARS), n_steps, world), np.nan)
    n_layers = max((len(r[4]) for r in rows if r[4] is not None), default=0)
    entropy = np.full((n_steps, world, n_layers), np.nan, dtype=np.float32) if n_layers else None
    duplicates = 0
    times = []
    for step, rank, wall, scalars, layer in rows:
        i = step_index[step]
        duplicates += bool(present[i, rank])
        present[i, rank] = True
        values[:, i, rank] = scalars
        if entropy is not None and layer is not None:
            entropy[i, rank, : len(layer)] = layer
        times.append(wall)
    scalars_out = {name: values[k] for k, name in enumerate(_SCALARS) if name in seen}
    layers = {_ENTROPY: entropy} if entropy is not None else {}
    finite_times = [t for t in times if t > 0]
    return RunData(
        run=run,
        world=world,
        steps=steps.astype(np.int64),
        present=present,
        scalars=scalars_out,
        layers=layers,
        hosts=[hosts.get(r, "") for r in range(world)],
        records=len(rows),
        duplicates=duplicates,
        wall_start=min(finite_times, default=0.0),
        wall_end=max(finite_times, default=0.0),
    )


def incident_from_dict(d: Mapping[str, Any]) -> Incident:
    """Rebuild an :class:`Incident` from :meth:`Incident.to_dict` output (or an event wrapping one).

    Raises ValueError naming the bad field; :func:`load_incidents` adds the file and line.
    """
    if "incident" in d and isinstance(d["incident"], Mapping):  # an IncidentEvent on the anomalies topic
        d = d["incident"]
    for key in ("kind", "severity", "message"):
        if key not in d:
            raise ValueError(f"incident field {key!r} is missing")
    try:
        severity = Severity(d["severity"])
    except ValueError:
        raise ValueError(f"incident field 'severity': {d['severity']!r} is not one of info, warning, critical") from None
    first = d.get("first_step", d.get("step"))
    last = d.get("last_step", first)
    for key, value in (("first_step", first), ("last_step", last)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"incident field {key!r} must be an integer, got {value!r}")
    ranks = d.get("ranks") or ()
    if not isinstance(ranks, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise ValueError(f"incident field 'ranks' must be a list of integers, got {ranks!r}")
    layer = d.get("layer")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise ValueError(f"incident field 'layer' must be an integer or null, got {layer!r}")
    score = d.get("score", 0.0)
    return Incident(
        id=str(d.get("id", f"{d['kind']}@{first}")),
        run=str(d.get("run", "")),
        kind=str(d["kind"]),
        severity=severity,
        first_step=first,
        last_step=last,
        message=str(d["message"]),
        ranks=tuple(ranks),
        hosts=tuple(str(h) for h in d.get("hosts") or ()),
        metric=str(d.get("metric") or ""),
        layer=layer,
        score=float(score) if isinstance(score, (int, float)) else math.nan,
        evidence=dict(d.get("evidence") or {}),
        detector=str(d.get("detector") or ""),
        peak_step=d.get("peak_step"),
        resolved_step=d.get("resolved_step"),
        opened_at=float(d.get("opened_at") or 0.0),
        resolved_at=d.get("resolved_at"),
    )


def load_incidents(path: str | Path) -> list[Incident]:
    """Read a JSON-lines file of ``Incident.to_dict()`` objects (or incident events).

    An incident that appears several times (opened, updated, resolved) is kept once, in its
    last state. A malformed line raises :class:`ReplayError` naming the file and the line.
    """
    path = Path(path)
    latest: dict[str, Incident] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReplayError(str(path), 0, f"cannot read incidents: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ReplayError(str(path), 0, f"not UTF-8 text: {exc}") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ReplayError(str(path), lineno, f"not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ReplayError(str(path), lineno, f"expected a JSON object, got {type(obj).__name__}")
        try:
            incident = incident_from_dict(obj)
        except ValueError as exc:
            raise ReplayError(str(path), lineno, str(exc)) from None
        latest.pop(incident.id, None)  # re-insert: order by the last change
        latest[incident.id] = incident
    return sorted(latest.values(), key=lambda i: (i.first_step, -i.severity.rank))


# ---------------------------------------------------------------------------------------------
# analysis


def robust_z(values: np.ndarray) -> np.ndarray:
    """Robust z of each rank against the others at every step: ``(x - median) / (1.4826 MAD)``.

    ``values`` is (steps, ranks) with NaN for a missing rank. The scale has a floor (a millionth
    of the median's magnitude) so ranks that agree to the last bit do not divide by zero. An
    infinite value scores +Inf (the most deviant thing a rank can report); NaN is read as
    "no value" and stays NaN (see :func:`rank_deviation` for NaN a rank reported).

    >>> z = robust_z(np.array([[1.0, 1.1, 0.9, 1.0, 5.0]]))
    >>> int(np.argmax(z[0])), bool(z[0, 4] > 10)
    (4, True)
    """
    x = np.asarray(values, dtype=np.float64)
    finite = np.where(np.isfinite(x), x, np.nan)
    with np.errstate(all="ignore"), _quiet_nan_warnings():
        med = np.nanmedian(finite, axis=1, keepdims=True)
        mad = np.nanmedian(np.abs(finite - med), axis=1, keepdims=True) * 1.4826
        scale = np.maximum(mad, np.maximum(np.abs(med) * 1e-6, 1e-12))
        z = (finite - med) / scale
    return np.where(np.isinf(x), np.inf, z)


class Deviation(NamedTuple):
    """How far each rank strays from the others, per step (see :func:`rank_deviation`)."""

    score: np.ndarray  # (S, R) largest |robust z| over the metrics; +Inf: non-finite on this rank only
    metrics: list[str]  # the metrics that were available
    widespread: np.ndarray  # (S, R) bool: non-finite together with most ranks (the run broke, not the rank)


def rank_deviation(data: RunData) -> Deviation:
    """Per rank and step, the largest |robust z| over :data:`DEVIATION_METRICS`.

    A value only this rank (or a minority) reported as NaN/Inf scores +Inf: that is how SDC
    looks on the step it strikes. Once most ranks are non-finite (the corruption has spread
    through the all-reduce) the value no longer says which rank is odd: it scores nothing and
    is flagged in ``widespread``. NaN where the rank sent no record.
    """
    used = [m for m in DEVIATION_METRICS if m in data.scalars]
    present = data.present
    score = np.full(present.shape, np.nan)
    widespread = np.zeros(present.shape, dtype=bool)
    n_present = present.sum(axis=1, keepdims=True)
    for name in used:
        raw = data.scalars[name]
        nonfinite = present & ~np.isfinite(raw)
        most = nonfinite.sum(axis=1, keepdims=True) * 2 > n_present
        z = np.abs(robust_z(np.where(present & np.isfinite(raw), raw, np.nan)))
        z = np.where(nonfinite & ~most, np.inf, z)
        score = np.fmax(score, z)
        widespread |= nonfinite & most
    score[~present] = np.nan
    widespread &= np.isnan(score)  # a rank that still stands out on another metric is scored
    return Deviation(score, used, widespread)


@contextlib.contextmanager
def _quiet_nan_warnings() -> Iterator[None]:
    """All-NaN slices (a step nobody reported) are expected; keep numpy quiet about them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _mean_over_ranks(data: RunData, name: str) -> np.ndarray:
    """Mean over the ranks that reported; a NaN one rank reported makes the step NaN (a gap)."""
    values = data.scalars[name]
    count = data.present.sum(axis=1)
    total = np.where(data.present, values, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _global_series(data: RunData) -> tuple[tuple[str, np.ndarray, np.ndarray | None], ...]:
    """(label, series, per-rank values for the spread band or None) for loss and gradient norm."""
    out = []
    if "loss_global" in data.scalars and np.any(data.present & ~np.isnan(data.scalars["loss_global"])):
        out.append(("global loss", _mean_over_ranks(data, "loss_global"), data.scalars.get("loss")))
    elif "loss" in data.scalars:
        out.append(("loss (mean over ranks)", _mean_over_ranks(data, "loss"), data.scalars["loss"]))
    if "grad_norm_global" in data.scalars and np.any(data.present & ~np.isnan(data.scalars["grad_norm_global"])):
        out.append(("global gradient norm", _mean_over_ranks(data, "grad_norm_global"), data.scalars.get("grad_norm_local")))
    elif "grad_norm_local" in data.scalars:
        out.append(("gradient norm (mean of local)", _mean_over_ranks(data, "grad_norm_local"), data.scalars["grad_norm_local"]))
    return tuple(out)


def _injected_faults(injected: Any) -> list[dict[str, Any]]:
    """The injected faults as dicts (FaultSpec objects, dicts, or a list of them); text gives none."""
    if injected is None or isinstance(injected, str):
        return []
    if hasattr(injected, "to_dict"):
        injected = injected.to_dict()
    if isinstance(injected, Mapping):
        return [dict(injected)] if "step" in injected else []
    if isinstance(injected, Iterable):
        out = []
        for item in injected:
            out.extend(_injected_faults(item))
        return out
    return []


def _describe_injected(injected: Any) -> str:
    if injected is None:
        return ""
    if isinstance(injected, str):
        return injected
    faults = _injected_faults(injected)
    if not faults:
        return str(injected)
    parts = []
    for f in faults:
        where = "all ranks" if f.get("rank") is None else f"rank {f['rank']}"
        duration = f.get("duration", 1)
        steps = f"from step {f['step']}" + ("" if duration == 0 else f" for {duration} step{'s' * (duration != 1)}")
        extra = ", ".join(f"{k} {f[k]}" for k in ("target", "where", "bit", "magnitude") if f.get(k) not in (None, "*"))
        parts.append(f"{f.get('kind', 'fault')} on {where} {steps}" + (f" ({extra})" if extra else ""))
    return "; ".join(parts)


def _is_localised(inc: Incident, world: int) -> bool:
    """Whether an incident blames a few ranks (not "ranks 0-5 all went NaN")."""
    return 0 < len(inc.ranks) <= min(3, max(1, world // 2))


def _suspect_ranks(incidents: Sequence[Incident], world: int) -> list[int]:
    """Ranks blamed by the most severe localised incidents, the most specific first (at most 3)."""
    ranked = sorted((i for i in incidents if _is_localised(i, world)),
                    key=lambda i: (-i.severity.rank, len(i.ranks), i.first_step))
    out: list[int] = []
    for inc in ranked:
        for r in inc.ranks:
            if 0 <= r < world and r not in out:
                out.append(r)
    return out[:3]


# ---------------------------------------------------------------------------------------------
# plots (matplotlib's object API on the Agg canvas: no pyplot, no global state, no display)


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, facecolor="white")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig


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
            if _is_localised(inc, world):
                text = f"#{n} {inc.kind} r{','.join(map(str, inc.ranks))}"
            else:
                text = f"#{n} {inc.kind}" + (f" ({len(inc.ranks)} ranks)" if inc.ranks else "")
            if len(incidents) > 8:
                text = f"#{n}"
            ax.annotate(
                text, xy=(inc.first_step, 1.0), xycoords=("data", "axes fraction"),
                xytext=(3, -17 - 11 * ((n - 1) % 3)), textcoords="offset points",
                fontsize=8, color=colour, fontweight="bold", clip_on=True,
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.75),
            )


def _mark_injected(ax: Any, faults: Sequence[Mapping[str, Any]], steps: np.ndarray, *, label: bool) -> None:
    last = float(steps[-1]) if len(steps) else 0.0
    for f in faults:
        start = f["step"]
        duration = f.get("duration", 1)
        end = last if duration == 0 else start + max(duration, 1) - 1
        ax.axvspan(start - 0.5, end + 0.5, facecolor="none", edgecolor="#8a8a8a", hatch="///", linewidth=0, alpha=0.22, zorder=0)
        ax.axvline(start, color="#333", linestyle="--", linewidth=1.0, zorder=1)
        if label:
            ax.annotate(
                f"injected: {f.get('kind', 'fault')}" + ("" if f.get("rank") is None else f" r{f['rank']}"),
                xy=(start, 0.0), xycoords=("data", "axes fraction"), xytext=(3, 4), textcoords="offset points",
                fontsize=8, color="#333", style="italic",
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
    ax.broken_barh(spans, (0.955, 0.045), transform=ax.get_xaxis_transform(), facecolors=colour, zorder=4,
                   label=label)


def _plot_series(ax: Any, steps: np.ndarray, series: np.ndarray, per_rank: np.ndarray | None,
                 present: np.ndarray, colour: str, label: str) -> None:
    limits = _robust_limits(series if per_rank is None else np.concatenate([series, per_rank[present]]))
    if per_rank is not None and per_rank.shape[1] > 1:
        masked = np.where(present & np.isfinite(per_rank), per_rank, np.nan)
        with _quiet_nan_warnings():
            lo, hi = np.nanmin(masked, axis=1), np.nanmax(masked, axis=1)
        ax.fill_between(steps, lo, hi, color=colour, alpha=0.14, linewidth=0, label="min-max over ranks")
    ax.plot(steps, np.where(np.isfinite(series), series, np.nan), color=colour, linewidth=1.3, label=label)
    if limits is not None:
        ax.set_ylim(*limits)
        over = np.isfinite(series) & (series > limits[1])
        under = np.isfinite(series) & (series < limits[0])
        if over.any():
            ax.plot(steps[over], np.full(over.sum(), limits[1]), linestyle="none", marker="^", color="#d62728",
                    markersize=6, clip_on=False, label=f"off scale (max {np.max(series[over]):.3g})")
        if under.any():
            ax.plot(steps[under], np.full(under.sum(), limits[0]), linestyle="none", marker="v", color="#d62728",
                    markersize=6, clip_on=False, label="off scale (below)")
    _mark_nonfinite(ax, steps, ~np.isfinite(series) & present.any(axis=1), "#7b1fa2", label="non-finite")
    ax.set_ylabel(label, fontsize=9.5)
    _style_axes(ax)


def _plot_training(data: RunData, incidents: Sequence[Incident], faults: Sequence[Mapping[str, Any]]) -> str | None:
    series = _global_series(data)
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


def _bin_columns(score: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bin the step axis to at most _HEATMAP_COLUMNS columns, keeping each bin's worst score."""
    if len(steps) <= _HEATMAP_COLUMNS:
        return score, steps
    starts = np.linspace(0, len(steps), _HEATMAP_COLUMNS, endpoint=False).astype(int)
    with _quiet_nan_warnings():
        binned = np.fmax.reduceat(score, starts, axis=0)
    return binned, steps[starts]


def _plot_heatmap(data: RunData, incidents: Sequence[Incident], faults: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[str], np.ndarray]:
    score, used, widespread = rank_deviation(data)
    if not used or data.world < _MIN_RANKS:
        return None, used, np.zeros(data.world)
    from matplotlib.colors import LinearSegmentedColormap, ListedColormap
    from matplotlib.patches import Rectangle

    # Share of steps each rank was flagged, over the steps where ranks can be compared at all
    # (when every rank is non-finite, nobody stands out).
    comparable = np.isfinite(score).any(axis=1)
    flags = np.where(data.present, np.where(np.isnan(score), False, score > _Z_FLAG), np.nan)[comparable]
    with _quiet_nan_warnings():
        flagged = np.nan_to_num(np.nanmean(flags, axis=0) * 100) if len(flags) else np.zeros(data.world)
    binned, starts = _bin_columns(score, data.steps)
    world = data.world
    height = min(6.0, 1.6 + 0.16 * world)
    fig = _new_figure(11.5, height)
    grid = fig.add_gridspec(1, 2, width_ratios=(6.4, 1))
    ax = fig.add_subplot(grid[0, 0])
    bar = fig.add_subplot(grid[0, 1], sharey=ax)
    # White up to |z| = 2 and pale to 3.5 (what 8-64 healthy ranks show among themselves), then
    # orange to dark red.
    cmap = LinearSegmentedColormap.from_list(
        "sdc_deviation",
        [(0.0, "#ffffff"), (0.2, "#ffffff"), (0.35, "#fff1c1"), (0.55, "#fdae61"), (0.75, "#e34a33"), (1.0, "#7f0000")],
    ).with_extremes(over="#7f0000", bad="#c8c8c8")  # bad: no record
    step_w = (float(data.steps[-1]) - float(data.steps[0])) / max(len(starts) - 1, 1) if len(starts) > 1 else 1.0
    extent = (float(starts[0]) - step_w / 2, float(starts[-1]) + step_w / 2, world - 0.5, -0.5)
    mesh = ax.imshow(np.ma.masked_invalid(np.where(np.isinf(binned), _Z_CAP, binned).T), aspect="auto", cmap=cmap,
                     vmin=0, vmax=_Z_CAP, interpolation="nearest", extent=extent)
    # Non-finite values get their own colours on top, never confused with a large z: dark purple
    # for a rank that alone went non-finite, light purple once most ranks did.
    spread, _ = _bin_columns(widespread.astype(float), data.steps)
    nonfinite = np.where(np.isinf(binned), 2.0, np.where(spread > 0, 1.0, np.nan)).T
    if np.isfinite(nonfinite).any():
        ax.imshow(np.ma.masked_invalid(nonfinite), aspect="auto", cmap=ListedColormap(["#c9b6e4", "#4a148c"]),
                  vmin=0.5, vmax=2.5, interpolation="nearest", extent=extent)
    cbar = fig.colorbar(mesh, ax=bar, extend="max", fraction=0.25, pad=0.05, shrink=0.9 if world <= 16 else 0.6)
    cbar.set_label("|robust z| vs other ranks", fontsize=8.5)
    cbar.ax.tick_params(labelsize=8)
    half = max(_min_span(data.steps), step_w / 2)
    for n, inc in enumerate(incidents, 1):
        colour = "#1565c0"
        if inc.ranks:
            for r in inc.ranks:
                if 0 <= r < world:
                    ax.add_patch(Rectangle((inc.first_step - half, r - 0.5), inc.last_step - inc.first_step + 2 * half, 1.0,
                                           fill=False, edgecolor=colour, linewidth=1.6))
        else:
            ax.axvline(inc.first_step, color=colour, linestyle=":", linewidth=1.2)
        ax.annotate(f"#{n}", xy=(inc.first_step, -0.5), xytext=(0, 2), textcoords="offset points",
                    annotation_clip=False, fontsize=7.5, color=colour, ha="center", va="bottom", fontweight="bold")
    for f in faults:
        if f.get("rank") is not None and 0 <= f["rank"] < world:
            ax.annotate("injected ▸", xy=(f["step"], f["rank"]), xytext=(-4, 0), textcoords="offset points",
                        ha="right", va="center", fontsize=7.5, color="#222", style="italic")
    ax.set_xlabel("step" + (f"  (binned: worst of ~{len(data.steps) // len(starts)} steps per column)" if len(starts) < len(data.steps) else ""), fontsize=9.5)
    ax.set_ylabel("rank", fontsize=9.5)
    tick_every = 1 if world <= 24 else (2 if world <= 48 else 4)
    ticks = list(range(0, world, tick_every))
    ax.set_yticks(ticks)
    show_hosts = world <= 24 and any(data.hosts)
    ax.set_yticklabels([f"{r} · {data.hosts[r]}" if show_hosts and data.hosts[r] else str(r) for r in ticks], fontsize=7.5)
    ax.tick_params(labelsize=8)
    # Red only for a rank flagged far more often than its peers, not for the noisiest of equals.
    standout = max(10.0, 3 * float(np.median(flagged)))
    bar.barh(range(world), flagged, color=["#d62728" if v >= standout else "#9e9e9e" for v in flagged], height=0.7)
    bar.set_xlabel(f"% of steps\n|z| > {_Z_FLAG:g}", fontsize=8.5)
    bar.tick_params(labelleft=False, labelsize=8)
    bar.set_xlim(0, max(5.0, float(flagged.max()) * 1.15))
    bar.spines[["top", "right"]].set_visible(False)
    bar.grid(True, axis="x", color="#e6e6e6")
    return _png(fig), used, flagged


def _plot_attention(data: RunData, incidents: Sequence[Incident], suspects: Sequence[int],
                    faults: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[int]]:
    entropy = data.layers.get(_ENTROPY)
    if entropy is None or entropy.shape[2] == 0:
        return None, []
    n_layers = entropy.shape[2]
    named_layers = sorted({i.layer for i in incidents if i.layer is not None and 0 <= i.layer < n_layers})
    if n_layers <= _MAX_LAYER_PANELS:
        shown = list(range(n_layers))
    else:
        shown = sorted(set(np.linspace(0, n_layers - 1, _MAX_LAYER_PANELS - len(named_layers)).astype(int)) | set(named_layers))
    cols = min(4, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig = _new_figure(11.5, 0.5 + 1.9 * rows)
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, squeeze=False).ravel())
    steps = data.steps
    present = data.present[:, :, None]
    values = np.where(present & np.isfinite(entropy), entropy, np.nan).astype(np.float64)
    with _quiet_nan_warnings():
        mean = np.nanmean(values, axis=1)
        lo = np.nanmin(values, axis=1)
        hi = np.nanmax(values, axis=1)
    suspect_colours = ("#d62728", "#e377c2", "#ff7f0e")
    injected_ranks = [f["rank"] for f in faults if isinstance(f.get("rank"), int) and 0 <= f["rank"] < data.world
                      and f["rank"] not in suspects][:1]
    for ax, layer in zip(axes, shown):
        ax.fill_between(steps, lo[:, layer], hi[:, layer], color="#1f5fa8", alpha=0.15, linewidth=0)
        ax.plot(steps, mean[:, layer], color="#1f5fa8", linewidth=1.4, zorder=3)
        for colour, rank in zip(suspect_colours, suspects):
            ax.plot(steps, values[:, rank, layer], color=colour, linewidth=0.9,
                    alpha=0.8 if layer in named_layers or not named_layers else 0.45, zorder=2)
            _mark_nonfinite(ax, steps, data.present[:, rank] & ~np.isfinite(entropy[:, rank, layer]), colour)
        for rank in injected_ranks:  # ground truth the incidents did not name: drawn, but apart
            ax.plot(steps, values[:, rank, layer], color="#333", linewidth=0.9, linestyle=(0, (3, 1.5)), alpha=0.7, zorder=2)
            _mark_nonfinite(ax, steps, data.present[:, rank] & ~np.isfinite(entropy[:, rank, layer]), "#333")
        for inc in incidents:
            if inc.layer == layer or inc.layer is None:
                ax.axvspan(inc.first_step - _min_span(steps), inc.last_step + _min_span(steps),
                           color=_SEVERITY_COLOUR[inc.severity.value], alpha=0.12 if inc.layer == layer else 0.06, linewidth=0)
        for f in faults:
            ax.axvline(f["step"], color="#333", linestyle="--", linewidth=0.8)
        limits = _robust_limits(np.concatenate([mean[:, layer], *(values[:, r, layer] for r in [*suspects, *injected_ranks])]))
        if limits is not None:
            ax.set_ylim(*limits)
        is_named = layer in named_layers
        ax.set_title(f"layer {layer}" + ("  ◀ named by an incident" if is_named else ""), fontsize=9,
                     color="#d62728" if is_named else "#222", fontweight="bold" if is_named else "normal", loc="left")
        if is_named:
            for side in ("left", "bottom"):
                ax.spines[side].set_color("#d62728")
        _style_axes(ax)
    for ax in axes[len(shown):]:
        ax.set_visible(False)
    for ax in axes[(rows - 1) * cols:]:
        ax.set_xlabel("step", fontsize=8.5)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Line2D([], [], color="#1f5fa8", label="mean over ranks"), Patch(color="#1f5fa8", alpha=0.15, label="min-max over ranks")]
    handles += [Line2D([], [], color=c, label=f"rank {r}" + (f" ({data.host_of(r)})" if data.host_of(r) else ""))
                for c, r in zip(suspect_colours, suspects)]
    handles += [Line2D([], [], color="#333", linestyle=(0, (3, 1.5)), label=f"rank {r} (injected)") for r in injected_ranks]
    fig.legend(handles=handles, loc="outside upper right", ncols=len(handles), fontsize=8.5, frameon=False)
    fig.supylabel("attention entropy (nats)", fontsize=9.5)
    return _png(fig), shown


# ---------------------------------------------------------------------------------------------
# HTML

_CSS = """
:root { --ink:#1d232b; --muted:#5f6b7a; --line:#e3e7ec; --bg:#f5f7fa; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1220px; margin: 0 auto; padding: 28px 28px 48px; }
header h1 { font-size: 24px; margin: 0 0 2px; letter-spacing: -0.01em; }
header .sub { color: var(--muted); font-size: 12.5px; }
.verdict { margin: 18px 0 14px; padding: 12px 16px; border-radius: 8px; font-size: 15px;
  border-left: 6px solid; background: #fff; }
.verdict.critical { border-color:#d62728; background:#fdecec; }
.verdict.warning { border-color:#ff7f0e; background:#fff4e5; }
.verdict.info { border-color:#1f77b4; background:#eaf2fb; }
.verdict.clean { border-color:#2e7d32; background:#eaf6ec; }
.cards { display:grid; grid-template-columns: repeat(auto-fit, minmax(170px, 1fr)); gap: 10px; }
.card { background:#fff; border:1px solid var(--line); border-radius:8px; padding:10px 14px; }
.card .k { color:var(--muted); font-size:11.5px; text-transform:uppercase; letter-spacing:.05em; }
.card .v { font-size:18px; font-weight:600; margin-top:2px; overflow-wrap:anywhere; }
.card .v small { font-size:12px; font-weight:400; color:var(--muted); }
.card.wide { grid-column: span 2; }
section { background:#fff; border:1px solid var(--line); border-radius:10px; padding:16px 18px; margin-top:18px; }
section h2 { font-size:16px; margin:0 0 4px; }
section p.caption { color:var(--muted); margin:0 0 10px; font-size:12.5px; max-width: 95ch; }
figure { margin:0; }
figure img { width:100%; height:auto; display:block; }
table { border-collapse: collapse; width:100%; font-size:13px; }
th, td { text-align:left; padding:7px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
th { color:var(--muted); font-weight:600; font-size:11.5px; text-transform:uppercase; letter-spacing:.04em; }
td.num { font-variant-numeric: tabular-nums; white-space:nowrap; }
.badge { display:inline-block; padding:1px 8px; border-radius:10px; font-size:11.5px; font-weight:600; color:#fff; }
.badge.critical { background:#d62728; } .badge.warning { background:#ef7d00; } .badge.info { background:#1f77b4; }
.muted { color:var(--muted); }
footer { color:var(--muted); font-size:12px; margin-top:22px; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt_steps(n: int) -> str:
    return f"{n:,}"


def _verdict(incidents: Sequence[Incident], data: RunData, faults: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    if not incidents and faults:
        return "warning", "<b>No incident was raised</b>, although a fault was injected (see below): a missed detection."
    if not incidents:
        return "clean", "No incidents were raised for this run."
    top = sorted(incidents, key=lambda i: (-i.severity.rank, not _is_localised(i, data.world), i.first_step))[0]
    where = ""
    if _is_localised(top, data.world):
        where = " — " + ", ".join(f"rank {r}" + (f" (host {data.host_of(r)})" if data.host_of(r) else "") for r in top.ranks)
    elif top.ranks:
        where = f" — {len(top.ranks)} ranks"
    more = f" and {len(incidents) - 1} more" if len(incidents) > 1 else ""
    return top.severity.value, (
        f"<b>{_e(top.kind.replace('_', ' '))}</b> at step {top.first_step}{_e(where)}: {_e(top.message)}"
        f"<span class='muted'>{_e(more)}</span>"
    )


def _cards(data: RunData, incidents: Sequence[Incident], injected_text: str, suspects: Sequence[int]) -> str:
    by_sev = {s: sum(1 for i in incidents if i.severity.value == s) for s in ("critical", "warning", "info")}
    sev_text = ", ".join(f"{n} {s}" for s, n in by_sev.items() if n) or "none"
    hosts = len({h for h in data.hosts if h})
    wall = data.wall_end - data.wall_start
    cards = [
        ("run", _e(data.run)),
        ("ranks", f"{data.world}" + (f" <small>on {hosts} host{'s' * (hosts != 1)}</small>" if hosts else "")),
        ("steps", f"{_fmt_steps(len(data.steps))} <small>{data.steps[0]}–{data.steps[-1]}</small>"),
        ("records", f"{data.records:,}" + (f" <small>{data.missing:,} missing</small>" if data.missing else "")),
        ("incidents", f"{len(incidents)} <small>{_e(sev_text)}</small>"),
        ("suspect ranks", ", ".join(
            f"{r}" + (f" <small>{_e(data.host_of(r))}</small>" if data.host_of(r) else "") for r in suspects) or "none"),
    ]
    if wall > 0:
        cards.append(("wall time", f"{wall / 60:.1f} min" if wall >= 120 else f"{wall:.0f} s"))
    out = [f"<div class='card'><div class='k'>{k}</div><div class='v'>{v}</div></div>" for k, v in cards]
    if injected_text:
        out.append(f"<div class='card wide'><div class='k'>injected</div><div class='v' style='font-size:14px'>{_e(injected_text)}</div></div>")
    return "<div class='cards'>" + "".join(out) + "</div>"


def _incident_table(incidents: Sequence[Incident]) -> str:
    if not incidents:
        return "<p class='muted'>No incidents were raised for this run.</p>"
    head = "".join(f"<th>{h}</th>" for h in ("#", "kind", "severity", "steps", "ranks", "hosts", "layer", "metric", "status", "message"))
    rows = []
    for n, inc in enumerate(incidents, 1):
        steps = f"{inc.first_step}–{inc.last_step}" if inc.last_step != inc.first_step else f"{inc.first_step}"
        if inc.peak_step is not None and inc.peak_step not in (inc.first_step, inc.last_step):
            steps += f" <span class='muted'>(peak {inc.peak_step})</span>"
        status = "open" if inc.open else f"resolved at {inc.resolved_step}"
        rows.append(
            f"<tr class='incident' data-kind='{_e(inc.kind)}'><td class='num'>{n}</td><td>{_e(inc.kind)}</td>"
            f"<td><span class='badge {inc.severity.value}'>{inc.severity.value}</span></td>"
            f"<td class='num'>{steps}</td><td class='num'>{_e(', '.join(map(str, inc.ranks)) or '–')}</td>"
            f"<td>{_e(', '.join(inc.hosts) or '–')}</td><td class='num'>{'–' if inc.layer is None else inc.layer}</td>"
            f"<td>{_e(inc.metric or '–')}</td><td>{_e(status)}</td><td>{_e(inc.message)}</td></tr>"
        )
    return f"<table id='incidents'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _figure(png: str, alt: str) -> str:
    return f"<figure><img alt='{_e(alt)}' src='data:image/png;base64,{png}'></figure>"


def render_report(data: RunData, incidents: Sequence[Incident], *, title: str | None = None,
                  injected: Any = None, source: str = "") -> str:
    """The report page for ``data`` and ``incidents`` (already loaded) as an HTML string."""
    from sdcwatch import __version__

    incidents = [i for i in incidents if not i.run or i.run == data.run]
    incidents.sort(key=lambda i: (i.first_step, -i.severity.rank))
    faults = _injected_faults(injected)
    injected_text = _describe_injected(injected)
    suspects = _suspect_ranks(incidents, data.world)
    title = title or f"sdcwatch report — {data.run}"
    level, verdict = _verdict(incidents, data, faults)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>",
        f"<header><h1>{_e(title)}</h1><div class='sub'>{_e(source)} · generated "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by sdcwatch {__version__}</div></header>",
        f"<div class='verdict {level}' id='verdict'>{verdict}</div>",
        _cards(data, incidents, injected_text, suspects),
    ]
    if data.other_runs:
        others = ", ".join(f"{_e(r)} ({n:,} records)" for r, n in sorted(data.other_runs.items()))
        parts.append(f"<p class='muted'>The file also holds other runs, not shown: {others}.</p>")

    training = _plot_training(data, incidents, faults)
    if training:
        parts.append(
            "<section id='training'><h2>Loss and gradient norm</h2><p class='caption'>Global values per step; "
            "the band is the spread over ranks. Shaded spans are incidents (numbered as in the table), hatched "
            "ones what was injected. Values far off the scale (a near-infinite loss) sit on the edge as ▲; "
            "steps with a non-finite value show as a purple strip along the top.</p>" + _figure(training, "loss and gradient norm per step") + "</section>"
        )
    heat, used, _ = _plot_heatmap(data, incidents, faults)
    if data.world < _MIN_RANKS:
        parts.append(
            "<section id='ranks'><h2>Which rank strays from the others</h2><p class='caption'>This run has "
            f"{data.world} rank{'s' * (data.world != 1)}: comparing ranks needs at least {_MIN_RANKS}.</p></section>"
        )
    elif heat:
        parts.append(
            "<section id='ranks'><h2>Which rank strays from the others</h2><p class='caption'>Each cell is the "
            f"largest robust z-score of a rank against the median of all ranks at that step, over "
            f"{_e(', '.join(used))}. Data-parallel ranks run the same model on different data, so a healthy rank "
            "stays pale; a faulty one lights up. Dark purple: a non-finite value on this rank only; light purple: "
            "non-finite on most ranks (the corruption has spread and no longer says which rank); grey: no record. "
            "Blue boxes are the ranks incidents named. The bar shows the share of steps each rank was flagged "
            f"(|z| &gt; {_Z_FLAG:g}).</p>"
            + _figure(heat, "rank by step heat map of deviation") + "</section>"
        )
    attention, shown = _plot_attention(data, incidents, suspects, faults)
    if attention:
        n_layers = data.layers[_ENTROPY].shape[2]
        which = "every layer" if len(shown) == n_layers else f"{len(shown)} of {n_layers} layers"
        parts.append(
            "<section id='attention'><h2>Attention entropy per layer</h2><p class='caption'>Mean over ranks "
            f"({which}), with the spread over ranks as a band" + (" and the suspect ranks drawn in colour" if suspects else "")
            + ". Corrupted attention shows as entropy collapsing (one logit dominates) or jumping.</p>"
            + _figure(attention, "attention entropy per layer") + "</section>"
        )
    parts.append(f"<section id='incident-table'><h2>Incidents</h2>{_incident_table(incidents)}</section>")
    notes = []
    if data.duplicates:
        notes.append(f"{data.duplicates:,} duplicate records (same step and rank) were read; the last one counts.")
    if data.missing:
        notes.append(f"{data.missing:,} of {data.present.size:,} rank-steps have no record.")
    parts.append(f"<footer>{' '.join(_e(n) for n in notes)}</footer></main></body></html>")
    return "\n".join(parts)


def write_report(
    records_path: str | Path,
    incidents: Iterable[Incident | Mapping[str, Any]] | str | Path | None,
    out_path: str | Path,
    *,
    title: str | None = None,
    injected: Any = None,
    run: str | None = None,
) -> Path:
    """Write the self-contained HTML report of a captured run and return its path.

    ``incidents`` is a list of :class:`Incident` (or their ``to_dict()`` forms), a path to a
    JSON-lines incidents file, or None. ``injected`` describes what was injected: free text, a
    FaultSpec (or its dict), or a list of them; faults are also drawn on the plots. ``run``
    picks one run when the records file holds several.
    """
    data = load_records(records_path, run=run)
    if incidents is None:
        loaded: list[Incident] = []
    elif isinstance(incidents, (str, Path)):
        loaded = load_incidents(incidents)
    else:
        loaded = []
        for n, inc in enumerate(incidents):
            if isinstance(inc, Incident):
                loaded.append(inc)
            elif isinstance(inc, Mapping):
                try:
                    loaded.append(incident_from_dict(inc))
                except ValueError as exc:
                    raise ReplayError("<incidents>", n + 1, str(exc)) from None
            else:
                raise TypeError(f"incidents[{n}] is a {type(inc).__name__}, not an Incident or a dict")
    page = render_report(data, loaded, title=title, injected=injected, source=str(records_path))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a report
    return out


# ---------------------------------------------------------------------------------------------
# command line


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Declare ``sdcwatch report``'s arguments (on ``parser`` when the CLI passes a subparser)."""
    p = parser or argparse.ArgumentParser(prog="sdcwatch report")
    p.description = "Write a self-contained HTML report of a captured run: loss and gradient norm with incidents, a rank x step heat map of deviation, attention entropy per layer, and the incident table."
    p.add_argument("records", metavar="RECORDS.jsonl", help="records written by the file transport (one JSON record per line)")
    p.add_argument("--incidents", metavar="INCIDENTS.jsonl", help="incidents, one Incident.to_dict() JSON object per line")
    p.add_argument("-o", "--output", metavar="PATH", default="report.html", help="where to write the report (default: report.html)")
    p.add_argument("--title", help="page title (default: 'sdcwatch report — RUN')")
    p.add_argument("--injected", metavar="TEXT|FILE",
                   help="what was injected: free text shown in the header (e.g. 'bitflip on rank 5 at step 120'), "
                        "or a fault file in the injector's format (.json / .jsonl), also drawn on the plots")
    p.add_argument("--run", help="the run to show when the file holds several (default: the one with most records)")
    return p


def report_main(argv: Sequence[str] | None = None) -> int:
    """``sdcwatch report RECORDS.jsonl [--incidents INCIDENTS.jsonl] [-o report.html]``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        injected: Any = args.injected
        if injected and Path(injected).suffix in (".json", ".jsonl") and Path(injected).is_file():
            from sdcwatch.telemetry.faults import load_faults

            injected = [f.to_dict() for f in load_faults(injected)]
        out = write_report(args.records, args.incidents, args.output, title=args.title,
                           injected=injected, run=args.run)
    except SdcwatchError as exc:
        print(f"sdcwatch report: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sdcwatch report: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(report_main())
