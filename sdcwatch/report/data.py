"""Loading a captured run: the JSON-lines records into dense arrays (:class:`RunData`), and the
incidents. The one module of the report that reads files; a malformed line is a ReplayError here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from sdcwatch.core.errors import RecordError, ReplayError
from sdcwatch.core.incident import Incident
from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.messages import decode_line, is_end_marker
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import NOUNS, family_of
from sdcwatch.service.offline import bounded_lines

_SCALARS = ("loss", "loss_global", "grad_norm_local", "grad_norm_global", "grad_cosine", "nonfinite", "step_time")
ENTROPY = "attn_entropy"


@dataclass
class RunData:
    """One run's records as dense arrays: ``steps`` (S,), per-rank scalars (S, R), layers (S, R, L).
    A missing record is NaN and False in ``present`` (a reported NaN has ``present`` True);
    ``measured[name]`` (S, R): the records that carried a sampled layer metric; ``ended``: the ranks
    whose end-of-run marker is in the file."""

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
    measured: dict[str, np.ndarray] = field(default_factory=dict)
    ended: frozenset[int] = frozenset()

    @property
    def missing(self) -> int:
        """Rank-steps with no record."""
        return int(self.present.size - self.present.sum())

    @property
    def finished(self) -> bool:
        """Every rank of the run sent its end-of-run marker: the run ended (the service then
        resolves its open incidents)."""
        return self.world > 0 and self.ended >= set(range(self.world))

    def host_of(self, rank: int) -> str:
        return self.hosts[rank] if 0 <= rank < len(self.hosts) else ""


_LIMITS = RecordLimits()


def load_records(path: str | Path, *, run: str | None = None) -> RunData:
    """Read a JSON-lines record file into :class:`RunData`: the run ``run``, by default the one with
    the most records (the others counted in :attr:`RunData.other_runs`)."""
    path = Path(path)
    rows: dict[str, list[tuple]] = {}
    hosts: dict[str, dict[int, str]] = {}
    worlds: dict[str, int] = {}
    seen: dict[str, set[str]] = {}  # scalar names each run reported at least once
    ended: dict[str, set[int]] = {}  # ranks whose end-of-run marker was read, per run
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ReplayError(str(path), 0, f"cannot read records: {exc.strerror or exc}") from None
    with fh:
        for lineno, line in enumerate(bounded_lines(fh, path), 1):
            if not line.strip():
                continue
            try:
                rec = decode_line(line, _LIMITS)
            except RecordError as exc:
                raise ReplayError(str(path), lineno, str(exc)) from None
            if not isinstance(rec, Record):  # layer names, checkpoint notes: the report shows indices
                continue
            if is_end_marker(rec):  # a rank's end-of-run marker (sdcwatch capture keeps them), not a step
                ended.setdefault(rec.run, set()).add(rec.rank)
                continue
            scalars = tuple(rec.scalars.get(k, math.nan) for k in _SCALARS)
            layer = rec.layers.get(ENTROPY)
            row = (rec.step, rec.rank, rec.time, scalars, tuple(layer) if layer is not None else None)
            rows.setdefault(rec.run, []).append(row)
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
    data.ended = frozenset(ended.get(run, ()))
    return data


def _densify(run: str, rows: list[tuple], world: int, hosts: Mapping[int, str], seen: set[str]) -> RunData:
    steps = np.unique(np.fromiter((r[0] for r in rows), dtype=np.uint64, count=len(rows)))
    step_index = {int(s): i for i, s in enumerate(steps)}
    n_steps = len(steps)
    present = np.zeros((n_steps, world), dtype=bool)
    values = np.full((len(_SCALARS), n_steps, world), np.nan)
    n_layers = max((len(r[4]) for r in rows if r[4] is not None), default=0)
    entropy = np.full((n_steps, world, n_layers), np.nan, dtype=np.float32) if n_layers else None
    measured = np.zeros((n_steps, world), dtype=bool)
    duplicates = 0
    times = []
    for step, rank, wall, scalars, layer in rows:
        i = step_index[step]
        duplicates += bool(present[i, rank])
        present[i, rank] = True
        values[:, i, rank] = scalars
        if entropy is not None and layer is not None:
            entropy[i, rank, : len(layer)] = layer
            measured[i, rank] = True
        times.append(wall)
    scalars_out = {name: values[k] for k, name in enumerate(_SCALARS) if name in seen}
    layers = {ENTROPY: entropy} if entropy is not None else {}
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
        measured={ENTROPY: measured} if entropy is not None else {},
    )


def load_incidents(path: str | Path) -> list[Incident]:
    """Read a JSON-lines file of incidents or incident events (``sdcwatch replay --json``, ``sdcwatch
    incidents --json``, the anomalies topic): each incident once, as its last line says."""
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
            incident = Incident.from_dict(_json_object(line))
        except ValueError as exc:
            raise ReplayError(str(path), lineno, str(exc)) from None
        latest.pop(incident.id, None)  # re-insert: order by the last change
        latest[incident.id] = incident
    return sorted(latest.values(), key=lambda i: (i.first_step, -i.severity.rank))


# Read by both the plots (how an incident is labelled) and the page (the verdict, the suspects).
def is_localised(inc: Incident, world: int) -> bool:
    """Whether an incident blames a few ranks (not "ranks 0-5 all went NaN")."""
    return 0 < len(inc.ranks) <= min(3, max(1, world // 2))


def attention_layer(inc: Incident) -> int | None:
    """The attention layer an incident names, or None: its ``layer`` counts attention layers only
    when its metric is of the ``layers`` family (``gemm_canary_fp``'s layer 0 is a product, and
    ``stream_max``'s a block: neither is attention layer 0).

    >>> from sdcwatch.core.incident import Severity
    >>> inc = Incident("i", "r", "replica_divergence", Severity.CRITICAL, 5, 5, "m", metric="gemm_canary_fp", layer=0)
    >>> attention_layer(inc) is None, attention_layer(Incident("j", "r", "k", Severity.WARNING, 5, 5, "m",
    ...     metric="attn_entropy", layer=2))
    (True, 2)
    """
    return inc.layer if inc.layer is not None and family_of(inc.metric) == "layers" else None


def where_in_model(inc: Incident) -> str:
    """What an incident's index points at, read in its metric's family: ``product 11
    (model.layers.1.mlp.gate_proj)``, ``block 3``, ``layer 2``; ``index 4`` for a metric sdcwatch
    does not know; "" without one."""
    if inc.layer is None:
        return ""
    family = family_of(inc.metric)
    text = f"{NOUNS.get(family, 'index') if family else 'index'} {inc.layer}"
    return text + (f" ({inc.layer_name})" if inc.layer_name else "")


def _json_object(line: str) -> dict:
    """The JSON object of one line; ValueError saying what else it is."""
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj
