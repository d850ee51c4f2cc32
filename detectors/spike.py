"""Spikes over time in the global loss and gradient norm, against the robust baseline every spike
check shares (:mod:`sdcwatch.core.spike_baseline`). Onset, peak and recovery make one incident; a
gradient spike that leaves the loss alone is a ``grad_spike``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.metric_spec import MetricSpec
from sdcwatch.core.spike_baseline import RobustBaseline, SeriesSettings
from sdcwatch.core.validate import check_type
from sdcwatch.detectors.base import DetectorSettings, SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.registry import register

__all__ = ["SpikeConfig", "SpikeDetector"]


@dataclass(frozen=True)
class SpikeConfig(DetectorSettings, section="spike", positive="window warmup scale_alpha"):
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
        super().__post_init__()
        for key in ("loss", "grad_norm", "loss_max"):
            check_type(f"spike.{key}", getattr(self, key), SeriesSettings)


@register(default=True, order=30)
class SpikeDetector(SplitDetector):
    """Loss and gradient-norm spikes of the whole job: ``loss_spike`` at onset, while it lasts and at
    recovery (``metric`` ``loss_max`` when only the highest rank's loss spiked); ``grad_spike`` while
    the loss is calm. ``SERIES`` says what each series reads and how ranks are reduced.

    >>> det = SpikeDetector(warmup=5)
    >>> steps = [StepFrame.single("r", i, ("loss",), np.array([4.0 + 0.01 * (i % 3)])) for i in range(20)]
    >>> [f for frame in steps for f in det.update(frame)]
    []
    >>> [(f.kind, f.evidence["phase"]) for f in det.update(StepFrame.single("r", 20, ("loss",), np.array([9.0])))]
    [('loss_spike', 'onset')]
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

    metrics = (  # the latest global loss and gradient norm, and the spike score of each series
        MetricSpec(
            "sdcwatch_training_loss",
            "gauge",
            ("run",),
            "Latest global training loss (mean over ranks) of the last completed step.",
            read=lambda d: d.latest["loss"],
        ),
        MetricSpec(
            "sdcwatch_training_grad_norm",
            "gauge",
            ("run",),
            "Latest global gradient norm of the last completed step.",
            read=lambda d: d.latest["grad_norm"],
        ),
        MetricSpec(
            "sdcwatch_detector_spike_score",
            "gauge",
            ("run", "metric"),
            "Current spike score of a global metric against its robust trend-aware baseline.",
            read=lambda d: d.scores,
            panel="Spike scores",
        ),
    )

    def __init__(self, config: SpikeConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._base = {k: RobustBaseline(self.window, self.warmup, self.scale_alpha) for k in self.SERIES}
        self._active: dict[str, dict[str, Any] | None] = {k: None for k in self.SERIES}
        self.scores: dict[str, float] = {k: 0.0 for k in self.SERIES}
        self.latest: dict[str, float] = {k: math.nan for k in self.SERIES}
        self.warmup_steps = self.window + self.warmup  # finite values during which it only learns

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
        s: SeriesSettings = getattr(self, key)
        active = self._active[key]
        if active is None:
            if s.spikes(z, ratio):
                self._active[key] = dict(onset=step, peak_step=step, peak=value, peak_ratio=ratio, baseline=base)
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
        score = float(max(z, 0.0)) if phase != "recovery" else 0.0
        return Finding.at(at, self.name, kind, Severity.WARNING, score, msg, metric=key, evidence=evidence)

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
