"""Rank evidence: a two-sided CUSUM per (feature, rank) of the clipped cross-rank z, so one noisy
step cannot name a rank and a persistent deviation of a couple of scales does. A sparse step
touches only the cells sent (the others decay by ``drift``, brought up to date when next touched).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from sdcwatch.core.jsonsafe import decode_array, encode_array

__all__ = ["RankEvidence", "cusum_step"]


def cusum_step(pos: np.ndarray, neg: np.ndarray, zc: np.ndarray, drift: float) -> None:
    """One step of the two-sided CUSUM, in place: ``pos = max(0, pos + zc - drift)``, ``neg`` likewise for -zc."""
    pos += zc
    pos -= drift
    np.maximum(pos, 0.0, out=pos)
    neg -= zc
    neg -= drift
    np.maximum(neg, 0.0, out=neg)


Flagged = tuple[np.ndarray, np.ndarray, Callable[[int, int], float]]


class RankEvidence:
    """The (features, world) CUSUM evidence of one layout (``sig``: world, metrics and layers)."""

    def __init__(self, threshold: float, drift: float, clip: float) -> None:
        self.threshold, self.drift, self.clip = threshold, drift, clip
        self.sig: str | None = None
        self.pos: np.ndarray | None = None  # CUSUM of positive deviations per (feature, rank)
        self.neg: np.ndarray | None = None
        self.steps = 0
        self._updated: np.ndarray | None = None  # sparse path: step each cell was last brought up to date
        self._hot = np.zeros(0, np.int64)  # sparse path: cells with evidence >= threshold
        self._scores: np.ndarray | None = np.zeros(0)

    def reset(self, sig: str, k: int, world: int) -> None:
        """Start over on a new layout."""
        self.sig = sig
        self.pos = np.zeros((k, world))
        self.neg = np.zeros((k, world))
        self.steps = 0
        self._updated = None
        self._hot = np.zeros(0, np.int64)
        self._scores = np.zeros(world)

    def add_dense(self, z: np.ndarray) -> Flagged:
        """CUSUM step on every cell; (flagged ranks, their evidence, z lookup)."""
        self.materialize(self.steps - 1)  # cells a sparse step left behind catch up first
        pos, neg = self.pos, self.neg
        cusum_step(pos, neg, np.clip(z, -self.clip, self.clip), self.drift)
        evidence = np.maximum(pos, neg).max(axis=0)  # a reduction along rows is fast
        self._scores = evidence / self.threshold
        self._updated = None  # every cell is current
        flagged = np.flatnonzero(evidence >= self.threshold)
        return flagged, evidence[flagged], lambda c, r: float(z[c, r])

    def add_sparse(self, cells: np.ndarray, cell_z: np.ndarray, world: int) -> Flagged:
        """The same CUSUM step touching only the cells sent and the few with evidence above the
        threshold (each cell keeps the step of its last update)."""
        t = self.steps
        P, N = self.pos.reshape(-1), self.neg.reshape(-1)
        if self._updated is None:  # after a dense step or a restore every cell is current as of t - 1
            self._updated = np.full(P.size, t - 1, np.int64)
            self._hot = np.flatnonzero(np.maximum(P, N) >= self.threshold)
        cells = np.asarray(cells, dtype=np.int64).reshape(2, -1)
        sent = cells[0] * world + cells[1]
        zc = np.clip(np.asarray(cell_z, dtype=float), -self.clip, self.clip)
        idle = (t - 1 - self._updated[sent]) * self.drift  # the decay of the steps nobody sent
        p = np.maximum(P[sent] - idle, 0.0)
        n = np.maximum(N[sent] - idle, 0.0)
        cusum_step(p, n, zc, self.drift)
        P[sent], N[sent] = p, n
        self._updated[sent] = t
        hot = np.union1d(self._hot, sent[np.maximum(p, n) >= self.threshold])
        now = self._current(hot)
        self._hot = hot[now >= self.threshold]
        self._scores = None  # per-rank scores on demand (rank_scores)
        flagged = np.unique(self._hot % world)
        evidence = np.array([self.column(int(r)).max() for r in flagged]) if flagged.size else np.zeros(0)
        sent_z = dict(zip(sent.tolist(), np.asarray(cell_z, dtype=float).tolist())) if flagged.size else {}
        return flagged, evidence, lambda c, r: sent_z.get(c * world + r, 0.0)

    def _current(self, flat: np.ndarray) -> np.ndarray:
        """Evidence max(pos, neg) of the given cells as of now."""
        P, N = self.pos.reshape(-1), self.neg.reshape(-1)
        if self._updated is None:
            return np.maximum(P[flat], N[flat])
        idle = (self.steps - self._updated[flat]) * self.drift
        return np.maximum(np.maximum(P[flat] - idle, 0.0), np.maximum(N[flat] - idle, 0.0))

    def column(self, r: int, which: str = "both") -> np.ndarray:
        """(k,) current evidence of rank ``r`` per feature (``pos``, ``neg`` or their max)."""
        k, world = self.pos.shape
        flat = np.arange(k) * world + r
        if which == "both":
            return self._current(flat)
        a = (self.pos if which == "pos" else self.neg).reshape(-1)[flat]
        if self._updated is None:
            return a
        return np.maximum(a - (self.steps - self._updated[flat]) * self.drift, 0.0)

    @property
    def rank_scores(self) -> np.ndarray:
        """(world,) evidence / threshold per rank."""
        if self._scores is None:
            if self.pos is None or not self.pos.size:
                return np.zeros(0 if self.pos is None else self.pos.shape[1])
            k, world = self.pos.shape
            self._scores = self._current(np.arange(k * world)).reshape(k, world).max(axis=0) / self.threshold
        return self._scores

    def materialize(self, upto: int | None = None) -> None:
        """Bring every cell up to step ``upto`` (default: the last step); the sparse path
        leaves idle cells behind."""
        if self._updated is None:
            return
        upto = self.steps if upto is None else upto
        idle = ((upto - self._updated) * self.drift).reshape(self.pos.shape)
        np.maximum(self.pos - idle, 0.0, out=self.pos)
        np.maximum(self.neg - idle, 0.0, out=self.neg)
        self._updated = None

    def snapshot(self) -> dict[str, Any]:
        """The evidence, every cell brought up to date (no ``pos`` when there is no layout yet)."""
        self.materialize()
        if self.sig is None:
            return {"sig": None}
        return {"sig": self.sig, "pos": encode_array(self.pos), "neg": encode_array(self.neg), "steps": self.steps}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("sig") is None:
            self.sig = None
            return
        self.sig = state["sig"]
        self.pos = decode_array(state["pos"])
        self.neg = decode_array(state["neg"])
        self.steps = int(state["steps"])
        self._updated, self._scores = None, None
