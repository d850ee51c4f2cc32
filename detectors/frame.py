"""StepFrame: one run's step across all ranks, as the numpy matrices every detector works on whole
(never one record at a time), and how it is assembled from either wire's records.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
from sdcwatch.core.mesh import DIMS
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import CHECK_METRICS, FINGERPRINTS, LAYER_METRICS, SCALARS
from sdcwatch.detectors.peers import Groups
from sdcwatch.detectors.piece_stats import QUANTILES, piece_stats

__all__ = ["StepFrame", "assemble_frame", "frame_stats", "DIM_INDEX", "ordered_names"]

#: Column of each mesh dim in :attr:`StepFrame.coords`.
DIM_INDEX = {d: i for i, d in enumerate(DIMS)}


def ordered_names(known: Sequence[str], seen: Iterable[str]) -> tuple[str, ...]:
    """Names in ``known`` order first (those seen), then the others seen, sorted: a stable column order.

    >>> ordered_names(("loss", "grad_norm_local", "lr"), {"lr", "zeta", "loss", "alpha"})
    ('loss', 'lr', 'alpha', 'zeta')
    """
    seen = set(seen)
    return tuple(n for n in known if n in seen) + tuple(sorted(seen.difference(known)))


@dataclass
class StepFrame:
    """One step of one run, all ranks side by side; missing values are NaN, absent ranks' rows NaN.

    ``scalars`` is (world, n_scalars), ``layers`` (world, n_layer_metrics, n_layers),
    ``fingerprints`` (world, n_fp) uint64, ``coords`` (world, len(DIMS)) with -1 for a coordinate
    not given (None without ranks' records). ``ranks_known`` is False for a single series no rank
    sent (a CSV log): no finding names a rank.
    """

    run: str
    step: int
    world: int
    hosts: tuple[str, ...]
    present: np.ndarray
    scalar_names: tuple[str, ...]
    scalars: np.ndarray
    layer_names: tuple[str, ...] = ()
    layers: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0)))
    fp_names: tuple[str, ...] = ()
    fingerprints: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint64))
    fp_present: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), bool))
    scalar_sent: np.ndarray | None = None  # (world, n_scalars) bool: NaN sent vs not sent
    layer_sent: np.ndarray | None = None  # (world, n_layer_metrics) int: layers sent per metric
    times: np.ndarray | None = None
    coords: np.ndarray | None = None
    wall: float = 0.0  # service clock when the step was closed
    complete: bool = True
    ranks_known: bool = True
    departed: np.ndarray | None = None  # (world,) bool: ranks that sent their end-of-run marker: absent, not missing
    _groups: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_records(
        cls, run: str, step: int, world: int, records: Sequence[Record], *, wall: float = 0.0
    ) -> "StepFrame":
        """Assemble the frame of one step; ``records`` hold at most one record per rank."""
        return assemble_frame(run, step, world, records, (), wall=wall)

    @classmethod
    def single(
        cls,
        run: str,
        step: int,
        names: tuple[str, ...],
        values: np.ndarray,
        sent: np.ndarray | None = None,
    ) -> "StepFrame":
        """A one-rank frame of global scalars (offline replay of a loss log); ``values`` is (n,)."""
        values = np.asarray(values, dtype=float).reshape(1, -1)
        return cls(
            run=run,
            step=step,
            world=1,
            hosts=("",),
            present=np.ones(1, bool),
            scalar_names=names,
            scalars=values,
            scalar_sent=None if sent is None else np.asarray(sent, bool).reshape(1, -1),
            ranks_known=False,
        )

    def scalar(self, name: str) -> np.ndarray | None:
        """The (world,) column of a scalar, or None when no rank sent it."""
        try:
            return self.scalars[:, self.scalar_names.index(name)]
        except ValueError:
            return None

    def global_value(self, *names: str, reduce: str = "mean") -> float:
        """The first of ``names`` any rank sent, its finite values reduced over present ranks by
        ``reduce`` (``mean``, ``median`` or ``max``); non-finite when none is finite, NaN if none sent."""
        for name in names:
            if name not in self.scalar_names:
                continue
            if self.world == 1:  # offline replay of a single series: the hot path there
                return float(self.scalars[0, self.scalar_names.index(name)])
            col = self.scalar(name)[self.present]
            if col.size == 0:
                continue
            finite = col[np.isfinite(col)]
            if finite.size == 0:
                return float(col[0])
            if reduce == "max":
                return float(finite.max())
            return float(np.median(finite) if reduce == "median" else finite.mean())
        return float("nan")

    def sent_scalars(self) -> np.ndarray:
        """(world, n_scalars) bool: which scalar cells hold a value a rank actually sent."""
        if self.scalar_sent is not None:
            return self.scalar_sent
        return np.broadcast_to(self.present[:, None], self.scalars.shape)

    def sent_positions(self, name: str, ranks: set[int], below: float = float("inf")) -> list[tuple[int, float]]:
        """(rank, value), in rank order, of ``ranks`` that sent scalar ``name`` (an index or an ordinal)
        as a finite value in ``[0, below)``."""
        col = self.scalar(name)
        if col is None or not ranks:
            return []
        r = np.array(sorted(ranks))
        v = col[r]
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(v) & (v >= 0) & (v < below) & self.sent_scalars()[r, self.scalar_names.index(name)]
        return [(int(a), float(b)) for a, b in zip(r[ok], v[ok])]

    def sent_layers(self) -> np.ndarray:
        """(world, n_metrics, n_layers) bool: which layer cells hold a value a rank actually sent."""
        if self.layer_sent is None:
            return np.broadcast_to(self.present[:, None, None], self.layers.shape)
        return np.arange(self.n_layers)[None, None, :] < self.layer_sent[:, :, None]

    def groups(self, kind: str) -> Groups:
        """The ``peer``, ``replica``, ``stage`` or ``pipeline`` grouping of the step's ranks
        (:mod:`~sdcwatch.detectors.peers`), computed once per frame; one group without coordinates."""
        if self._groups.get("coords") is not self.coords:  # computed for other coordinates
            self._groups.clear()
            self._groups["coords"] = self.coords
        g = self._groups.get(kind)
        if g is None:
            g = self._groups[kind] = Groups.of(self.coords, self.world, kind)
        return g

    @property
    def peers(self) -> Groups:
        """Ranks holding the same model piece (compared with each other)."""
        return self.groups("peer")

    @property
    def replicas(self) -> Groups:
        """Ranks holding the same shard of the same piece (their fingerprints must agree)."""
        return self.groups("replica")

    @property
    def n_layers(self) -> int:
        return int(self.layers.shape[2]) if self.layers.ndim == 3 else 0


def frame_stats(frame: StepFrame) -> dict[str, Any]:
    """Cross-rank quantiles (min, q25, median, q75, max) of every scalar and layer metric; with
    several model pieces also per piece (``pieces``, :func:`~sdcwatch.detectors.piece_stats.piece_stats`)."""
    scalar_stats = {}
    for j, name in enumerate(frame.scalar_names):
        col = frame.scalars[:, j]
        col = col[np.isfinite(col)]
        if col.size:
            scalar_stats[name] = np.quantile(col, QUANTILES)
    layer_stats = {}
    if frame.layers.size:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN layer gives NaN stats
            for m, name in enumerate(frame.layer_names):
                block = np.where(np.isfinite(frame.layers[:, m, :]), frame.layers[:, m, :], np.nan)
                layer_stats[name] = np.nanquantile(block, QUANTILES, axis=0).T
    out: dict[str, Any] = {"scalars": scalar_stats, "layers": layer_stats}
    pieces = piece_stats(frame)
    if pieces is not None:
        out["pieces"] = pieces
    return out


def _laid_out(
    run: str, step: int, world: int, records: Sequence[Record], blocks: Sequence[tuple[Any, np.ndarray]], wall: float
) -> StepFrame:
    """An empty frame with a column for every name any record or block of the step sent, in the order
    :func:`ordered_names` gives (the known names first), as long as the longest layer list; every
    cell NaN (unsent) until a rank's record fills it."""
    sseen: set[str] = {n for r in records for n in r.scalars}
    lseen: set[str] = {n for r in records for n in r.layers}
    fseen: set[str] = {n for r in records for n in r.fingerprints}
    n_layers = max((len(v) for r in records for v in r.layers.values()), default=0)
    for cols, _ in blocks:
        sch = cols.schema
        sseen.update(sch.scalars)
        fseen.update(sch.fingerprints)
        lseen.update(n for n, _ in sch.layers)
        n_layers = max([n_layers, *(k for _, k in sch.layers)])
    snames, fnames = ordered_names(SCALARS, sseen), ordered_names(FINGERPRINTS, fseen)
    lnames = ordered_names(LAYER_METRICS + CHECK_METRICS, lseen)
    return StepFrame(
        run=run,
        step=step,
        world=world,
        hosts=(),
        present=np.zeros(world, bool),
        scalar_names=snames,
        scalars=np.full((world, len(snames)), np.nan),
        layer_names=lnames,
        layers=np.full((world, len(lnames), n_layers), np.nan),
        fp_names=fnames,
        fingerprints=np.zeros((world, len(fnames)), np.uint64),
        fp_present=np.zeros((world, len(fnames)), bool),
        scalar_sent=np.zeros((world, len(snames)), bool),
        layer_sent=np.zeros((world, len(lnames)), np.int32),
        times=np.full(world, np.nan),
        coords=np.full((world, len(DIMS)), -1, np.int32),  # -1: not given
        wall=wall,
    )


def _fill_blocks(f: StepFrame, hosts: np.ndarray, blocks: Sequence[tuple[Any, np.ndarray]]) -> None:
    """Fill the rows of wire-v2 column blocks, a block's every rank at once (fancy indexing)."""
    sidx = {n: i for i, n in enumerate(f.scalar_names)}
    lidx = {n: i for i, n in enumerate(f.layer_names)}
    fidx = {n: i for i, n in enumerate(f.fp_names)}
    for cols, idx in blocks:
        sch = cols.schema
        whole = len(idx) == len(cols.rows)
        rows = cols.rows if whole else cols.rows[idx]
        r = rows["rank"].astype(np.intp)
        f.present[r] = True
        f.times[r] = rows["time"]
        hosts[r] = cols.hosts[cols.host if whole else cols.host[idx]]
        if sch.coords:
            f.coords[r[:, None], [DIM_INDEX[d] for d in sch.coords]] = rows["coords"]
        if sch.scalars:
            si = np.array([sidx[n] for n in sch.scalars])
            f.scalars[r[:, None], si] = rows["scalars"]
            f.scalar_sent[r[:, None], si] = True
        if sch.fingerprints:
            fi = np.array([fidx[n] for n in sch.fingerprints])
            f.fingerprints[r[:, None], fi] = rows["fingerprints"]
            f.fp_present[r[:, None], fi] = True
        lv = rows["layers"]
        for (name, k), off in zip(sch.layers, sch.layer_offsets):
            li = lidx[name]
            f.layers[r, li, :k] = lv[:, off : off + k]
            f.layer_sent[r, li] = k


def _fill_records(f: StepFrame, hosts: np.ndarray, records: Sequence[Record]) -> None:
    """Fill the rows of wire-v1 records (in a mixed step too), one record at a time."""
    sidx = {n: i for i, n in enumerate(f.scalar_names)}
    lidx = {n: i for i, n in enumerate(f.layer_names)}
    fidx = {n: i for i, n in enumerate(f.fp_names)}
    present, times, coords = f.present, f.times, f.coords
    scalars, ssent, layers, lsent = f.scalars, f.scalar_sent, f.layers, f.layer_sent
    fps, fpp = f.fingerprints, f.fp_present
    for rec in records:
        r = rec.rank
        present[r] = True
        hosts[r] = rec.host
        times[r] = rec.time
        for d, v in rec.coords.items():
            coords[r, DIM_INDEX[d]] = v
        for n, v in rec.scalars.items():
            scalars[r, sidx[n]] = v
            ssent[r, sidx[n]] = True
        for n, v in rec.layers.items():
            layers[r, lidx[n], : len(v)] = v
            lsent[r, lidx[n]] = len(v)
        for n, v in rec.fingerprints.items():
            fps[r, fidx[n]] = v
            fpp[r, fidx[n]] = True


def assemble_frame(
    run: str,
    step: int,
    world: int,
    records: Sequence[Record],
    blocks: Sequence[tuple[Any, np.ndarray]],
    *,
    wall: float = 0.0,
) -> StepFrame:
    """The frame of one step from wire-v1 ``records`` and wire-v2 column ``blocks`` ``(columns, row
    indices)`` (at most one record per rank in all): either wire gives the same frame."""
    frame = _laid_out(run, step, world, records, blocks, wall)
    hosts = np.full(world, "", dtype=object)
    _fill_blocks(frame, hosts, blocks)
    _fill_records(frame, hosts, records)
    frame.hosts, frame.complete = tuple(hosts.tolist()), bool(frame.present.all())
    return frame
