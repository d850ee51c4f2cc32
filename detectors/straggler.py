"""Slow and missing ranks: step time far above the others' persistently, and ranks that stop reporting.

A straggler is a rank whose step time stays well above the cross-rank median (the median of its
ratio over a window of steps, so a few slow steps are nothing); a missing rank is one absent from many consecutive
closed steps (a dead process or host). With mesh coordinates a rank's step time is compared with
its own pipeline stage's median (stages do different work), and a missing rank is named with its
coordinates; a peer group none of whose ranks report is said so (that model piece is unwatched).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdcwatch.core.jsonsafe import decode_array, encode_array
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.base import SplitDetector, StepContext
from sdcwatch.detectors.registry import register
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.mesh import format_coords, peer_key
from sdcwatch.detectors.peers import Groups, coords_of, grouped_median, known_coords, rank_label

__all__ = ["StragglerDetector", "StragglerConfig", "MissingRankDetector", "MissingRankConfig"]


@dataclass(frozen=True)
class StragglerConfig:
    """Settings of the straggler detector ``[detectors.straggler]``."""

    min_ratio: float = 1.5
    """A rank whose typical step time is at least this multiple of the median rank's is a straggler."""
    window: int = 20
    """Steps over which a rank's typical (median) step-time ratio is taken."""
    min_world: int = 3
    """Fewest ranks for a comparison with the median rank (in the world, and in a pipeline stage)."""

    def __post_init__(self) -> None:
        check_positive("straggler", min_ratio=self.min_ratio, window=self.window, min_world=self.min_world)
        if self.min_ratio <= 1:
            raise ConfigError("straggler.min_ratio", f"must be > 1, got {self.min_ratio!r}")


@register(default=True)
class StragglerDetector(SplitDetector):
    """``straggler`` (warning) for a rank persistently ``min_ratio`` times slower than the median.

    Each step, every rank's step time is divided by the median rank's; a rank is a straggler when
    the median of that ratio over the last ``window`` steps is at least ``min_ratio``: more than
    half of its recent steps were slow. A median, not an average, so that a few very slow steps
    (a checkpoint save, a garbage collection, a noisy neighbour) are not a straggler.
    """

    name = "straggler"
    fault = "straggler"
    Config = StragglerConfig
    min_ratio: float
    window: int
    min_world: int

    def __init__(self, config: StragglerConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._ratios: np.ndarray | None = None  # (window, world) log ratios, a ring
        self._steps = 0

    @property
    def warmup_steps(self) -> int:
        return self.window

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
            host = frame.hosts[r]
            base = med if rank_median is None else float(rank_median[r])
            whose = "the median rank's" if rank_median is None else "its pipeline stage's median"
            out.append(
                Finding(
                    detector=self.name,
                    kind=IncidentKind.STRAGGLER.value,
                    severity=Severity.WARNING,
                    run=frame.run,
                    step=frame.step,
                    score=ratio,
                    metric="step_time",
                    ranks=(r,),
                    hosts=(host,) if host else (),
                    message=f"straggler: {rank_label(frame, r)}"
                    + f" persistently slow: typical step {ratio:.2f}x {whose} over {self.window} steps",
                    evidence={
                        "ratio_typical": ratio,
                        "ratio_now": now,
                        "step_time": base * now,
                        "median_step_time": base,
                    },
                )
            )
        return out

    def snapshot(self) -> dict[str, Any]:
        return {"ratios": None if self._ratios is None else encode_array(self._ratios), "steps": self._steps}

    def restore(self, state: dict[str, Any]) -> None:
        self._ratios = None if state["ratios"] is None else decode_array(state["ratios"])
        self._steps = int(state["steps"])


@dataclass(frozen=True)
class MissingRankConfig:
    """Settings of the missing-rank detector ``[detectors.missing_rank]``."""

    after: int = 5
    """Consecutive closed steps a rank must be absent from to be reported missing."""

    def __post_init__(self) -> None:
        check_positive("missing_rank", after=self.after)


@register(default=True)
class MissingRankDetector(SplitDetector):
    """``missing_rank`` (critical) for ranks absent from ``after`` consecutive closed steps."""

    name = "missing_rank"
    fault = "missing"
    Config = MissingRankConfig
    after: int

    def __init__(self, config: MissingRankConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._absent: np.ndarray | None = None
        self.late = 0  # ranks absent at the last step
        self.missing = 0  # ranks absent for `after` steps or more

    def observe(self, frame: StepFrame) -> np.ndarray | None:
        """The ranks absent from the step (None for a one-rank run)."""
        if frame.world == 1:  # a closed one-rank step always has its rank
            return None
        return np.flatnonzero(~frame.present)

    def judge(self, frame: StepContext, absent: np.ndarray | None) -> list[Finding]:
        if absent is None:
            return []
        if self._absent is None or self._absent.shape[0] != frame.world:
            self._absent = np.zeros(frame.world, np.int64)
        present = np.ones(frame.world, bool)
        present[np.asarray(absent, dtype=np.int64)] = False
        self._absent = np.where(present, 0, self._absent + 1)
        self.late = int((self._absent > 0).sum())
        gone = np.flatnonzero(self._absent >= self.after)
        self.missing = int(gone.size)
        if gone.size == 0:
            return []
        ranks = tuple(int(r) for r in gone)
        listed = ", ".join(str(r) for r in ranks[:16]) + (" ..." if len(ranks) > 16 else "")
        coords = known_coords(frame)
        evidence: dict[str, Any] = {"absent_steps": {str(r): int(self._absent[r]) for r in ranks[:16]}}
        message = f"{len(ranks)} rank(s) not reporting for {self.after}+ steps: {listed}"
        if coords is not None:
            evidence["coords"] = {str(r): coords_of(coords, r) for r in ranks[:16]}
            if len(ranks) == 1:
                message = f"{rank_label(frame, ranks[0])} not reporting for {self.after}+ steps"
            peers = Groups.of(coords, frame.world, "peer")
            dark = np.flatnonzero(peers.counts(self._absent < self.after) == 0)
            if dark.size:  # no rank of that model piece reports: nothing to compare it with either
                pieces = []
                for g in dark[:4].tolist():
                    where = coords_of(coords, int(peers.members(g)[0]))
                    pieces.append(format_coords(dict(peer_key(where))))
                evidence["unwatched_pieces"] = pieces
                message += f"; no rank of {'; '.join(p or 'the model' for p in pieces)} reports"
        return [
            Finding(
                detector=self.name,
                kind=IncidentKind.MISSING_RANK.value,
                severity=Severity.CRITICAL,
                run=frame.run,
                step=frame.step,
                score=float(gone.size),
                metric="present",
                ranks=ranks,
                message=message,
                evidence=evidence,
            )
        ]

    def metrics_view(self) -> dict[str, Any]:
        """Ranks not heard from for ``after`` steps or more."""
        return {"missing_ranks": self.missing}

    def snapshot(self) -> dict[str, Any]:
        return {"absent": None if self._absent is None else encode_array(self._absent)}

    def restore(self, state: dict[str, Any]) -> None:
        self._absent = None if state["absent"] is None else decode_array(state["absent"])
