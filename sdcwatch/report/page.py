"""The HTML page: the verdict, the summary cards, the figures and the incident table, in one
self-contained file (CSS inline, plots as base64 PNGs) that can be mailed or opened offline.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from sdcwatch import __version__
from sdcwatch.core.errors import ReplayError
from sdcwatch.core.incident import Incident
from sdcwatch.report.data import (
    ENTROPY,
    RunData,
    attention_layer,
    is_localised,
    load_incidents,
    load_records,
    where_in_model,
)
from sdcwatch.report.deviation import CALIBRATION_QUANTILE, MIN_RANKS, TYPICAL_BLOCK, Z_ALARM, Z_FLAG
from sdcwatch.report.plots import plot_attention, plot_heatmap, plot_training


def _injected_faults(injected: Any) -> list[dict[str, Any]]:
    """The injected faults as dicts (FaultSpec objects, dicts, or a list of them); text gives none."""
    if injected is None or isinstance(injected, str):
        return []
    items = injected if isinstance(injected, (list, tuple)) else [injected]
    dicts = [f.to_dict() if hasattr(f, "to_dict") else f for f in items]
    return [dict(f) for f in dicts if isinstance(f, Mapping) and "step" in f]


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


def _suspect_ranks(incidents: Sequence[Incident], world: int) -> list[int]:
    """Ranks blamed by the most severe localised incidents, the most specific first (at most 3)."""
    ranked = sorted(
        (i for i in incidents if is_localised(i, world)), key=lambda i: (-i.severity.rank, len(i.ranks), i.first_step)
    )
    out: list[int] = []
    for inc in ranked:
        for r in inc.ranks:
            if 0 <= r < world and r not in out:
                out.append(r)
    return out[:3]


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
td.status.open { font-weight:600; } td.status.resolved { color:var(--muted); }
footer { color:var(--muted); font-size:12px; margin-top:22px; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


_NOT_GIVEN = (
    "No incidents were given, so this page shows the records only: <code>sdcwatch replay --json RECORDS"
    " &gt; incidents.jsonl</code> runs the detectors over them; pass that file with <code>--incidents</code>."
)


def _verdict(
    incidents: Sequence[Incident], data: RunData, faults: Sequence[Mapping[str, Any]], given: bool
) -> tuple[str, str]:
    if not given:
        return "info", _NOT_GIVEN
    if not incidents and faults:
        return (
            "warning",
            "<b>No incident was raised</b>, although a fault was injected (see below): a missed detection.",
        )
    if not incidents:
        return "clean", "No incidents were raised for this run."
    top = sorted(incidents, key=lambda i: (-i.severity.rank, not is_localised(i, data.world), i.first_step))[0]
    where = ""
    if is_localised(top, data.world):
        where = " — " + ", ".join(
            f"rank {r}" + (f" (host {data.host_of(r)})" if data.host_of(r) else "") for r in top.ranks
        )
    elif top.ranks:
        where = f" — {len(top.ranks)} ranks"
    more = f" and {len(incidents) - 1} more" if len(incidents) > 1 else ""
    return top.severity.value, (
        f"<b>{_e(top.kind.replace('_', ' '))}</b> at step {top.first_step}{_e(where)}: {_e(top.message)}"
        f"<span class='muted'>{_e(more)}</span>"
    )


def _cards(
    data: RunData, incidents: Sequence[Incident], injected_text: str, suspects: Sequence[int], given: bool
) -> str:
    by_sev = {s: sum(1 for i in incidents if i.severity.value == s) for s in ("critical", "warning", "info")}
    sev_text = ", ".join(f"{n} {s}" for s, n in by_sev.items() if n) or "none"
    hosts = len({h for h in data.hosts if h})
    wall = data.wall_end - data.wall_start
    cards = [
        ("run", _e(data.run)),
        ("ranks", f"{data.world}" + (f" <small>on {hosts} host{'s' * (hosts != 1)}</small>" if hosts else "")),
        ("steps", f"{len(data.steps):,} <small>{data.steps[0]}–{data.steps[-1]}</small>"),
        ("records", f"{data.records:,}" + (f" <small>{data.missing:,} missing</small>" if data.missing else "")),
        ("incidents", f"{len(incidents)} <small>{_e(sev_text)}</small>" if given else "not given"),
        (
            "suspect ranks",
            ("rank " if len(suspects) == 1 else "ranks ")
            + ", ".join(
                f"{r}" + (f" <small>{_e(data.host_of(r))}</small>" if data.host_of(r) else "") for r in suspects
            )
            if suspects
            else ("none" if given else "—"),
        ),
    ]
    if wall > 0:
        cards.append(("wall time", f"{wall / 60:.1f} min" if wall >= 120 else f"{wall:.0f} s"))
    out = [f"<div class='card'><div class='k'>{k}</div><div class='v'>{v}</div></div>" for k, v in cards]
    if injected_text:
        out.append(
            f"<div class='card wide'><div class='k'>injected</div><div class='v' style='font-size:14px'>{_e(injected_text)}</div></div>"
        )
    return "<div class='cards'>" + "".join(out) + "</div>"


def _status(inc: Incident, data: RunData) -> tuple[str, str]:
    """(the status cell, its tooltip): as the incidents' last word says; an incident still open
    there in a run whose every rank sent its end-of-run marker was resolved at the run's end (the
    service resolves a run's open incidents when it ends; ``replay`` stops at the end of the file)."""
    if not inc.open:
        return f"resolved at {inc.resolved_step}", ""
    if data.finished and (not inc.run or inc.run == data.run):
        end = int(data.steps[-1])
        return (
            f"resolved at {end} (run end)",
            "open in the incidents file; every rank sent its end-of-run marker, and the service resolves a "
            f"run's open incidents when it ends (at its last step, {end})",
        )
    return "open", ""


