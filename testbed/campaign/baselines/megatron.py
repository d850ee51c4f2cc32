"""Megatron-LM's checks as a baseline, run on every rank for that rank's own values: a NaN/Inf in the
loss or in the local gradient norm, and the "unexpectedly large" rule, a loss or gradient norm at
least ``factor`` (10) times the largest of the rank's first ``first_n`` (100) values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.base import Detector
from sdcwatch.testbed.campaign.baselines.rank_finding import nonfinite_finding, rank_finding
from sdcwatch.detectors.frame import StepFrame

__all__ = ["MegatronRules", "MegatronConfig"]


@dataclass(frozen=True)
class MegatronConfig:
    """Settings of the Megatron-LM rules baseline."""

    factor: float = 10.0
    """A value at least this multiple of the rank's early maximum is "unexpectedly large"."""
    first_n: int = 100
    """Values of each rank whose maximum is the reference."""
    metrics: tuple[str, ...] = ("loss", "grad_norm_local")
    """The per-rank values checked."""

    def __post_init__(self) -> None:
        check_positive("megatron", factor=self.factor, first_n=self.first_n)
        object.__setattr__(self, "metrics", tuple(self.metrics))


class MegatronRules(Detector):
    """Megatron-LM's per-rank rules: NaN/Inf in loss or local gradient norm; value >= 10x the early max.

    Megatron runs these checks inside every rank (``check_for_nan_in_grad`` on the local gradient
    before the data-parallel all-reduce, the rerun state machine's ``is_unexpectedly_large`` on the
    loss and gradient norm), so a firing rule names the rank it fired on.
    """

    name = "megatron"
    fault = ""
    Config = MegatronConfig
    factor: float
    first_n: int
    metrics: tuple[str, ...]

    def __init__(self, config: MegatronConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._max: dict[str, np.ndarray] = {}  # per metric: (world,) largest of the first values
        self._seen: dict[str, np.ndarray] = {}  # per metric: (world,) how many values were taken

    def update(self, frame: StepFrame) -> list[Finding]:
        out: list[Finding] = []
        for metric in self.metrics:
            col = frame.scalar(metric)
            if col is None:
                continue
            mx, seen = self._max.get(metric), self._seen.get(metric)
            if mx is None or mx.shape[0] != frame.world:
                mx = self._max[metric] = np.full(frame.world, -np.inf)
                seen = self._seen[metric] = np.zeros(frame.world, np.int64)
            present = frame.sent_scalars()[:, frame.scalar_names.index(metric)] & frame.present
            bad = present & ~np.isfinite(col)
            learning = present & ~bad & (seen < self.first_n)
            armed = present & ~bad & (seen >= self.first_n)
            with np.errstate(invalid="ignore"):
                large = armed & (col >= self.factor * mx)
            mx[learning] = np.maximum(mx[learning], col[learning])
            seen[learning] += 1
            if bad.any():
                ranks = np.flatnonzero(bad)
                out.append(nonfinite_finding(self.name, frame, ranks, metric, "NaN/Inf"))
            if large.any():
                ranks = np.flatnonzero(large)
                ratio = float(np.max(col[ranks] / mx[ranks]))
                kind = (IncidentKind.LOSS_SPIKE if metric.startswith("loss") else IncidentKind.GRAD_SPIKE).value
                out.append(
                    rank_finding(
                        self.name,
                        kind,
                        Severity.WARNING,
                        frame,
                        ranks,
                        metric,
                        f"{metric} {ratio:.1f}x the largest of the first {self.first_n} values on {ranks.size} rank(s)",
                        ratio,
                    )
                )
        return out
