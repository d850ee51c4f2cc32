"""Cross-rank robust z: each rank's value against its peers' median and MAD, every feature at once.
A slow average of the spread bounds the scale from below (ties make one step's MAD 0), and past
``reference_ranks`` ranks the median and MAD come from a fixed, seeded sample (every rank is scored).
"""

from __future__ import annotations

import numpy as np
from sdcwatch.detectors.peers import Groups, grouped_robust

__all__ = ["CrossRankZ"]


class CrossRankZ:
    """Robust z of every (feature, rank) against its cross-rank (or peer group's) median and MAD.

    Keeps the typical spread per feature (per (feature, peer group)) and the reference sample
    between steps; ``spread = None`` starts the spread over (when the layout changes).
    """

    spread_alpha = 0.05
    """Weight of one step in the typical spread (a slow average: one extreme step barely moves it)."""

    def __init__(self, reference_ranks: int, rel_floor: float, min_world: int) -> None:
        self.reference_ranks = reference_ranks
        self.rel_floor = rel_floor
        self.min_world = min_world
        self.sample: np.ndarray | None = None  # the fixed, seeded reference ranks
        self.spread: np.ndarray | None = None  # typical cross-rank spread per feature (and group)

    def _typical(self, spread: np.ndarray) -> np.ndarray:
        """Update the typical spread with this step's and return it."""
        if self.spread is None or self.spread.shape != spread.shape:
            self.spread = spread.copy()
        else:
            self.spread += self.spread_alpha * (spread - self.spread)
        return self.spread

    def _sample_of(self, n: int) -> np.ndarray:
        if self.sample is None or self.sample.size != self.reference_ranks or self.sample.max() >= n:
            self.sample = np.sort(np.random.default_rng(n).choice(n, self.reference_ranks, replace=False))
        return self.sample

    def zt(self, Xt: np.ndarray, track: bool = True) -> np.ndarray:
        """(k, world) robust z of each value against its row's cross-rank median and MAD; ``track``
        uses the typical spread (else this step's); non-finite cells get z = 0 (the non-finite detector's)."""
        finite = np.isfinite(Xt)
        n = Xt.shape[1]
        ref = Xt[:, self._sample_of(n)] if n > self.reference_ranks else Xt
        # all ranks as one group; whether every rank's value is finite (not only the sample's) picks
        # partition (the upper middle) or sort (the mean of the middles) for the median
        med, mad, meandev, _ = grouped_robust(ref[:, None, :], finite=bool(finite.all()))
        return self._z(Xt, finite, med[:, 0], mad[:, 0], meandev[:, 0], None, track)

    def zt_grouped(self, Xt: np.ndarray, peers: Groups, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`zt` against each rank's peer group, and the peer groups with fewer than
        ``min_world`` present ranks (their ranks get z = 0: not judged)."""
        finite = np.isfinite(Xt)
        G = peers.gather(Xt if finite.all() else np.where(finite, Xt, np.nan))  # (k, n, largest group)
        if G.shape[-1] > self.reference_ranks:  # a fixed, seeded sample of each group's members
            G = G[..., self._sample_of(G.shape[-1])]
        med, mad, meandev, _ = grouped_robust(G)
        z = self._z(Xt, finite, med, mad, meandev, peers.ids, True)
        n_present = peers.counts(present)
        small = np.flatnonzero((n_present > 0) & (n_present < self.min_world))
        if small.size:
            z[:, np.isin(peers.ids, small)] = 0.0
        return z, small

    def _z(
        self,
        Xt: np.ndarray,
        finite: np.ndarray,
        med: np.ndarray,
        mad: np.ndarray,
        meandev: np.ndarray,
        cols: np.ndarray | None,
        track: bool,
    ) -> np.ndarray:
        """``Xt``'s deviation from ``med`` (column ``cols[r]`` for rank r) over the robust scale: the MAD,
        bounded below by the typical spread (the mean absolute deviation scaled to a Gaussian sigma)
        and a floor that keeps a feature on which all ranks agree to many digits from exploding."""
        med, mad, meandev = (np.where(np.isfinite(a), a, 0.0) for a in (med, mad, meandev))
        spread = 1.2533 * meandev
        typical = self._typical(spread) if track else spread
        scale = np.maximum(1.4826 * mad, typical) + self.rel_floor * np.abs(med) + 1e-12
        with np.errstate(invalid="ignore"):
            z = (Xt - med[:, cols]) / scale[:, cols]
        if not finite.all():
            z[~finite] = 0.0
        return z