def _incident_table(incidents: Sequence[Incident], given: bool, data: RunData) -> str:
    if not given:
        return f"<p class='muted'>{_NOT_GIVEN}</p>"
    if not incidents:
        return "<p class='muted'>No incidents were raised for this run.</p>"
    head = "".join(
        f"<th>{h}</th>"
        for h in ("#", "kind", "severity", "steps", "ranks", "hosts", "where", "metric", "status", "message")
    )
    rows = []
    for n, inc in enumerate(incidents, 1):
        steps = _e(f"{inc.first_step}–{inc.last_step}" if inc.last_step != inc.first_step else f"{inc.first_step}")
        if inc.peak_step is not None and inc.peak_step not in (inc.first_step, inc.last_step):
            steps += f" <span class='muted'>(peak {_e(inc.peak_step)})</span>"
        status, why = _status(inc, data)
        state = "open" if status == "open" else "resolved"
        rows.append(
            f"<tr class='incident' data-kind='{_e(inc.kind)}'><td class='num'>{n}</td><td>{_e(inc.kind)}</td>"
            f"<td><span class='badge {_e(inc.severity.value)}'>{_e(inc.severity.value)}</span></td>"
            f"<td class='num'>{steps}</td><td class='num'>{_e(', '.join(map(str, inc.ranks)) or '–')}</td>"
            f"<td>{_e(', '.join(inc.hosts) or '–')}</td><td>{_e(where_in_model(inc) or '–')}</td>"
            f"<td>{_e(inc.metric or '–')}</td><td class='status {state}'"
            + (f" title='{_e(why)}'" if why else "")
            + f">{_e(status)}</td><td>{_e(inc.message)}</td></tr>"
        )
    return f"<table id='incidents'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _figure(png: str, alt: str) -> str:
    return f"<figure><img alt='{_e(alt)}' src='data:image/png;base64,{png}'></figure>"


def _head(title: str, source: str, level: str, verdict: str) -> list[str]:
    """The page's head, its title line and the verdict."""
    return [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>",
        f"<header><h1>{_e(title)}</h1><div class='sub'>{_e(source)} · generated "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by sdcwatch {__version__}</div></header>",
        f"<div class='verdict {level}' id='verdict'>{verdict}</div>",
    ]


