"""Learning-rate jumps: the record's ``lr`` above ``factor`` x its maximum over the last ``window``
steps (a scheduler bug, a bad resume), seen at once where the loss moves only 10-20% a step later.
A warning that names no rank: optimisation, not hardware.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.detectors.base import DetectorSettings, SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.registry import register

__all__ = ["LearningRateJump", "LearningRateJumpConfig"]


@dataclass(frozen=True)
class LearningRateJumpConfig(DetectorSettings, section="lr_jump", positive="factor window"):
    """Settings of the learning-rate jump detector ``[detectors.lr_jump]``."""

    factor: float = 3.0
    """How many times its recent maximum the learning rate must reach to be a jump."""
    window: int = 10
    """Steps of learning rates the jump is measured against."""


@register(default=True, order=40)
class LearningRateJump(SplitDetector):
    """``lr_jump`` (warning, no rank): the learning rate above ``factor`` x its recent maximum."""

    name = "lr_jump"
    fault = "lr_jump"
    Config = LearningRateJumpConfig
    warmup_steps = 1  # one learning rate to compare with
    snapshot_fields = {"recent": "_recent"}

    def __init__(self, config: LearningRateJumpConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._recent: deque[float] = deque(maxlen=int(self.window))

    def observe(self, frame: StepFrame) -> float | None:
        """The step's learning rate (median over the ranks that sent one), or None."""
        col = frame.scalar("lr")
        if col is None:
            return None
        col = col[np.isfinite(col) & frame.present] if col.shape == frame.present.shape else col[np.isfinite(col)]
        return float(np.median(col)) if col.size else None

    def judge(self, frame: StepContext, lr: float | None) -> list[Finding]:
        if lr is None or not lr >= 0:
            return []
        found = []
        before = max(self._recent) if self._recent else None
        if before is not None and before > 0 and lr > self.factor * before:
            ratio = lr / before
            msg = (
                f"learning rate jumped x{ratio:.3g} at step {frame.step} ({before:.3g} -> {lr:.3g}) on every "
                f"rank: optimisation or configuration, no rank blamed"
            )
            evidence = {"attribution": "optimisation_data", "lr": lr, "recent_max": before, "ratio": ratio}
            found.append(
                Finding.at(
                    frame, self.name, IncidentKind.LR_JUMP, Severity.WARNING, ratio, msg, metric="lr", evidence=evidence
                )
            )
        self._recent.append(lr)
        return found
