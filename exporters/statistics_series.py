"""The series of a run's cross-rank statistics (``sdcwatch_rank_metric``, ``sdcwatch_layer_metric``),
per model piece (``piece="pp=1,tp=0"``, left out for one piece): which pieces (``max_pieces``) and
(piece, layer) pairs (``max_layers``) get one, open incidents' first, then the widest spread; a
metric's series only at the indices it has, each named in ``layer_name`` when the ranks sent names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from prometheus_client.core import Metric
from prometheus_client.samples import Sample
from sdcwatch.core.incident import Incident, RunView
from sdcwatch.core.mesh import piece_label
from sdcwatch.core.vocabulary import family_of

from .catalog import STATS

__all__ = [
    "MAX_LABEL_CHARS",
    "PieceNames",
    "bounded_label",
    "index_names",
    "layer_extents",
    "index_name",
    "spread",
    "by_piece",
    "exported_pieces",
    "exported_layers",
    "add_stats",
    "add_layer_stats",
]

#: Longest label value the exporter writes from names a rank sent (a module path is a few tens).
MAX_LABEL_CHARS = 128

#: One piece's names: family (``products``, ``blocks``, ``layers``...) -> the name of each index.
PieceNames = Mapping[str, Sequence[str]]


def bounded_label(value: str, limit: int = MAX_LABEL_CHARS) -> str:
    """A label value of at most ``limit`` characters."""
    return value if len(value) <= limit else value[: limit - 3] + "..."


def index_names(run: RunView) -> tuple[PieceNames, ...]:
    """Per piece of ``run`` (as ``run.pieces``), the names its ranks sent; () when the view carries
    none (a rank that sent no names, or a view of a service that does not hand them on)."""
    names = tuple(run.layer_names or ())
    return names if len(names) == len(run.pieces) else ()


def layer_extents(run: RunView, layers: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per layer metric, the (pieces,) number of indices each piece has of it: as many as its names,
    else up to its last index with a statistic; never more than the piece holds."""
    n = len(run.pieces)
    held = np.array([run.piece_layers[p] if p < len(run.piece_layers) else 1 << 30 for p in range(n)])
    names = index_names(run)
    out: dict[str, np.ndarray] = {}
    for metric, values in layers.items():
        has = ~np.isnan(values).all(axis=-1)  # (pieces, indices): some statistic is a number
        width = has.shape[1]
        extent = np.where(has.any(axis=1), width - np.argmax(has[:, ::-1], axis=1), 0)
        family = family_of(metric)
        for p, piece in enumerate(names):
            listed = piece.get(family) if family is not None else None
            if listed:
                extent[p] = len(listed)
        out[metric] = np.minimum(np.minimum(extent, width), held)
    return out


def index_name(names: tuple[PieceNames, ...], piece: int, metric: str, index: int) -> str:
    """The name of ``metric``'s ``index`` in ``piece`` ("" when not known), bounded for a label."""
    family = family_of(metric)
    if family is None or piece >= len(names):
        return ""
    listed = names[piece].get(family) or ()
    return bounded_label(str(listed[index])) if 0 <= index < len(listed) and listed[index] else ""


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
        pieces = {0} if len(run.pieces) == 1 else {index.get(piece_label(c)) for c in inc.coords[:limit]}
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
    metric's within the indices it has there (``extents``, :func:`layer_extents`)."""
    n = len(run.pieces)
    if n <= max_pieces:
        return list(range(n))
    chosen: set[int] = set()
    for p, _ in _incident_pieces(run, incidents, rank_limit):
        if len(chosen) < max_pieces:
            chosen.add(p)
    # a scalar a piece does not report (all NaN: the loss off the last stage) and the indices a
    # metric does not have there are no evidence; a NaN among values is (it ranks first)
    score = np.full(n, -np.inf)
    for v in scalars.values():
        score = np.maximum(score, np.where(np.isnan(v).all(axis=-1), -np.inf, spread(v)))
    for metric, v in layers.items():
        s = np.where(np.isnan(v).all(axis=-1), -np.inf, spread(v).reshape(v.shape[:2]))
        s[np.arange(v.shape[1])[None, :] >= extents[metric][:, None]] = -np.inf
        score = np.maximum(score, s.max(axis=1, initial=-np.inf))
    return _widest_first(chosen, list(range(n)), score, max_pieces)


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
    widest = np.max([np.zeros(len(run.pieces), np.int64), *extents.values()], axis=0)
    pairs = [(p, layer) for p in pieces for layer in range(int(widest[p]))]
    if len(pairs) <= max_layers:
        return pairs, len(pairs)
    chosen = {(p, int(layer)) for p, layer in _incident_pieces(run, incidents, rank_limit) if layer is not None}
    chosen &= set(pairs)
    score = np.full(len(pairs), -np.inf)
    rows = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    for metric, v in layers.items():
        ok = rows[:, 1] < extents[metric][rows[:, 0]]
        s = np.full(len(pairs), -np.inf)
        s[ok] = spread(v[rows[ok, 0], rows[ok, 1]])
        score = np.maximum(score, s)
    return _widest_first(chosen, pairs, score, max_layers), len(pairs)


def _widest_first(chosen: set, items: list, score: np.ndarray, cap: int) -> list:
    """``chosen`` filled up to ``cap`` with ``items`` by descending ``score`` (ties: their order), sorted."""
    for i in np.argsort(-score, kind="stable"):
        if len(chosen) >= cap:
            break
        chosen.add(items[int(i)])
    return sorted(chosen)


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