def _training_section(data: RunData, incidents: Sequence[Incident], faults: Sequence[Mapping[str, Any]]) -> str:
    """Loss and gradient norm per step, with the incidents and faults marked ("" without them)."""
    training = plot_training(data, incidents, faults)
    if not training:
        return ""
    return (
        "<section id='training'><h2>Loss and gradient norm</h2><p class='caption'>Global values per step; "
        "the band is the spread over ranks. Shaded spans are incidents (numbered as in the table), hatched "
        "ones what was injected. Values far off the scale (a near-infinite loss) sit on the edge as ▲; "
        "steps with a non-finite value show as a purple strip along the top.</p>"
        + _figure(training, "loss and gradient norm per step")
        + "</section>"
    )


def _ranks_section(data: RunData, incidents: Sequence[Incident], faults: Sequence[Mapping[str, Any]]) -> str:
    """The rank x step heat map of deviation, or why ranks cannot be compared ("" without a score)."""
    heat, deviation, _ = plot_heatmap(data, incidents, faults)
    if data.world < MIN_RANKS:
        return (
            "<section id='ranks'><h2>Which rank strays from the others</h2><p class='caption'>This run has "
            f"{data.world} rank{'s' * (data.world != 1)}: comparing ranks needs at least {MIN_RANKS}.</p></section>"
        )
    if not heat:
        return ""
    scaled = (
        f"a robust z of {deviation.anchor:.3g}, what a typical rank of this run exceeds on one cell in "
        f"{round(100 / (100 - CALIBRATION_QUANTILE))}, is drawn at {Z_FLAG:g}"
        if deviation.anchor > Z_FLAG
        else f"this run's ranks agree closely: the scale is the plain robust z (a typical rank stays under {Z_FLAG:g})"
    )
    return (
        "<section id='ranks'><h2>Which rank strays from the others</h2><p class='caption'>Each cell is the "
        f"largest robust z-score of a rank against the median of all ranks at that step, over "
        f"{_e(', '.join(deviation.metrics))}, the spread never below its typical value over {TYPICAL_BLOCK} steps "
        f"(a step's few ranks give a noisy spread), scaled to this run's own spread between ranks: {_e(scaled)}. "
        "Data-parallel ranks run the same model on different data, so a healthy rank stays pale; orange is "
        f"rarer than anything a typical rank shows, red (from {Z_ALARM:g}) is alarming. Dark purple: a "
        "non-finite value on this rank only; light purple: non-finite on most ranks (the corruption has spread "
        "and no longer says which rank); grey: no record. Blue boxes are the ranks incidents named. The bar "
        f"shows the share of steps each rank's robust z exceeded {Z_FLAG:g} before the scaling, red for a rank "
        "that strays far more often than its peers: a persistent shift too small for one cell's colour.</p>"
        + _figure(heat, "rank by step heat map of deviation")
        + "</section>"
    )


def _sampling(data: RunData) -> str:
    """How often attention was measured, as the caption says it ("" when on every step)."""
    measured = data.measured.get(ENTROPY)
    if measured is None:
        return ""
    at = data.steps[measured.any(axis=1)]
    if len(at) < 2 or len(at) * 2 >= len(data.steps):
        return ""
    every = int(np.median(np.diff(at)))
    return (
        f" Attention is measured on sampled steps (one in {every} here, the probes' <code>attention_every</code>;"
        " loss and gradients every step): each point is one measurement, on the step it was taken."
    )


def _attention_section(
    data: RunData, incidents: Sequence[Incident], suspects: Sequence[int], faults: Sequence[Mapping[str, Any]]
) -> str:
    """Attention entropy per layer ("" when the run has none)."""
    attention, shown, named = plot_attention(data, incidents, suspects, faults)
    if not attention:
        return ""
    framed = "; ".join(
        f"layer {layer} (incident "
        + ", ".join(f"#{n} on {inc.metric}" for n, inc in enumerate(incidents, 1) if attention_layer(inc) == layer)
        + ")"
        for layer in named
    )
    n_layers = data.layers[ENTROPY].shape[2]
    which = "every layer" if len(shown) == n_layers else f"{len(shown)} of {n_layers} layers"
    return (
        "<section id='attention'><h2>Attention entropy per layer</h2><p class='caption'>Mean over ranks "
        f"({which}), with the spread over ranks as a band"
        + (" and the suspect ranks drawn in colour" if suspects else "")
        + ". Corrupted attention shows as entropy collapsing (one logit dominates) or jumping."
        + _sampling(data)
        + " A layer is framed in red when an incident names that attention layer"
        + (f": {_e(framed)}" if framed else " (none here)")
        + "; an incident on a product, a block or a scalar is shaded lightly in every panel.</p>"
        + _figure(attention, "attention entropy per layer")
        + "</section>"
    )


