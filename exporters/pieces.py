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
is counted in ``sdcwatch_exporter_omitted`` (``what="pieces"``, ``what="layers"``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from prometheus_client.core import Metric
from prometheus_client.samples import Sample
from sdcwatch.core.incident import Incident, RunView
from sdcwatch.core.mesh import piece_label

from .catalog import STATS

__all__ = ["DEFAULT_MAX_PIECES", "spread", "by_piece", "exported_pieces", "exported_layers", "add_stats"]

#: Pieces of one run with statistics series. A 100,000-rank job laid out ``pp=16, tp=8`` has 128
#: pieces; 32 of them with 9 scalars x 5 statistics are 1,440 series, and per-layer series stay
#: within ``max_layers`` (piece, layer) pairs whatever the number of pieces.
DEFAULT_MAX_PIECES = 32


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
    incidents: Sequence[Incident],
    max_pieces: int,
    rank_limit: int,
) -> list[int]:
    """The pieces with series: all up to ``max_pieces``; past it those of open incidents, then the
    widest spread of any scalar or layer metric across the piece's ranks (ties: key order)."""
    n = len(run.pieces)
    if n <= max_pieces:
        return list(range(n))
    chosen: list[int] = []
    for p, _ in _incident_pieces(run, incidents, rank_limit):
        if p not in chosen and len(chosen) < max_pieces:
            chosen.append(p)
    # a scalar a piece does not report (all NaN: the loss off the last stage) and the layers a piece
    # does not hold are no evidence; a NaN among values is (it ranks first)
    score = np.full(n, -np.inf)
    for v in scalars.values():
        score = np.maximum(score, np.where(np.isnan(v).all(axis=-1), -np.inf, spread(v)))
    held = np.array([run.piece_layers[p] if p < len(run.piece_layers) else 1 << 30 for p in range(n)])
    for v in layers.values():
        s = np.where(np.isnan(v).all(axis=-1), -np.inf, spread(v).reshape(v.shape[:2]))
        s[np.arange(v.shape[1])[None, :] >= held[:, None]] = -np.inf
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
    pieces: Sequence[int],
    incidents: Sequence[Incident],
    max_layers: int,
    rank_limit: int,
) -> tuple[list[tuple[int, int]], int]:
    """((piece, layer) pairs to export, pairs there are in ``pieces``): all up to ``max_layers``; past
    it those of open incidents, then the widest spread ((max - min) / IQR of any layer metric)."""
    n_layers = max((v.shape[1] for v in layers.values()), default=0)
    held = run.piece_layers
    pairs = [(p, layer) for p in pieces for layer in range(min(n_layers, held[p]) if p < len(held) else n_layers)]
    if len(pairs) <= max_layers:
        return pairs, len(pairs)
    where = {pair: i for i, pair in enumerate(pairs)}
    chosen = {(p, int(layer)) for p, layer in _incident_pieces(run, incidents, rank_limit) if layer is not None}
    chosen &= set(where)
    score = np.full(len(pairs), -np.inf)
    rows = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    for v in layers.values():
        ok = rows[:, 1] < v.shape[1]
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
    pairs: Sequence[tuple[int, int]] | None = None,
) -> None:
    """The series of ``stats`` (per piece, see :func:`by_piece`): per scalar when ``pairs`` is None,
    else per (piece, layer) pair. A piece's label is left out when empty (one piece); a scalar a
    piece has no value of gets no series there."""
    columns = [(name, STATS.index(name)) for name in which]

    def add(p: int, values: np.ndarray, extra: dict[str, str]) -> None:
        for stat, col in columns:
            labels = {"run": run.run, **extra, "stat": stat}
            if run.pieces[p]:
                labels["piece"] = run.pieces[p]
            family.samples.append(Sample(family.name, labels, float(values[col])))

    for metric_name in sorted(stats):
        values = stats[metric_name]
        if pairs is None:
            for p in pieces:
                if len(run.pieces) == 1 or not np.isnan(values[p]).all():
                    add(p, values[p], {"metric": metric_name})
        else:
            for p, layer in pairs:
                if layer < values.shape[1]:
                    add(p, values[p, layer], {"metric": metric_name, "layer": str(layer)})
