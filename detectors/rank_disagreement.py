"""Too few ranks to vote (two or three): whether they plainly disagree, feature by feature. A
feature's gap between the ranks is held against its typical gap (a slow average where they agreed):
``factor`` typical gaps or more *and* values a factor ``ratio`` apart is a disagreement.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from sdcwatch.core.jsonsafe import decode_array, encode_array

__all__ = ["RankDisagreement"]


class RankDisagreement:
    """The typical gap of each feature between a few ranks, and the features they disagree on.

    >>> gaps = RankDisagreement(factor=50.0, ratio=2.0, warmup=3)
    >>> rng = np.random.default_rng(0)
    >>> calm = [gaps.step("sig", 1.0 + 0.01 * rng.standard_normal((1, 2))) for _ in range(20)]
    >>> sum(len(hits) for hits in calm)
    0
    >>> [c for c, _ in gaps.step("sig", np.array([[65.7, 1.1]]))]
    [0]
    """

    alpha = 0.05
    """Weight of one agreeing step in the typical gap (a slow average)."""

    def __init__(self, factor: float, ratio: float, warmup: int, rel_floor: float = 1e-3) -> None:
        self.factor = float(factor)
        self.ratio = float(ratio)
        self.warmup = int(warmup)
        self.rel_floor = float(rel_floor)
        self.sig: str | None = None  # layout the typical gaps belong to
        self.steps = 0
        self.typical = np.zeros(0)

    def step(self, sig: str, X: np.ndarray) -> list[tuple[int, float]]:
        """(feature, gap in typical gaps) of each feature the ranks disagree on at this step, the
        largest first; ``X`` is (features, ranks), NaN where a rank sent nothing. Agreeing
        features teach the typical gap."""
        if sig != self.sig:
            self.sig, self.steps, self.typical = sig, 0, np.full(X.shape[0], np.nan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a feature no rank sent: all NaN
            hi, lo = np.nanmax(X, axis=1), np.nanmin(X, axis=1)
        ok = np.isfinite(hi) & np.isfinite(lo) & (np.isfinite(X).sum(axis=1) >= 2)
        gap = np.where(ok, hi - lo, 0.0)
        level = np.where(ok, np.maximum(np.abs(hi), np.abs(lo)), 0.0)
        typical = np.where(np.isfinite(self.typical), self.typical, gap)
        scale = np.maximum(typical, self.rel_floor * level) + 1e-12
        times = gap / scale
        odd = ok & (times >= self.factor) & (gap >= (1.0 - 1.0 / self.ratio) * level)
        if self.steps < self.warmup:
            odd[:] = False
        learn = ok & ~odd
        self.typical = np.where(learn, typical + self.alpha * (gap - typical), self.typical)
        self.steps += 1
        found = np.flatnonzero(odd)
        return [(int(c), float(times[c])) for c in found[np.argsort(-times[found], kind="stable")]]

    def snapshot(self) -> dict[str, Any]:
        return {"sig": self.sig, "steps": self.steps, "typical": encode_array(self.typical)}

    def restore(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.sig, self.steps = state["sig"], int(state["steps"])
        self.typical = decode_array(state["typical"])
