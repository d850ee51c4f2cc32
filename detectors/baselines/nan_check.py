"""The NaN-loss check most training loops have, ``if isnan(loss)`` on each rank, as a baseline."""

from __future__ import annotations

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.detectors.base import Detector
from sdcwatch.detectors.baselines.rank_finding import rank_finding
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.registry import register

__all__ = ["NanLossCheck"]


@register(baseline=True, own=False, order=130)
class NanLossCheck(Detector):
    """``if isnan(loss)`` on every rank: the minimal guard; names the ranks whose loss is NaN."""

    name = "nan_check"
    fault = ""

    def update(self, frame: StepFrame) -> list[Finding]:
        col = frame.scalar("loss")
        if col is None:
            return []
        bad = frame.sent_scalars()[:, frame.scalar_names.index("loss")] & frame.present & np.isnan(col)
        if not bad.any():
            return []
        ranks = np.flatnonzero(bad)
        return [
            rank_finding(
                self.name,
                IncidentKind.NONFINITE.value,
                Severity.CRITICAL,
                frame,
                ranks,
                "loss",
                f"loss is NaN on {ranks.size} rank(s)",
                float(ranks.size),
            )
        ]
