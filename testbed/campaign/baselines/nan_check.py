"""The NaN-loss check most training loops have, ``if isnan(loss)`` on each rank, as a baseline."""

from __future__ import annotations

import numpy as np
from sdcwatch.core.incident import Finding
from sdcwatch.detectors.base import Detector
from sdcwatch.testbed.campaign.baselines.rank_finding import nonfinite_finding
from sdcwatch.detectors.frame import StepFrame

__all__ = ["NanLossCheck"]


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
        return [nonfinite_finding(self.name, frame, ranks, "loss", "NaN")]
