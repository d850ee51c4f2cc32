"""Findings, incidents and views: a detector turns an aligned step into :class:`Finding` objects,
the incident book folds them into :class:`Incident` objects announced as :class:`IncidentEvent`
to the sinks, and the exporter reads a :class:`ServiceView` at scrape time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np
from sdcwatch.core.jsonsafe import json_float, json_safe, parse_float
from sdcwatch.core.model_place import noun_of, where

__all__ = [
    "Severity",
    "Finding",
    "Incident",
    "IncidentEvent",
    "IncidentSink",
    "RunView",
    "PipelineView",
    "ServiceView",
]


class Severity(str, enum.Enum):
    """How urgently a person should look."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return {"info": 0, "warning": 1, "critical": 2}[self.value]


@dataclass
class Finding:
    """What one detector saw at one step. ``kind``: an :class:`~sdcwatch.core.kinds.IncidentKind`
    value; ``ranks`` empty when it is not rank-local; ``coords`` the mesh coordinates of each of
    ``ranks``, when known. ``around``: the message's text either side of the place it names
    (:func:`~sdcwatch.core.model_place.message_at`), None when it names none."""

    detector: str
    kind: str
    severity: Severity
    run: str
    step: int
    score: float
    message: str
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    metric: str = ""
    layer: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    coords: tuple[dict[str, int], ...] = ()
    layer_name: str | None = None  # the module ``layer`` indexes, when the rank sent its names
    around: tuple[str, str] | None = None  # the message's text either side of its place

    @classmethod
    def at(
        cls, context: Any, detector: str, kind: Any, severity: Severity, score: float, message: str, **fields: Any
    ) -> "Finding":
        """A finding of ``detector`` about ``context``'s run and step (a step frame, a step summary);
        ``kind`` a string or an :class:`~sdcwatch.core.kinds.IncidentKind`; ``fields`` the rest, where
        ``hosts`` defaults to those of ``ranks`` in ``context``."""
        if "hosts" not in fields:  # the known ("" left out) hosts of ``ranks``, sorted
            hosts = context.hosts
            fields["hosts"] = tuple(sorted({hosts[r] for r in fields.get("ranks", ()) if r < len(hosts)} - {""}))
        kind = getattr(kind, "value", kind)
        return cls(detector, kind, severity, context.run, context.step, score, message, **fields)

    def name_module(self, name: str, noun: str | None = None) -> None:
        """Give the finding its module's ``name`` (``noun`` says what ``layer`` counts; default: what
        its metric's family counts) and say it in the message: rendered again from ``around`` and
        the fields, or, for a message that names no place of its own, added at its end."""
        self.layer_name = name
        noun = noun or noun_of(self.metric)
        if self.around is not None:
            self.message = self.around[0] + where(self.metric, self.layer, name, noun) + self.around[1]
        else:
            at = "" if self.layer is None else f" {noun} {self.layer}"
            self.message = f"{self.message} [{self.metric}{at}: {name}]"


