"""Missing ranks: a rank absent from many consecutive closed steps (a dead process or host), named
with its coordinates, and a peer group none of whose ranks report (an unwatched model piece). A rank
that sent its end-of-run marker is not missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.mesh import format_coords, peer_key
from sdcwatch.core.metric_spec import MetricSpec
from sdcwatch.detectors.base import DetectorSettings, SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.peers import Groups, coords_of, known_coords, rank_label
from sdcwatch.detectors.registry import register

__all__ = ["MissingRankDetector", "MissingRankConfig"]


@dataclass(frozen=True)
class MissingRankConfig(DetectorSettings, section="missing_rank", positive="after"):
    """Settings of the missing-rank detector ``[detectors.missing_rank]``."""

    after: int = 5
    """Consecutive closed steps a rank must be absent from to be reported missing."""


@register(default=True, order=80)
class MissingRankDetector(SplitDetector):
    """``missing_rank`` (critical) for ranks absent from ``after`` consecutive closed steps.

    Rank 2 of four stops reporting; a rank that comes back is counted afresh:

    >>> import numpy as np
    >>> from sdcwatch.detectors.frame import StepFrame
    >>> def step(s, present):
    ...     p = np.array(present, bool)
    ...     return StepFrame("run", s, 4, ("",) * 4, p, ("loss",), np.where(p, 1.0, np.nan)[:, None])
    >>> det = MissingRankDetector(after=3)
    >>> [(s, f.message) for s in range(4) for f in det.update(step(s, [1, 1, 0, 1]))]
    [(2, '1 rank(s) not reporting for 3+ steps: 2'), (3, '1 rank(s) not reporting for 3+ steps: 2')]
    >>> det.update(step(4, [1, 1, 1, 1])), det.update(step(5, [1, 1, 0, 1]))
    ([], [])
    """

    name = "missing_rank"
    fault = "missing"
    Config = MissingRankConfig
    metrics = (
        MetricSpec(
            "sdcwatch_pipeline_missing_ranks",
            "gauge",
            ("run",),
            "Ranks not heard from for a long time (presumed dead).",
            read=lambda d: d.missing,  # ranks absent for ``after`` steps or more
        ),
    )

    snapshot_fields = {"absent": "_absent"}

    def __init__(self, config: MissingRankConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._absent: np.ndarray | None = None  # consecutive steps each rank was absent
        self.missing = 0  # ranks absent for `after` steps or more

    def observe(self, frame: StepFrame) -> np.ndarray | None:
        """The ranks absent from the step (None for a one-rank run)."""
        if frame.world == 1:  # a closed one-rank step always has its rank
            return None
        absent = ~frame.present
        if frame.departed is not None and frame.departed.shape == absent.shape:
            absent &= ~frame.departed  # a rank that said it left (its end-of-run marker) is not missing
        return np.flatnonzero(absent)

    def judge(self, frame: StepContext, absent: np.ndarray | None) -> list[Finding]:
        if absent is None:
            return []
        if self._absent is None or self._absent.shape[0] != frame.world:
            self._absent = np.zeros(frame.world, np.int64)
        present = np.ones(frame.world, bool)
        present[np.asarray(absent, dtype=np.int64)] = False
        self._absent = np.where(present, 0, self._absent + 1)
        gone = np.flatnonzero(self._absent >= self.after)
        self.missing = int(gone.size)
        if gone.size == 0:
            return []
        ranks = tuple(int(r) for r in gone)
        listed = ", ".join(str(r) for r in ranks[:16]) + (" ..." if len(ranks) > 16 else "")
        coords = known_coords(frame)
        evidence: dict[str, Any] = {"absent_steps": {str(r): int(self._absent[r]) for r in ranks[:16]}}
        message = f"{len(ranks)} rank(s) not reporting for {self.after}+ steps: {listed}"
        if coords is not None:
            evidence["coords"] = {str(r): coords_of(coords, r) for r in ranks[:16]}
            if len(ranks) == 1:
                message = f"{rank_label(frame, ranks[0])} not reporting for {self.after}+ steps"
            peers = Groups.of(coords, frame.world, "peer")
            dark = np.flatnonzero(peers.counts(self._absent < self.after) == 0)
            if dark.size:  # no rank of that model piece reports: nothing to compare it with either
                pieces = []
                for g in dark[:4].tolist():
                    where = coords_of(coords, int(peers.members(g)[0]))
                    pieces.append(format_coords(dict(peer_key(where))))
                evidence["unwatched_pieces"] = pieces
                message += f"; no rank of {'; '.join(p or 'the model' for p in pieces)} reports"
        kind, score = IncidentKind.MISSING_RANK, float(gone.size)
        return [
            Finding.at(
                frame,
                self.name,
                kind,
                Severity.CRITICAL,
                score,
                message,
                metric="present",
                ranks=ranks,
                hosts=(),  # its ranks are absent: named by rank and coordinates only
                evidence=evidence,
            )
        ]
