"""Spikes over time in the global loss and gradient norm, against a robust, trend-aware baseline.

Each series is followed in log space. The baseline is the median of the last few accepted values
(it follows a falling or rising loss within a few steps, and one outlier cannot move it); the
noise scale is an exponentially weighted mean of absolute residuals, each clipped at a few scales
(so a spike hardly inflates it). A step is a spike when its robust z is high *and* the value
exceeds the baseline by a ratio a person would call a spike: micro-batch noise can reach a high
z, a real spike must also be large. Onset, peak and recovery of one spike make one incident.
A gradient spike that leaves the loss alone is reported as ``grad_spike``, never as a loss spike.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.base import SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.registry import register

__all__ = ["SeriesSettings", "SpikeConfig", "RobustBaseline", "SpikeDetector"]


@dataclass(frozen=True)
class SeriesSettings:
    """When one series counts as spiking."""

    z_on: float = 8.0
    """Robust z (residual over the noise scale) a step must reach to open a spike."""
    min_ratio: float = 1.3
    """And the value must be at least this multiple of the baseline."""
    z_off: float = 3.0
    """The spike is over when z falls below this."""

    def __post_init__(self) -> None:
        check_positive("spike", z_on=self.z_on, z_off=self.z_off, min_ratio=self.min_ratio)
        if self.z_off >= self.z_on:
            raise ConfigError("spike.z_off", f"must be below z_on ({self.z_on}), got {self.z_off}")
        if self.min_ratio <= 1.0:
            raise ConfigError("spike.min_ratio", f"must exceed 1.0, got {self.min_ratio}")


class RobustBaseline:
    """Baseline and noise scale of one positive series, in log space (pure Python, O(1) a step).

    >>> b = RobustBaseline(window=5, warmup=5)
    >>> for v in [4.0, 4.1, 3.9, 4.05, 3.95, 4.0, 4.02, 3.98, 4.01, 3.99, 4.0]:
    ...     _ = b.update(v)
    >>> z, ratio, base = b.score(8.0)
    >>> round(base, 2), ratio > 1.9, z > 8
    (4.0, True, True)
    """

    def __init__(
        self, window: int = 9, warmup: int = 50, scale_alpha: float = 0.02, clip: float = 3.0, floor: float = 0.002
    ) -> None:
        check_positive("spike", window=window, warmup=warmup, scale_alpha=scale_alpha, clip=clip, floor=floor)
        self.window = int(window)
        self.warmup = int(warmup)
        self.scale_alpha = scale_alpha
        self.clip = clip
        self.floor = floor  # smallest noise scale (log units): a perfectly smooth series still has one
        self._buf: deque[float] = deque(maxlen=self.window)
        self._scale = 0.0
        self._n = 0  # values seen after the window filled

    @property
    def ready(self) -> bool:
        """True once warm-up is over and scores mean something."""
        return self._n >= self.warmup

    def _base(self) -> float:
        return sorted(self._buf)[len(self._buf) // 2]

    def score(self, value: float) -> tuple[float, float, float]:
        """(z, ratio to baseline, baseline) of ``value``; (0, 1, NaN) when not ready or not positive."""
        if not self.ready or not (value > 0.0 and math.isfinite(value)):
            return 0.0, 1.0, math.nan
        base = self._base()
        r = math.log(value) - base
        return r / max(self._scale, self.floor), math.exp(r), math.exp(base)

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
            self._scale += (abs(r) * 1.2533 - self._scale) / (self._n + 1)
            accepted = t
        else:
            lim = self.clip * max(self._scale, self.floor)
            cr = max(-lim, min(lim, r))
            # 1.2533 * mean|r| estimates sigma for Gaussian noise
            self._scale += self.scale_alpha * (abs(cr) * 1.2533 - self._scale)
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


@dataclass(frozen=True)
class SpikeConfig:
    """Settings of the spike detector ``[detectors.spike]``."""

    loss: SeriesSettings = field(default_factory=SeriesSettings)
    """When the global loss (mean over ranks) counts as spiking."""
    grad_norm: SeriesSettings = field(default_factory=lambda: SeriesSettings(z_on=6.0, min_ratio=4.0))
    """When the global gradient norm counts as spiking (reported only while the loss is calm)."""
    loss_max: SeriesSettings = field(default_factory=lambda: SeriesSettings(z_on=8.0, min_ratio=1.5))
    """When the highest rank's loss counts as spiking (one rank's bad batch barely moves the mean)."""
    window: int = 9
    """Accepted values whose median is the baseline."""
    warmup: int = 50
    """Values (after the window filled) during which the detector only learns."""
    scale_alpha: float = 0.02
    """Weight of each new residual in the noise scale (an exponentially weighted mean)."""

    def __post_init__(self) -> None:
        check_positive("spike", window=self.window, warmup=self.warmup, scale_alpha=self.scale_alpha)
        for key in ("loss", "grad_norm", "loss_max"):
            if not isinstance(getattr(self, key), SeriesSettings):
                raise ConfigError(f"spike.{key}", f"must be a SeriesSettings, got {getattr(self, key)!r}")


@register(default=True, order=30)
class SpikeDetector(SplitDetector):
    """Loss and gradient-norm spikes of the whole job (one value per step, all ranks reduced).

    Reads ``loss_global`` (or the mean of the ranks' ``loss``), ``grad_norm_global`` (median
    over ranks; falls back to ``grad_norm`` and ``grad_norm_local``) and, with two ranks or more,
    the highest rank's ``loss`` (one rank's bad batch barely moves the mean). Emits ``loss_spike``
    on onset, while the spike lasts and at recovery (``metric`` is ``loss_max`` when only one
    rank's loss spiked); ``grad_spike`` (warning) for a gradient-norm spike while the loss is calm.
    """

    name = "spike"
    fault = "loss_spike"
    Config = SpikeConfig
    loss: SeriesSettings
    grad_norm: SeriesSettings
    loss_max: SeriesSettings
    window: int
    warmup: int
    scale_alpha: float

    SERIES = {
        "loss": (("loss_global", "loss"), "mean"),
        "grad_norm": (("grad_norm_global", "grad_norm", "grad_norm_local"), "median"),
        "loss_max": (("loss",), "max"),
    }

    def __init__(self, config: SpikeConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._base = {k: RobustBaseline(self.window, self.warmup, self.scale_alpha) for k in self.SERIES}
        self._active: dict[str, dict[str, Any] | None] = {k: None for k in self.SERIES}
        self.scores: dict[str, float] = {k: 0.0 for k in self.SERIES}
        self.latest: dict[str, float] = {k: math.nan for k in self.SERIES}

    @property
    def warmup_steps(self) -> int:
        """Steps (with a finite value) during which the detector only learns."""
        return self.window + self.warmup

    def _settings(self, series: str) -> SeriesSettings:
        return getattr(self, series)

    def observe(self, frame: StepFrame) -> dict[str, Any]:
        """The step's value of each series (and the rank with the highest loss): all it needs of the ranks."""
        values: dict[str, Any] = {}
        for key, (names, reduce) in self.SERIES.items():
            if key == "loss_max" and frame.world < 2:
                values[key] = math.nan  # one series: the highest rank is the only one
            else:
                values[key] = frame.global_value(*names, reduce=reduce)
        losses = frame.scalar("loss") if frame.world >= 2 else None
        values["max_rank"] = int(np.nanargmax(losses)) if losses is not None and np.isfinite(losses).any() else None
        return values

    def judge(self, at: StepContext, values: dict[str, Any] | None) -> list[Finding]:
        """Advance the baselines and the spike state machines with one step's values."""
        if values is None:
            return []
        measured = {}
        for key in self.SERIES:
            value = float(values[key])
            self.latest[key] = value
            z, ratio, base = self._base[key].score(value)
            self.scores[key] = max(z, 0.0)
            measured[key] = (value, z, ratio, base)
        phases = {k: self._advance(k, at.step, *measured[k]) for k in self.SERIES}
        for key, (value, *_rest) in measured.items():
            self._base[key].update(value)
        findings = []
        if phases["loss"]:
            findings.append(self._finding(at, "loss", phases["loss"], measured, values.get("max_rank")))
        elif phases["loss_max"] and self._active["loss"] is None:
            findings.append(self._finding(at, "loss_max", phases["loss_max"], measured, values.get("max_rank")))
        elif phases["grad_norm"] and self._active["loss"] is None and self._active["loss_max"] is None:
            findings.append(self._finding(at, "grad_norm", phases["grad_norm"], measured, values.get("max_rank")))
        return findings

    def _advance(self, key: str, step: int, value: float, z: float, ratio: float, base: float) -> str:
        """Move the spike state machine of one series; returns the phase to report ('' = none)."""
        s = self._settings(key)
        active = self._active[key]
        if active is None:
            if z >= s.z_on and ratio >= s.min_ratio:
                self._active[key] = {
                    "onset": step,
                    "peak_step": step,
                    "peak": value,
                    "peak_ratio": ratio,
                    "baseline": base,
                }
                return "onset"
            return ""
        if z >= s.z_off:
            if ratio > active["peak_ratio"]:
                active.update(peak_step=step, peak=value, peak_ratio=ratio)
            return "ongoing"
        if not math.isfinite(value):
            return ""  # a NaN step tells nothing about recovery (the non-finite detector has it)
        active["recovered"] = step
        self._active[key] = None
        self._last_recovered = active
        return "recovery"

    def _finding(self, at: StepContext, key: str, phase: str, measured: dict, max_rank: int | None) -> Finding:
        value, z, ratio, base = measured[key]
        state = self._active[key] if phase != "recovery" else self._last_recovered
        kind = (IncidentKind.GRAD_SPIKE if key == "grad_norm" else IncidentKind.LOSS_SPIKE).value
        label = {
            "loss": "loss spike",
            "grad_norm": "gradient-norm spike (loss calm)",
            "loss_max": "loss spike on one rank",
        }[key]
        baseline = state["baseline"]
        evidence = {
            "phase": phase,
            "onset_step": state["onset"],
            "peak_step": state["peak_step"],
            "peak_value": state["peak"],
            "peak_ratio": state["peak_ratio"],
            "baseline": baseline,
            "value": value,
            "z": z,
            "ratio": ratio,
        }
        for other in self.SERIES:
            if other != key:
                evidence[f"{other}_z"] = measured[other][1]
                evidence[f"{other}_ratio"] = measured[other][2]
        if key == "loss_max":
            evidence["max_rank"] = max_rank if phase != "recovery" else state.get("max_rank")
            state.setdefault("max_rank", evidence["max_rank"])
        if phase == "recovery":
            evidence["recovered_step"] = at.step
        msg = f"{label} at step {state['onset']} ({state['peak']:.4g} vs baseline {baseline:.4g})"
        return Finding(
            detector=self.name,
            kind=kind,
            severity=Severity.WARNING,
            run=at.run,
            step=at.step,
            score=float(max(z, 0.0)) if phase != "recovery" else 0.0,
            message=msg,
            metric=key,
            evidence=evidence,
        )

    def metrics_view(self) -> dict[str, Any]:
        """The latest global loss and gradient norm, and the spike score of each series."""
        return {"loss": self.latest["loss"], "grad_norm": self.latest["grad_norm"], "spike_scores": dict(self.scores)}

    def snapshot(self) -> dict[str, Any]:
        return {
            "base": {k: b.snapshot() for k, b in self._base.items()},
            "active": dict(self._active),
            "last_recovered": getattr(self, "_last_recovered", None),
        }

    def restore(self, state: dict[str, Any]) -> None:
        for k, b in self._base.items():
            b.restore(state["base"][k])
        self._active = {k: (dict(v) if v else None) for k, v in state["active"].items()}
        if state.get("last_recovered"):
            self._last_recovered = dict(state["last_recovered"])
