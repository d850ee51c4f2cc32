"""Cross-rank robust z: each rank's value against its peers' median and MAD, every feature at once.
A slow average of the spread bounds the scale from below (ties make one step's MAD 0), and past
``reference_ranks`` ranks the median and MAD come from a fixed, seeded sample (every rank is scored).
"""

from __future__ import annotations

import warnings

import numpy as np
from sdcwatch.detectors.peers import Groups, grouped_robust

__all__ = ["CrossRankZ"]


class CrossRankZ:
    """Robust z of every (feature, rank) against its cross-rank (or peer group's) median and MAD.

    Keeps the typical spread per feature (per (feature, peer group)) and the reference sample
    between steps; :meth:`forget_spread` starts the spread over when the layout changes.
    """

    spread_alpha = 0.05
    """Weight of one step in the typical spread (a slow average: one extreme step barely moves it)."""

    def __init__(self, reference_ranks: int, rel_floor: float, min_world: int) -> None:
        self.reference_ranks = reference_ranks
        self.rel_floor = rel_floor
        self.min_world = min_world
        self.sample: np.ndarray | None = None  # the fixed, seeded reference ranks
        self.spread: np.ndarray | None = None  # typical cross-rank spread per feature (and group)

    def forget_spread(self) -> None:
        self.spread = None

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
        all_finite = finite.all()
        n = Xt.shape[1]
        ref = Xt
        if n > self.reference_ranks:
            ref = Xt[:, self._sample_of(n)]
        if all_finite:
            # one partition per statistic (the upper middle for an even count): np.median
            # would partition twice and average, and the robust scale does not need it
            mid = ref.shape[1] // 2
            med = np.partition(ref, mid, axis=1)[:, mid]
            absdev = np.abs(ref - med[:, None])
            mad = np.partition(absdev, mid, axis=1)[:, mid]
            meandev = absdev.mean(axis=1)
        else:
            Rn = np.where(np.isfinite(ref), ref, np.nan)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                med = np.nanmedian(Rn, axis=1)
                med = np.where(np.isfinite(med), med, 0.0)
                absdev = np.abs(Rn - med[:, None])
                mad = np.nanmedian(absdev, axis=1)
                meandev = np.nanmean(absdev, axis=1)
            mad = np.where(np.isfinite(mad), mad, 0.0)
            meandev = np.where(np.isfinite(meandev), meandev, 0.0)
        dev = Xt - med[:, None]
        # The typical spread (mean absolute deviation scaled to a Gaussian sigma) is the lower
        # bound of the scale; the floor keeps a feature on which all ranks agree to many digits
        # from exploding.
        spread = 1.2533 * meandev
        typical = self._typical(spread) if track else spread
        scale = np.maximum(1.4826 * mad, typical) + self.rel_floor * np.abs(med) + 1e-12
        with np.errstate(invalid="ignore"):
            z = dev / scale[:, None]
        if not all_finite:
            z[~finite] = 0.0
        return z

    def zt_grouped(self, Xt: np.ndarray, peers: Groups, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`zt` against each rank's peer group, and the peer groups with fewer than
        ``min_world`` present ranks (their ranks get z = 0: not judged)."""
        finite = np.isfinite(Xt)
        all_finite = finite.all()
        G = peers.gather(Xt if all_finite else np.where(finite, Xt, np.nan))  # (k, n, largest group)
        if G.shape[-1] > self.reference_ranks:  # a fixed, seeded sample of each group's members
            G = G[..., self._sample_of(G.shape[-1])]
        med, mad, meandev, _ = grouped_robust(G)
        med, mad, meandev = (np.where(np.isfinite(a), a, 0.0) for a in (med, mad, meandev))
        typical = self._typical(1.2533 * meandev)
        scale = np.maximum(1.4826 * mad, typical) + self.rel_floor * np.abs(med) + 1e-12
        ids = peers.ids
        with np.errstate(invalid="ignore"):
            z = (Xt - med[:, ids]) / scale[:, ids]
        if not all_finite:
            z[~finite] = 0.0
        n_present = peers.counts(present)
        small = np.flatnonzero((n_present > 0) & (n_present < self.min_world))
        if small.size:
            z[:, np.isin(ids, small)] = 0.0
        return z, small
