"""The one robust spike rule the spike detector, the guard and the device skip share: a positive series in log
space against the median of its last ``window`` accepted values, its noise an EWMA of clipped residuals; a spike
reaches robust z ``z_on`` *and* ratio ``min_ratio`` (noise can reach a high z; a real spike is also large).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import check_number, check_positive, settings_from

__all__ = ["SeriesSettings", "RobustBaseline", "SIGMA_PER_MEAN_ABS", "CLIP", "FLOOR"]

#: 1.2533 x the mean absolute residual estimates sigma for Gaussian noise.
SIGMA_PER_MEAN_ABS = 1.2533
#: A residual enters the noise scale clipped at this many scales.
CLIP = 3.0
#: The smallest noise scale (log units): a perfectly smooth series still has one.
FLOOR = 0.002


@dataclass(frozen=True)
class SeriesSettings:
    """When one series counts as spiking."""

    z_on: float = 8.0
    """Robust z (residual over the noise scale) a value must reach to be a spike."""
    min_ratio: float = 1.3
    """And the value must be at least this multiple of the baseline."""
    z_off: float = 3.0
    """The spike is over when z falls below this (the detector's; the guard judges step by step)."""

    def __post_init__(self) -> None:
        check_positive("spike", z_on=self.z_on, z_off=self.z_off, min_ratio=self.min_ratio)
        if not self.z_off < self.z_on:  # hysteresis: the episode must be able to end
            raise ConfigError("spike.z_off", f"must be below z_on ({self.z_on}), got {self.z_off}")
        check_number("spike.min_ratio", self.min_ratio, lo=1.0, lo_open=True)

    @classmethod
    def of(cls, value: Any, owner: str) -> "SeriesSettings":
        """``value`` as settings: itself, or built from a table (TOML, JSON) of its fields."""
        if isinstance(value, dict):
            return settings_from(cls, owner, value)
        if not isinstance(value, cls):
            raise ConfigError(owner, f"must be a SeriesSettings, got {value!r}")
        return value

    def spikes(self, z: float, ratio: float) -> bool:
        """Whether a value with this robust z and ratio to the baseline is a spike."""
        return z >= self.z_on and ratio >= self.min_ratio


class RobustBaseline:
    """Baseline and noise scale of one positive series, in log space (pure Python, O(1) a step).

    >>> b = RobustBaseline(window=5, warmup=5)
    >>> for v in [4.0, 4.1, 3.9, 4.05, 3.95, 4.0, 4.02, 3.98, 4.01, 3.99, 4.0]:
    ...     _ = b.update(v)
    >>> z, ratio, base = b.score(8.0)
    >>> round(base, 2), ratio > 1.9, z > 8
    (4.0, True, True)
    """

    def __init__(self, window: int = 9, warmup: int = 50, scale_alpha: float = 0.02) -> None:
        check_positive("spike", window=window, warmup=warmup, scale_alpha=scale_alpha)
        self.window = int(window)
        self.warmup = int(warmup)
        self.scale_alpha = scale_alpha
        self._buf: deque[float] = deque(maxlen=self.window)
        self._scale = 0.0
        self._n = 0  # values seen after the window filled

    @property
    def baseline(self) -> float:
        """The baseline value (the window's median, out of log space); NaN before any value."""
        return math.exp(self._base()) if self._buf else math.nan

    def _base(self) -> float:
        return sorted(self._buf)[len(self._buf) // 2]

    def score(self, value: float) -> tuple[float, float, float]:
        """(z, ratio to baseline, baseline) of ``value``; (0, 1, NaN) during warm-up or when not positive."""
        if self._n < self.warmup or not (value > 0.0 and math.isfinite(value)):
            return 0.0, 1.0, math.nan
        base = self._base()
        r = math.log(value) - base
        return r / max(self._scale, FLOOR), math.exp(r), math.exp(base)

    def update(self, value: float) -> bool:
        """Learn one value (non-positive and non-finite values are skipped); returns True if used."""
        if not (value > 0.0 and math.isfinite(value)):
            return False
        t = math.log(value)
        if len(self._buf) < self.window:
            self._buf.append(t)
            return True
        base = self._base()
        r = t - base
        if self._n < self.warmup:  # plain running mean of |r| while warming up
            self._scale += (abs(r) * SIGMA_PER_MEAN_ABS - self._scale) / (self._n + 1)
            accepted = t
        else:
            lim = CLIP * max(self._scale, FLOOR)
            cr = max(-lim, min(lim, r))
            self._scale += self.scale_alpha * (abs(cr) * SIGMA_PER_MEAN_ABS - self._scale)
            accepted = base + cr  # a spike enters the window clipped: it cannot drag the baseline
        self._buf.append(accepted)
        self._n += 1
        return True

    def snapshot(self) -> dict[str, Any]:
        return {"buf": list(self._buf), "scale": self._scale, "n": self._n}

    def restore(self, state: dict[str, Any]) -> None:
        self._buf = deque((float(v) for v in state["buf"]), maxlen=self.window)
        self._scale = float(state["scale"])
        self._n = int(state["n"])