@dataclass
class Incident:
    """One problem, from its first to its last step, and its state."""

    id: str
    run: str
    kind: str
    severity: Severity
    first_step: int
    last_step: int
    message: str
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    metric: str = ""
    layer: int | None = None
    score: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)
    detector: str = ""
    peak_step: int | None = None
    resolved_step: int | None = None
    opened_at: float = 0.0  # wall time the incident was opened (service clock)
    resolved_at: float | None = None
    coords: tuple[dict[str, int], ...] = ()  # mesh coordinates of each of ``ranks`` (when known)
    layer_name: str | None = None  # the module ``layer`` indexes (sdcwatch.core.rank_notes), when known
    # what opened it (step, ranks, hosts, metric, layer, layer_name, message, evidence), kept beside the
    # latest: later findings change the fields above; None for an incident from before it was kept
    onset: dict[str, Any] | None = None

    @property
    def open(self) -> bool:
        return self.resolved_step is None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form, used on the anomalies topic, by replay --json and by the sinks."""
        return {
            "id": self.id,
            "run": self.run,
            "kind": self.kind,
            "severity": self.severity.value,
            "step": self.first_step,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "peak_step": self.peak_step,
            "resolved_step": self.resolved_step,
            "ranks": list(self.ranks),
            "hosts": list(self.hosts),
            "metric": self.metric,
            "layer": self.layer,
            "layer_name": self.layer_name,
            "score": json_float(self.score),
            "message": self.message,
            "detector": self.detector,
            "evidence": json_safe(self.evidence),
            "opened_at": self.opened_at,
            "resolved_at": self.resolved_at,
            "open": self.open,
            **({"coords": [dict(c) for c in self.coords]} if self.coords else {}),
            **({"onset": json_safe(self.onset)} if self.onset is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Incident":
        """Inverse of :meth:`to_dict`, also of the anomalies topic's form (``change: resolved`` or
        ``open: false`` resolves it) and of an event wrapping one; ValueError naming the bad field."""
        if isinstance(d.get("incident"), Mapping):
            d = {**d["incident"], "change": d.get("change")}
        for key in ("kind", "severity", "message"):
            if key not in d:
                raise ValueError(f"incident field {key!r} is missing")
        try:
            severity = Severity(d["severity"])
        except ValueError:
            raise ValueError(
                f"incident field 'severity': {d['severity']!r:.40} is not one of info, warning, critical"
            ) from None
        first = d.get("first_step", d.get("step"))
        last = d.get("last_step", first)
        _check_fields(d, first, last)
        resolved_step = d.get("resolved_step")
        if resolved_step is None and (d.get("change") == "resolved" or d.get("open") is False):
            resolved_step = last
        return cls(
            id=str(d.get("id", f"{d['kind']}@{first}")),
            run=str(d.get("run", "")),
            kind=str(d["kind"]),
            severity=severity,
            first_step=first,
            last_step=last,
            message=str(d["message"]),
            ranks=tuple(d.get("ranks") or ()),
            hosts=tuple(str(h) for h in d.get("hosts") or ()),
            metric=str(d.get("metric") or ""),
            layer=d.get("layer"),
            score=parse_float(d.get("score", 0.0)),
            evidence=dict(d.get("evidence") or {}),
            detector=str(d.get("detector") or ""),
            peak_step=d.get("peak_step"),
            resolved_step=resolved_step,
            opened_at=float(d.get("opened_at") or 0.0),
            resolved_at=d.get("resolved_at"),
            coords=tuple({str(k): int(v) for k, v in c.items()} for c in d.get("coords") or ()),
            layer_name=d.get("layer_name"),
            onset=dict(d["onset"]) if d.get("onset") is not None else None,
        )


def _check_fields(d: Mapping[str, Any], first: Any, last: Any) -> None:
    """ValueError naming the first field of an incident's dict with the wrong type."""
    for key, value in (("first_step", first), ("last_step", last)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"incident field {key!r} must be an integer, got {value!r:.40}")
    ranks = d.get("ranks") or ()
    if not isinstance(ranks, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise ValueError(f"incident field 'ranks' must be a list of integers, got {ranks!r:.80}")
    for key, types, what in (
        ("layer", int, "an integer"),
        ("peak_step", int, "an integer"),
        ("resolved_step", int, "an integer"),
        ("opened_at", (int, float), "a number"),
        ("resolved_at", (int, float), "a number"),
    ):
        value = d.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise ValueError(f"incident field {key!r} must be {what} or null, got {value!r:.80}")
    for key, types in (("hosts", (list, tuple)), ("coords", (list, tuple)), ("evidence", Mapping), ("onset", Mapping)):
        if d.get(key) is not None and not isinstance(d[key], types):
            raise ValueError(f"incident field {key!r} has the wrong type: {d[key]!r:.80}")
    if not all(isinstance(c, Mapping) for c in d.get("coords") or ()):
        raise ValueError("incident field 'coords' must be a list of objects")


@dataclass(frozen=True)
class IncidentEvent:
    """A change of an incident: ``change`` is ``opened``, ``updated`` or ``resolved``."""

    change: str
    incident: Incident


class IncidentSink(Protocol):
    """Anything that takes incident changes: the anomalies topic, Alertmanager, a webhook, a log.
    ``publish`` returns quickly and never raises (a network sink sends from its own thread)."""

    def publish(self, event: IncidentEvent) -> None: ...

    def close(self) -> None: ...


@dataclass
class RunView:
    """The latest state of one run, as the exporter shows it (read at scrape time): what is the
    run's; each detector's own numbers are in ``detector_values``."""

    run: str
    world: int
    last_step: int
    last_step_wall: float  # wall time (service clock) when the last step completed
    hosts: list[str]  # (world,) host of each rank ("" when unknown)
    # scalar metric -> (5,) min, q25, median, q75, max over ranks; (len(pieces), 5): over each piece's ranks
    scalar_stats: dict[str, np.ndarray]
    # layer metric -> (n_layers, 5) the same statistics per layer; (len(pieces), n_layers, 5) per piece
    layer_stats: dict[str, np.ndarray]
    steps_total: int = 0
    late_ranks: int = 0  # ranks that missed the alignment deadline at the last closed step
    emitter_dropped: int = 0  # sum over ranks of the records their emitters dropped
    finished: bool = False  # every rank sent its end-of-run marker: the run is over, not stalled
    # the model pieces (peer groups) the statistics are taken over, by sdcwatch.core.mesh.piece_label:
    # ("",) for one piece (plain data parallel), ("pp=0,tp=0", "pp=0,tp=1", ...) under tp/pp
    pieces: tuple[str, ...] = ("",)
    piece_layers: tuple[int, ...] = ()  # layers each piece holds (its ranks sent); () = every layer
    pieces_omitted: int = 0  # pieces past the service's bound, without statistics
    # per piece (as ``pieces``), the names its ranks sent for the indices of indexed metrics
    # ({family: names}, sdcwatch.core.rank_notes); () when none of its ranks sent any
    layer_names: tuple[dict[str, tuple[str, ...]], ...] = ()
    # the metric families the run's detectors declare (sdcwatch.core.metric_spec.MetricSpec), in
    # pipeline order, and their values at this step: metric name -> a number, {label value: number},
    # or a (world,) array of a per-rank metric
    detector_metrics: tuple[Any, ...] = ()
    detector_values: dict[str, Any] = field(default_factory=dict)


@dataclass
class PipelineView:
    """Health of the ingest pipeline."""

    records_total: int = 0
    records_per_second: float = 0.0
    duplicates_total: int = 0
    dead_letters_total: int = 0
    consumer_lag: int = 0  # records behind the end of the topic (all partitions)
    last_record_wall: float = 0.0
    summaries_total: int = 0  # temporal stage: step summaries received from the spatial stage
    summaries_late_total: int = 0  # temporal stage: summaries that came after a later step (dropped)
    late_records_total: int = 0  # records that came after their step had closed (dropped)
    world_changes_total: int = 0  # times a run's world size changed (its steps realigned)
    incomplete_steps_total: int = 0  # steps closed without every rank's record
    dead_letter_reasons: dict[str, int] = field(default_factory=dict)  # dead letters by reason code
    auth_runs_refused: dict[tuple[str, str], int] = field(default_factory=dict)  # (key id, reason) -> messages
    auth_redelivered: dict[str, int] = field(default_factory=dict)  # key id -> messages read again at their place
    consumer_partitions: int = -1  # partitions the reader owns (0: evicted or unassigned; -1: unknown)
    consumer_rebalances_total: int = 0  # times its assignment changed after the first join
    waiting_for_schema: int = 0  # v2 messages held until the message carrying their schema comes
    offset_gaps: dict[str, int] = field(default_factory=dict)  # gaps in partition offsets by outcome
    state_write_errors_total: int = 0  # state snapshots that could not be written (a full or read-only disk)
    state_topic_refused: dict[str, int] = field(default_factory=dict)  # the state topic's snapshots refused, by reason
    runs_total: int = 0  # runs whose detection state is kept
    runs_forgotten_total: int = 0  # stale runs dropped to make room for new ones
    runs_evicted_total: dict[str, int] = field(default_factory=dict)  # why ("finished", "idle") -> runs


@dataclass
class ServiceView:
    """Everything the exporter reads, taken in one consistent snapshot."""

    runs: list[RunView]
    pipeline: PipelineView
    incidents: list[Incident]  # open ones, plus those resolved recently
    incidents_total: dict[tuple[str, str], int]  # (kind, severity) -> count opened so far
    findings_total: dict[tuple[str, str], int]  # (detector, kind) -> count of findings
    checkpoints: list = field(default_factory=list)  # the runs' recent checkpoints and their marks
    hosts: list = field(default_factory=list)  # every tracked host's verdict, worst first (docs/hosts.md)
