"""Slow ranks: a rank whose step time stays well above the median rank's (its own pipeline stage's
with mesh coordinates: stages do different work), over a window of steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.detectors.base import DetectorSettings, SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.peers import grouped_median, rank_label
from sdcwatch.detectors.registry import register

__all__ = ["StragglerDetector", "StragglerConfig"]


@dataclass(frozen=True)
class StragglerConfig(DetectorSettings, section="straggler", positive="min_ratio window min_world"):
    """Settings of the straggler detector ``[detectors.straggler]``."""

    min_ratio: float = 1.5
    """A rank whose typical step time is at least this multiple of the median rank's is a straggler."""
    window: int = 20
    """Steps over which a rank's typical (median) step-time ratio is taken."""
    min_world: int = 3
    """Fewest ranks for a comparison with the median rank (in the world, and in a pipeline stage)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_ratio <= 1:
            raise ConfigError("straggler.min_ratio", f"must be > 1, got {self.min_ratio!r}")


@register(default=True, order=70)
class StragglerDetector(SplitDetector):
    """``straggler`` (warning) for a rank persistently ``min_ratio`` times slower than the median.

    Each step, every rank's step time is divided by the median rank's; a rank is a straggler when
    the median of that ratio over the last ``window`` steps is at least ``min_ratio``: more than
    half of its recent steps were slow. A median, not an average, so that a few very slow steps
    (a checkpoint save, a garbage collection, a noisy neighbour) are not a straggler.

    Four ranks; rank 3 takes 3x as long on every step, then 10x as long on one step in four:

    >>> import numpy as np
    >>> from sdcwatch.detectors.frame import StepFrame
    >>> def step(s, times):
    ...     return StepFrame("run", s, 4, ("",) * 4, np.ones(4, bool), ("step_time",), np.array(times)[:, None])
    >>> det = StragglerDetector(window=4)
    >>> found = [f for s in range(8) for f in det.update(step(s, [1.0, 1.0, 1.0, 3.0]))]
    >>> [f.step for f in found]  # silent while its window fills
    [4, 5, 6, 7]
    >>> found[0].message
    "straggler: rank 3 persistently slow: typical step 3.00x the median rank's over 4 steps"
    >>> det = StragglerDetector(window=4)
    >>> [f for s in range(16) for f in det.update(step(s, [1.0, 1.0, 1.0, 10.0 if s % 4 == 0 else 1.0]))]
    []
    """

    name = "straggler"
    fault = "straggler"
    Config = StragglerConfig
    snapshot_fields = {"ratios": "_ratios", "steps": "_steps"}

    def __init__(self, config: StragglerConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.warmup_steps = self.window
        self._ratios: np.ndarray | None = None  # (window, world) log ratios, a ring
        self._steps = 0

    def observe(self, frame: StepFrame) -> dict[str, Any] | None:
        """Each rank's log step-time ratio to the median rank (sparse: only the clearly slow ranks)."""
        if frame.world < self.min_world:
            return None
        t = frame.scalar("step_time")
        if t is None:
            return None
        ok = np.isfinite(t) & (t > 0) & frame.present
        if ok.sum() < self.min_world:
            return None
        med = float(np.median(t[ok]))
        stages = frame.groups("stage")
        by_rank = None
        if stages.trivial:
            base: float | np.ndarray = med
        else:  # each rank against its own stage's median; a stage of too few ranks is not judged
            stage_med, count = grouped_median(np.where(ok, t, np.nan), stages)
            ok &= (count >= self.min_world)[stages.ids]
            base = by_rank = np.where(ok, stage_med[stages.ids], med)
        with np.errstate(all="ignore"):
            lr = np.where(ok, np.log(np.where(ok, t, 1.0) / base), 0.0)
        if not self.sparse:
            return {"median": med, "log_ratio": lr, **({} if by_rank is None else {"rank_median": by_rank})}
        # Only a rank at least sqrt(min_ratio) slower can be a straggler's typical step; the
        # others count as ratio 1. The window's median decides the same way unless a rank sits
        # between the two ratios for most of the window.
        slow = np.flatnonzero(lr >= 0.5 * math.log(self.min_ratio))
        seen = {"median": med, "slow": slow, "slow_log_ratio": lr[slow]}
        if by_rank is not None:
            seen["slow_median"] = by_rank[slow]
        return seen

    def judge(self, frame: StepContext, seen: dict[str, Any] | None) -> list[Finding]:
        if seen is None:
            return []
        med = seen["median"]
        lr = seen.get("log_ratio")
        rank_median = seen.get("rank_median")
        if lr is None:
            lr = np.zeros(frame.world)
            slow_idx = np.asarray(seen["slow"], dtype=np.int64)
            lr[slow_idx] = seen["slow_log_ratio"]
            if seen.get("slow_median") is not None:
                rank_median = np.full(frame.world, med)
                rank_median[slow_idx] = seen["slow_median"]
        if self._ratios is None or self._ratios.shape[1] != frame.world:
            self._ratios = np.zeros((self.window, frame.world))
            self._steps = 0
        self._ratios[self._steps % self.window] = lr
        self._steps += 1
        if self._steps <= self.window:  # warm-up: the window fills, then one more step
            return []
        typical = np.median(self._ratios, axis=0)
        slow = np.flatnonzero(typical >= math.log(self.min_ratio))
        if slow.size == 0 or slow.size > max(1, frame.world // 4):
            return []
        out = []
        for r in slow[np.argsort(-typical[slow])][:8]:
            r = int(r)
            ratio = float(math.exp(typical[r]))
            now = float(math.exp(lr[r]))
            base = med if rank_median is None else float(rank_median[r])
            whose = "the median rank's" if rank_median is None else "its pipeline stage's median"
            out.append(
                Finding.at(
                    frame,
                    self.name,
                    IncidentKind.STRAGGLER,
                    Severity.WARNING,
                    ratio,
                    f"straggler: {rank_label(frame, r)} persistently slow: typical step {ratio:.2f}x {whose} over "
                    f"{self.window} steps",
                    metric="step_time",
                    ranks=(r,),
                    evidence={
                        "ratio_typical": ratio,
                        "ratio_now": now,
                        "step_time": base * now,
                        "median_step_time": base,
                    },
                )
            )
        return out