def _guard_section(incidents: Sequence[Incident]) -> str:
    """What the training job's guard did about it, step by step (no silent skips); "" if nothing."""
    guarded = [i for i in incidents if i.kind.startswith("guard_")]
    if not guarded:
        return ""
    items = "".join(
        f"<li>step {i.first_step}"
        + (f"-{i.last_step}" if i.last_step != i.first_step else "")
        + f": <b>{_e(i.kind.removeprefix('guard_'))}</b> — {_e(i.message)}</li>"
        for i in guarded
    )
    return (
        "<section id='guard'><h2>What the guard did</h2><p class='caption'>Steps at which the "
        "training job's guard skipped an update, reran a step, rolled back or evicted a rank "
        "(the last message of each kind).</p><ul>" + items + "</ul></section>"
    )


def _footer(data: RunData) -> str:
    """Notes on the records: duplicates read and rank-steps missing."""
    notes = []
    if data.duplicates:
        notes.append(f"{data.duplicates:,} duplicate records (same step and rank) were read; the last one counts.")
    if data.missing:
        notes.append(f"{data.missing:,} of {data.present.size:,} rank-steps have no record.")
    return f"<footer>{' '.join(_e(n) for n in notes)}</footer></main></body></html>"


def render_report(
    data: RunData,
    incidents: Sequence[Incident] | None,
    *,
    title: str | None = None,
    injected: Any = None,
    source: str = "",
) -> str:
    """The report page for ``data`` and ``incidents`` (already loaded) as an HTML string; None:
    no incidents were given (the page says so rather than calling the run clean)."""
    given = incidents is not None
    incidents = [i for i in incidents or () if not i.run or i.run == data.run]
    incidents.sort(key=lambda i: (i.first_step, -i.severity.rank))
    faults = _injected_faults(injected)
    injected_text = _describe_injected(injected)
    suspects = _suspect_ranks(incidents, data.world)
    title = title or f"sdcwatch report — {data.run}"
    level, verdict = _verdict(incidents, data, faults, given)
    parts = _head(title, source, level, verdict)
    parts.append(_cards(data, incidents, injected_text, suspects, given))
    if data.other_runs:
        others = ", ".join(f"{_e(r)} ({n:,} records)" for r, n in sorted(data.other_runs.items()))
        parts.append(f"<p class='muted'>The file also holds other runs, not shown: {others}.</p>")
    sections = (
        _training_section(data, incidents, faults),
        _ranks_section(data, incidents, faults),
        _attention_section(data, incidents, suspects, faults),
        f"<section id='incident-table'><h2>Incidents</h2>{_incident_table(incidents, given, data)}</section>",
        _guard_section(incidents),
    )
    parts += [section for section in sections if section]
    parts.append(_footer(data))
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
    """Write the self-contained HTML report of a captured run and return its path. ``incidents``:
    :class:`Incident` objects or dicts, a JSON-lines file, or None; ``injected``: free text, a
    FaultSpec or dict, or a list of them (drawn too); ``run``: one of several in the file."""
    data = load_records(records_path, run=run)
    loaded: list[Incident] | None
    if incidents is None:
        loaded = None
    elif isinstance(incidents, (str, Path)):
        loaded = load_incidents(incidents)
    else:
        loaded = []
        for n, inc in enumerate(incidents):
            if isinstance(inc, Incident):
                loaded.append(inc)
            elif isinstance(inc, Mapping):
                try:
                    loaded.append(Incident.from_dict(inc))
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
