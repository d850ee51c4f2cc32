"""Which model pieces and layers of a run get statistics series, and the series themselves.

A run's cross-rank statistics (``sdcwatch_rank_metric``, ``sdcwatch_layer_metric``) are taken
per model piece (:mod:`sdcwatch.detectors.piece_stats`): the ranks of one peer group, named by
:func:`~sdcwatch.core.mesh.piece_label` in the ``piece`` label (``piece="pp=1,tp=0"``). Plain data
parallel has one piece, whose label is empty and left out, so its series are those of a job
without coordinates, unchanged.

Both are bounded. At most ``max_pieces`` pieces of a run (default 32) get series: those an open
incident names, then those whose values spread most across their ranks; at most ``max_layers``
(piece, layer) pairs of the exported pieces (under pipeline parallelism a stage's layer 3 is
another layer than the next stage's): those of open incidents, then the widest spread. The rest
is counted in ``sdcwatch_exporter_omitted`` (``what="pieces"``, ``what="layers"``). A layer metric
has series only for the indices it has (:mod:`sdcwatch.exporters.layer_indices`), with the name of
each index beside it when the ranks sent their names.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from prometheus_client.core import Metric
from prometheus_client.samples import Sample
from sdcwatch.core.incident import Incident, RunView
from sdcwatch.core.mesh import piece_label

from .catalog import STATS
from .layer_indices import PieceNames, index_name

__all__ = ["spread", "by_piece", "exported_pieces", "exported_layers", "add_stats", "add_layer_stats"]


def spread(block: np.ndarray) -> np.ndarray:
    """(n,) (max - min) / IQR of (n, 5) statistics rows; NaN evidence (a NaN statistic) ranks first."""
    b = np.asarray(block, dtype=np.float64).reshape(-1, len(STATS))
    with np.errstate(all="ignore"):
        s = (b[:, 4] - b[:, 0]) / np.maximum(b[:, 3] - b[:, 1], 1e-12 * np.abs(b[:, 2]) + 1e-30)
    return np.where(np.isnan(s), np.inf, s)


def by_piece(values: np.ndarray, n_pieces: int, layered: bool) -> np.ndarray:
    """A statistics array as (pieces, 5), or (pieces, layers, 5) when ``layered``; one piece's
    arrays ((5,), (layers, 5)) gain the leading axis."""
    v = np.asarray(values, dtype=np.float64)
    return v.reshape(n_pieces, -1, len(STATS)) if layered else v.reshape(n_pieces, len(STATS))


def _incident_pieces(run: RunView, incidents: Sequence[Incident], limit: int) -> list[tuple[int, int | None]]:
    """(piece index, layer) of each open incident's ranks, from their coordinates."""
    index = {p: i for i, p in enumerate(run.pieces)}
    out: list[tuple[int, int | None]] = []
    for inc in incidents:
        pieces = {index.get(piece_label(c)) for c in inc.coords[:limit]} if inc.coords else set()
        if len(run.pieces) == 1:
            pieces = {0}
        out.extend((p, inc.layer) for p in sorted(pieces - {None}))
    return out


def exported_pieces(
    run: RunView,
    scalars: dict[str, np.ndarray],
    layers: dict[str, np.ndarray],
    extents: dict[str, np.ndarray],
    incidents: Sequence[Incident],
    max_pieces: int,
    rank_limit: int,
) -> list[int]:
    """The pieces with series: all up to ``max_pieces``; past it those of open incidents, then the
    widest spread of any scalar or layer metric across the piece's ranks (ties: key order), a layer
    metric's within the indices it has there (``extents``, :func:`~.layer_indices.layer_extents`)."""
    n = len(run.pieces)
    if n <= max_pieces:
        return list(range(n))
    chosen: list[int] = []
    for p, _ in _incident_pieces(run, incidents, rank_limit):
        if p not in chosen and len(chosen) < max_pieces:
            chosen.append(p)
    # a scalar a piece does not report (all NaN: the loss off the last stage) and the indices a
    # metric does not have there are no evidence; a NaN among values is (it ranks first)
    score = np.full(n, -np.inf)
    for v in scalars.values():
        score = np.maximum(score, np.where(np.isnan(v).all(axis=-1), -np.inf, spread(v)))
    for metric, v in layers.items():
        s = np.where(np.isnan(v).all(axis=-1), -np.inf, spread(v).reshape(v.shape[:2]))
        s[np.arange(v.shape[1])[None, :] >= extents[metric][:, None]] = -np.inf
        score = np.maximum(score, s.max(axis=1, initial=-np.inf))
    for p in np.argsort(-score, kind="stable"):
        if len(chosen) >= max_pieces:
            break
        if int(p) not in chosen:
            chosen.append(int(p))
    return sorted(chosen)


