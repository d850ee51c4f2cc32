"""The vocabulary shared by detectors, the incident book, the service and the exporters.

A detector turns an aligned step into zero or more :class:`Finding` objects; the incident book
folds findings into :class:`Incident` objects (one per problem, not one per step) and announces
each change as an :class:`IncidentEvent` to the sinks (Kafka topic, Alertmanager, webhook, log).
The exporter reads a :class:`ServiceView` at scrape time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from sdcwatch.core.jsonsafe import json_float, json_safe
from sdcwatch.core.where import noun_of, where

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
    """What one detector saw at one step.

    ``kind`` is a stable machine name (``nonfinite``, ``loss_spike``, ``grad_spike``,
    ``rank_outlier``, ``replica_divergence``, ``straggler``, ``missing_rank``, ``sdc_suspected``,
    ``optimisation_instability``, ``silent_drift`` ...). ``ranks`` is empty when the finding
    is not rank-local. ``coords`` gives the mesh coordinates ({dim: index}) of each of ``ranks``,
    in the same order, when the records carry them (the pipeline fills them in).

    ``around`` is the message's text either side of where it names ``metric`` and ``layer``
    (:func:`sdcwatch.core.where.message_at`): the message is ``around[0]``, that place rendered
    from the fields (:func:`~sdcwatch.core.where.where`), ``around[1]``; None for a message that
    names no place, or whose text was composed further.
    """

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
    layer_name: str | None = None  # the module ``layer`` indexes (sdcwatch.core.layer_names), when known

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
        }


@dataclass(frozen=True)
class IncidentEvent:
    """A change of an incident: ``change`` is ``opened``, ``updated`` or ``resolved``."""

    change: str
    incident: Incident


class IncidentSink(Protocol):
    """Anything that takes incident changes: the anomalies topic, Alertmanager, a webhook, a log.

    ``publish`` must return quickly and never raise: a slow or dead receiver must not stall
    detection (sinks that talk to the network queue and send from their own thread).
    """

    def publish(self, event: IncidentEvent) -> None: ...

    def close(self) -> None: ...


@dataclass
class RunView:
    """The latest state of one run, as the exporter shows it (read at scrape time)."""

    run: str
    world: int
    last_step: int
    last_step_wall: float  # wall time (service clock) when the last step completed
    loss: float  # latest global loss (mean over ranks)
    grad_norm: float  # latest global gradient norm
    spike_scores: dict[str, float]  # metric ("loss", "grad_norm") -> current spike score
    rank_scores: np.ndarray  # (world,) accumulated rank-outlier evidence per rank
    hosts: list[str]  # (world,) host of each rank ("" when unknown)
    # scalar metric -> (5,) min, q25, median, q75, max over ranks; (len(pieces), 5): over each piece's ranks
    scalar_stats: dict[str, np.ndarray]
    # layer metric -> (n_layers, 5) the same statistics per layer; (len(pieces), n_layers, 5) per piece
    layer_stats: dict[str, np.ndarray]
    steps_total: int = 0
    late_ranks: int = 0  # ranks that missed the alignment deadline at the last closed step
    missing_ranks: int = 0  # ranks not heard from for a long time (dead)
    emitter_dropped: int = 0  # sum over ranks of the records their emitters dropped
    finished: bool = False  # every rank sent its end-of-run marker: the run is over, not stalled
    # the model pieces (peer groups) the statistics are taken over, by sdcwatch.core.mesh.piece_label:
    # ("",) for one piece (plain data parallel), ("pp=0,tp=0", "pp=0,tp=1", ...) under tp/pp
    pieces: tuple[str, ...] = ("",)
    piece_layers: tuple[int, ...] = ()  # layers each piece holds (its ranks sent); () = every layer
    pieces_omitted: int = 0  # pieces past the service's bound, without statistics
    # per piece (as ``pieces``), the names its ranks sent for the indices of indexed metrics
    # ({family: names}, sdcwatch.core.layer_names); () when none of its ranks sent any
    layer_names: tuple[dict[str, tuple[str, ...]], ...] = ()


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
    consumer_partitions: int = -1  # partitions the reader owns (0: evicted or unassigned; -1: unknown)
    waiting_for_schema: int = 0  # v2 messages held until the message carrying their schema comes
    offset_gaps: dict[str, int] = field(default_factory=dict)  # gaps in partition offsets by outcome
    state_write_errors_total: int = 0  # state snapshots that could not be written (a full or read-only disk)
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
