"""Groups of one step's ranks (:data:`KEYS`: peer, replica, stage, pipeline, tensor), by the mesh
coordinates they share (-1 where a rank gave none: one group without coordinates), and the
per-group statistics the detectors take on every group at once, without a Python loop.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from sdcwatch.core.mesh import DATA_PARALLEL_DIMS, DIMS, format_coords

__all__ = [
    "KEYS",
    "Groups",
    "group_keys",
    "coords_of",
    "known_coords",
    "rank_label",
    "grouped_median",
    "grouped_robust",
]

_PEER = tuple(i for i, d in enumerate(DIMS) if d not in DATA_PARALLEL_DIMS)  # peer_key's dims
_REPLICA = tuple(i for i, d in enumerate(DIMS) if d != "dp_replicate")  # replica_key's dims
_STAGE = (DIMS.index("pp"),)
_PIPELINE = tuple(i for i, d in enumerate(DIMS) if d not in ("pp", "tp"))
_TENSOR = tuple(i for i, d in enumerate(DIMS) if d != "tp")  # the ranks one tensor-parallel all-reduce joins
#: which columns of the coordinate array each grouping keys on
KEYS = {"peer": _PEER, "replica": _REPLICA, "stage": _STAGE, "pipeline": _PIPELINE, "tensor": _TENSOR}


def group_keys(coords: np.ndarray, columns: Sequence[int]) -> np.ndarray:
    """(world,) int group ids: ranks with equal ``coords[:, columns]`` share an id (0..n-1, in key order):

    >>> group_keys(np.array([[0, 0], [0, 1], [1, 0], [1, 1]]), [0]).tolist()
    [0, 0, 1, 1]
    """
    sub = np.asarray(coords, dtype=np.int64)[:, list(columns)] + 1  # -1 (none given) -> 0
    if sub.shape[1] == 0 or not sub.any():
        return np.zeros(sub.shape[0], np.int64)
    radix = sub.max(axis=0) + 1
    if math.prod(int(x) for x in radix) >= 1 << 62:  # coordinates too large for one int64 key
        return np.unique(sub, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)
    key = np.zeros(sub.shape[0], np.int64)
    for j in range(sub.shape[1]):  # mixed radix: a few columns, each a whole-array operation
        key = key * radix[j] + sub[:, j]
    return np.unique(key, return_inverse=True)[1].reshape(-1).astype(np.int64)


@dataclass(frozen=True)
class Groups:
    """One grouping of a step's ranks: ``ids[r]`` is rank r's group, ``n`` the number of groups."""

    ids: np.ndarray
    n: int

    @classmethod
    def of(cls, coords: np.ndarray | None, world: int, kind: str) -> "Groups":
        """The ``kind`` grouping (``peer``, ``replica``, ``stage``, ``pipeline``, ``tensor``) of a coordinate array."""
        if coords is None or not coords.size or coords.max() < 0:  # no coordinates: one data-parallel group
            return cls(np.zeros(world, np.int64), 1 if world else 0)
        ids = group_keys(coords, KEYS[kind])
        return cls(ids, int(ids.max()) + 1 if ids.size else 0)

    @property
    def trivial(self) -> bool:
        """One group: compare every rank with every rank (today's meaning)."""
        return self.n <= 1

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """(n,) ranks in each group."""
        return np.bincount(self.ids, minlength=self.n)

    def counts(self, mask: np.ndarray) -> np.ndarray:
        """(n,) ranks of each group where ``mask`` holds (present ranks, ranks with a value)."""
        return np.bincount(self.ids[mask], minlength=self.n)

    def members(self, g: int) -> np.ndarray:
        """The ranks of group ``g``, ascending."""
        return np.flatnonzero(self.ids == g)

    @functools.cached_property
    def table(self) -> np.ndarray:
        """(n, largest group) rank indices of every group's members, ascending, padded with ``world``
        (an index one past the last rank: gather from an array with a NaN column appended)."""
        world = self.ids.shape[0]
        order = np.argsort(self.ids, kind="stable")
        sizes = self.sizes
        starts = np.cumsum(sizes) - sizes
        width = int(sizes.max()) if sizes.size else 0
        pos = np.arange(world) - np.repeat(starts, sizes)  # each member's place in its group
        t = np.full((self.n, width), world, np.int64)
        t[self.ids[order], pos] = order
        return t

    @property
    def padded(self) -> bool:
        """Whether groups differ in size (the table has padding)."""
        s = self.sizes
        return bool(s.size and s.min() != s.max())

    def gather(self, X: np.ndarray) -> np.ndarray:
        """(..., n, largest group) view of ``X`` (..., world) by group, NaN where a group is shorter."""
        if not self.padded:
            return X[..., self.table]
        ext = np.concatenate([X, np.full(X.shape[:-1] + (1,), np.nan)], axis=-1)
        return ext[..., self.table]


def _middle(S: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Median of rows sorted along the last axis with NaN last, ``count`` finite values each."""
    hi = np.take_along_axis(S, np.maximum(count // 2, 0)[..., None], axis=-1)[..., 0]
    lo = np.take_along_axis(S, np.maximum((count - 1) // 2, 0)[..., None], axis=-1)[..., 0]
    return np.where(count > 0, 0.5 * (lo + hi), np.nan)


def grouped_robust(G: np.ndarray, finite: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(median, MAD, mean absolute deviation, count) over the last axis of a grouped array
    (``Groups.gather``), ignoring non-finite cells (NaN where a group has no value). When every cell
    is finite (``finite``, when the caller knows), partitions instead of sorts (the upper middle of
    an even count)."""
    if G.shape[-1] and (np.isfinite(G).all() if finite is None else finite):
        mid = G.shape[-1] // 2
        med = np.partition(G, mid, axis=-1)[..., mid]
        absdev = np.abs(G - med[..., None])
        mad = np.partition(absdev, mid, axis=-1)[..., mid]
        return med, mad, absdev.mean(axis=-1), np.full(G.shape[:-1], G.shape[-1])
    G = np.where(np.isfinite(G), G, np.nan)
    count = np.isfinite(G).sum(axis=-1)
    med = _middle(np.sort(G, axis=-1), count)
    absdev = np.abs(G - med[..., None])
    mad = _middle(np.sort(absdev, axis=-1), count)
    with np.errstate(invalid="ignore", divide="ignore"):
        meandev = np.nansum(absdev, axis=-1) / count
    return med, mad, np.where(count > 0, meandev, np.nan), count


def grouped_median(X: np.ndarray, groups: Groups) -> tuple[np.ndarray, np.ndarray]:
    """((..., n) median over each group's finite values of ``X`` (..., world), (..., n) their count)."""
    G = groups.gather(np.where(np.isfinite(X), X, np.nan))
    count = np.isfinite(G).sum(axis=-1)
    return _middle(np.sort(G, axis=-1), count), count


def known_coords(at: Any) -> np.ndarray | None:
    """The (world, dims) coordinates of a frame or step summary, or None when no rank gave any
    (records without coordinates: the findings read exactly as they did before coordinates)."""
    coords = getattr(at, "coords", None)
    if coords is None or not np.size(coords) or np.max(coords) < 0:
        return None
    return coords


def coords_of(coords: np.ndarray | None, rank: int) -> dict[str, int]:
    """{dim: index} of ``rank`` (the dims it gave), or {} when the step has no coordinates."""
    if coords is None or not 0 <= rank < len(coords):
        return {}
    return {d: int(v) for d, v in zip(DIMS, coords[rank].tolist()) if v >= 0}


def rank_label(at: Any, rank: int, *, host: bool = True) -> str:
    """``rank 5 (host h3) at pp=0,dp_replicate=2,tp=1``, or ``rank 5 (host h3)`` for a step without
    coordinates: how every finding names a rank. ``at`` is a frame or a step summary."""
    hosts = at.hosts
    name = hosts[rank] if host and rank < len(hosts) and hosts[rank] else ""
    where = format_coords(coords_of(known_coords(at), rank))
    return f"rank {rank}" + (f" (host {name})" if name else "") + (f" at {where}" if where else "")
