"""ZClip's z-score on the global gradient norm as a baseline: EMA mean and variance (``alpha`` 0.97)
initialised from the first ``warmup`` (25) norms; a norm with z > 2.5 is a spike, and the EMA is then
updated with ZClip's adaptively clipped value, as ZClip does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.base import Detector
from sdcwatch.detectors.frame import StepFrame

__all__ = ["ZClipDetector", "ZClipConfig"]


@dataclass(frozen=True)
class ZClipConfig:
    """Settings of the ZClip baseline."""

    alpha: float = 0.97
    """EMA weight of the past in the mean and variance of the gradient norm."""
    z_thresh: float = 2.5
    """A norm with a z-score above this is a spike."""
    warmup: int = 25
    """Norms whose mean and variance initialise the EMA."""
    eps: float = 1e-6
    """Added to the standard deviation."""

    def __post_init__(self) -> None:
        check_positive("zclip", alpha=self.alpha, z_thresh=self.z_thresh, warmup=self.warmup, eps=self.eps)
        if self.alpha >= 1:
            raise ConfigError("zclip.alpha", f"must be below 1, got {self.alpha}")


class ZClipDetector(Detector):
    """ZClip's EMA z-score on the global gradient norm, as a detector (z > ``z_thresh`` is a spike).

    A non-finite norm is ignored (it neither alarms nor enters the statistics): ZClip compares
    numbers, and a NaN compares false.
    """

    name = "zclip"
    fault = ""
    Config = ZClipConfig
    alpha: float
    z_thresh: float
    warmup: int
    eps: float

    def __init__(self, config: ZClipConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._buffer: list[float] = []
        self._mean: float | None = None
        self._var = 0.0

    def update(self, frame: StepFrame) -> list[Finding]:
        g = frame.global_value("grad_norm_global", reduce="median")
        if not math.isfinite(g):
            return []
        if self._mean is None:
            self._buffer.append(g)
            if len(self._buffer) >= self.warmup:
                self._mean = sum(self._buffer) / len(self._buffer)
                self._var = sum((x - self._mean) ** 2 for x in self._buffer) / len(self._buffer)
                self._buffer = []
            return []
        std = self._var**0.5
        z = (g - self._mean) / (std + self.eps)
        out: list[Finding] = []
        effective = g
        if z > self.z_thresh:
            effective = self._mean + self.z_thresh * std / (z / self.z_thresh)  # ZClip's adaptive scaling
            out.append(
                Finding(
                    detector=self.name,
                    kind=IncidentKind.GRAD_SPIKE.value,
                    severity=Severity.WARNING,
                    run=frame.run,
                    step=frame.step,
                    score=float(z),
                    metric="grad_norm_global",
                    message=f"gradient norm z-score {z:.1f} > {self.z_thresh} (EMA mean {self._mean:.3g})",
                )
            )
        self._mean = self.alpha * self._mean + (1 - self.alpha) * effective
        self._var = self.alpha * self._var + (1 - self.alpha) * (effective - self._mean) ** 2
        return out
