"""What teams use today, as detectors on the same aligned steps sdcwatch sees: the benchmark baselines.

Each baseline takes one :class:`~sdcwatch.detectors.frame.StepFrame` per step and answers with
:class:`~sdcwatch.core.incident.Finding` objects, exactly like sdcwatch's own detectors, so the
fault-injection campaign scores every detector with one code path. None of them attributes a
problem to hardware or to the optimisation: a finding names the ranks whose own values tripped the
rule (that is all the operator learns), or no rank when the rule watches a global value.

- :class:`MegatronRules`: Megatron-LM's checks, run on every rank for that rank's own values: a
  NaN/Inf in the loss or in the local gradient norm, and the "unexpectedly large" rule, a loss or
  gradient norm at least ``factor`` (10) times the largest of the rank's first ``first_n`` (100)
  values.
- :class:`ZClipDetector`: ZClip's z-score on the global gradient norm: EMA mean and variance
  (``alpha`` 0.97) initialised from the first ``warmup`` (25) norms; a norm with z > 2.5 is a spike,
  and the EMA is then updated with ZClip's adaptively clipped value, as ZClip does.
- :class:`NanLossCheck`: the guard most training loops have, ``if isnan(loss)``, on each rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.base import Detector
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.registry import register
from sdcwatch.core.incident import Finding, Severity

__all__ = ["MegatronRules", "MegatronConfig", "ZClipDetector", "ZClipConfig", "NanLossCheck"]


def _rank_finding(
    detector: str,
    kind: str,
    severity: Severity,
    frame: StepFrame,
    ranks: np.ndarray,
    metric: str,
    message: str,
    score: float,
) -> Finding:
    ranks_t = tuple(int(r) for r in ranks)
    hosts = tuple(sorted({frame.hosts[r] for r in ranks_t} - {""}))
    return Finding(
        detector=detector,
        kind=kind,
        severity=severity,
        run=frame.run,
        step=frame.step,
        score=float(score),
        message=message,
        ranks=ranks_t,
        hosts=hosts,
        metric=metric,
    )


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


@register(baseline=True, own=False)
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
                out.append(
                    _rank_finding(
                        self.name,
                        IncidentKind.NONFINITE.value,
                        Severity.CRITICAL,
                        frame,
                        ranks,
                        metric,
                        f"{metric} is NaN/Inf on {ranks.size} rank(s)",
                        float(ranks.size),
                    )
                )
            if large.any():
                ranks = np.flatnonzero(large)
                ratio = float(np.max(col[ranks] / mx[ranks]))
                kind = (IncidentKind.LOSS_SPIKE if metric.startswith("loss") else IncidentKind.GRAD_SPIKE).value
                out.append(
                    _rank_finding(
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


@register(baseline=True, own=False)
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


@register(baseline=True, own=False)
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
            _rank_finding(
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
