"""What a finding or an incident is about: :class:`IncidentKind` (its value is what JSON, labels and
messages carry), and the sets of kinds the incident book, attribution, the demo and the campaign use.

>>> IncidentKind.SDC_SUSPECTED.value in RANK_BLAME_KINDS
True
>>> "loss_spike" in SPIKE_KINDS
True
"""

from __future__ import annotations

import enum

__all__ = [
    "IncidentKind",
    "SPIKE_KINDS",
    "RANK_LOCAL_KINDS",
    "RANK_FAULT_KINDS",
    "RANK_BLAME_KINDS",
    "LOCALISING_KINDS",
    "GUARD_KINDS",
    "guard_action_of",
]


class IncidentKind(str, enum.Enum):
    """Every kind a detector, attribution or a baseline reports."""

    NONFINITE = "nonfinite"
    """NaN, Inf or near-INF values (critical, at the step)."""
    LOSS_SPIKE = "loss_spike"
    """The global loss (or one rank's loss) spiked against its baseline."""
    GRAD_SPIKE = "grad_spike"
    """The gradient norm spiked while the loss stayed calm."""
    RANK_OUTLIER = "rank_outlier"
    """A rank's statistics persistently deviate from the other ranks'."""
    RANK_DEVIATION = "rank_deviation"
    """A rank extreme at one step (info, read by attribution, never an incident)."""
    REPLICA_DIVERGENCE = "replica_divergence"
    """A value every replica must hold bit for bit differs on some rank(s)."""
    STRAGGLER = "straggler"
    """A rank persistently slower than the median rank."""
    MISSING_RANK = "missing_rank"
    """Ranks not reporting for several steps."""
    SDC_SUSPECTED = "sdc_suspected"
    """Attribution: a spike together with rank-local evidence."""
    SILENT_DRIFT = "silent_drift"
    """Attribution: persistent rank-local evidence without a spike."""
    GUARD_SKIP = "guard_skip"
    """The training job's guard skipped the update of a step (on every rank)."""
    GUARD_RERUN = "guard_rerun"
    """The guard reran a step and took the rerun's update (a transient fault)."""
    GUARD_ROLLBACK = "guard_rollback"
    """The guard rolled the job back to a snapshot."""
    GUARD_EVICT = "guard_evict"
    """The guard evicted a rank: the job exits for the launcher to restart without it."""
    CHECKSUM_MISMATCH = "checksum_mismatch"
    """A matrix product's checksum residual above its rounding bound on a rank (critical, at the step)."""
    CHECKSUM_OUTLIER = "checksum_outlier"
    """One rank's checksum residual 10^6 x above the other ranks' 90th percentile (warning)."""
    LR_JUMP = "lr_jump"
    """The learning rate rose several-fold in one step (optimisation, no rank blamed)."""
    RANKS_DISAGREE = "ranks_disagree"
    """Two or three ranks (too few to vote) plainly disagree at a step (info, read by attribution,
    never an incident)."""
    PEERS_TOO_FEW = "peers_too_few"
    """Peer groups with too few ranks for a cross-rank comparison: their ranks are not judged
    (info, never an incident)."""


def _values(*kinds: IncidentKind) -> frozenset[str]:
    return frozenset(k.value for k in kinds)


K = IncidentKind
#: Spikes of the whole job (onset, peak, recovery make one incident).
SPIKE_KINDS = _values(K.LOSS_SPIKE, K.GRAD_SPIKE)
#: Kinds that are about one rank: the incident book keeps one incident per rank for them.
RANK_LOCAL_KINDS = _values(
    K.RANK_OUTLIER, K.SILENT_DRIFT, K.SDC_SUSPECTED, K.STRAGGLER, K.CHECKSUM_MISMATCH, K.CHECKSUM_OUTLIER
)
#: One rank fault seen more clearly over time (outlier -> silent drift -> SDC suspected): they share
#: one incident per rank, whose kind escalates.
RANK_FAULT_KINDS = _values(K.RANK_OUTLIER, K.SILENT_DRIFT, K.SDC_SUSPECTED)
#: Kinds that blame a rank's hardware (the campaign's "attribution: SDC").
RANK_BLAME_KINDS = RANK_FAULT_KINDS | _values(K.REPLICA_DIVERGENCE, K.CHECKSUM_MISMATCH, K.CHECKSUM_OUTLIER)
#: Kinds whose ranks say where a fault is (the demo's "localised to rank r").
LOCALISING_KINDS = RANK_BLAME_KINDS | _values(K.NONFINITE)
#: What the training job's guard did (findings of the guard-action detector), in the order of the guard's actions.
GUARD_KINDS = tuple(k.value for k in (K.GUARD_SKIP, K.GUARD_RERUN, K.GUARD_ROLLBACK, K.GUARD_EVICT))
del K


def guard_action_of(kind: str) -> str | None:
    """The guard action a finding's kind reports (``guard_skip`` -> ``skip``); None for any other kind."""
    return kind[len("guard_") :] if kind in GUARD_KINDS else None