def exported_layers(
    run: RunView,
    layers: dict[str, np.ndarray],
    extents: dict[str, np.ndarray],
    pieces: Sequence[int],
    incidents: Sequence[Incident],
    max_layers: int,
    rank_limit: int,
) -> tuple[list[tuple[int, int]], int]:
    """((piece, layer) pairs to export, pairs there are in ``pieces``): all up to ``max_layers``; past
    it those of open incidents, then the widest spread ((max - min) / IQR of any layer metric, within
    the indices it has). A pair is an index some metric has in that piece (``extents``)."""
    widest = np.zeros(len(run.pieces), np.int64)
    for extent in extents.values():
        widest = np.maximum(widest, extent)
    pairs = [(p, layer) for p in pieces for layer in range(int(widest[p]))]
    if len(pairs) <= max_layers:
        return pairs, len(pairs)
    where = {pair: i for i, pair in enumerate(pairs)}
    chosen = {(p, int(layer)) for p, layer in _incident_pieces(run, incidents, rank_limit) if layer is not None}
    chosen &= set(where)
    score = np.full(len(pairs), -np.inf)
    rows = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    for metric, v in layers.items():
        ok = rows[:, 1] < extents[metric][rows[:, 0]]
        s = np.full(len(pairs), -np.inf)
        s[ok] = spread(v[rows[ok, 0], rows[ok, 1]])
        score = np.maximum(score, s)
    for i in np.argsort(-score, kind="stable"):
        if len(chosen) >= max_layers:
            break
        chosen.add(pairs[int(i)])
    return sorted(chosen), len(pairs)


def add_stats(
    family: Metric,
    run: RunView,
    stats: dict[str, np.ndarray],
    which: Sequence[str],
    pieces: Sequence[int],
) -> None:
    """The series of the scalars' ``stats`` (per piece, see :func:`by_piece`). A piece's label is
    left out when empty (one piece); a scalar a piece has no value of gets no series there."""
    for metric_name in sorted(stats):
        values = stats[metric_name]
        for p in pieces:
            if len(run.pieces) == 1 or not np.isnan(values[p]).all():
                _add_row(family, run, p, values[p], {"metric": metric_name}, which)


def add_layer_stats(
    family: Metric,
    run: RunView,
    stats: dict[str, np.ndarray],
    which: Sequence[str],
    pairs: Sequence[tuple[int, int]],
    extents: dict[str, np.ndarray],
    names: tuple[PieceNames, ...],
) -> None:
    """The series of the layer metrics' ``stats`` per (piece, layer) pair of ``pairs``, each
    metric's only at the indices it has (``extents``), with ``layer_name`` when known (``names``)."""
    for metric_name in sorted(stats):
        values, extent = stats[metric_name], extents[metric_name]
        for p, layer in pairs:
            if layer < extent[p]:
                labels = {"metric": metric_name, "layer": str(layer)}
                name = index_name(names, p, metric_name, layer)
                if name:
                    labels["layer_name"] = name
                _add_row(family, run, p, values[p, layer], labels, which)


def _add_row(
    family: Metric, run: RunView, p: int, values: np.ndarray, extra: dict[str, str], which: Sequence[str]
) -> None:
    """One statistics row: a series per statistic of ``which``."""
    for stat in which:
        labels = {"run": run.run, **extra, "stat": stat}
        if run.pieces[p]:
            labels["piece"] = run.pieces[p]
        family.samples.append(Sample(family.name, labels, float(values[STATS.index(stat)])))
