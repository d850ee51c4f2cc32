"""Cross-rank statistics per model piece (peer group, named ``pp=1,tp=0``): under tensor or pipeline
parallelism quantiles over all ranks would mix different layers and shards. Every piece at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from sdcwatch.core.mesh import piece_label
from sdcwatch.detectors.peers import coords_of, known_coords

if TYPE_CHECKING:  # frame.py imports this module
    from sdcwatch.detectors.frame import StepFrame

__all__ = ["MAX_PIECES", "QUANTILES", "piece_stats", "grouped_quantiles"]

#: The statistics' quantiles, in the column order of ``RunView.scalar_stats`` / ``layer_stats``.
QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Most pieces of one step given statistics (the first in key order; the rest counted as ``omitted``):
#: a step summary stays small whatever coordinates ranks send.
MAX_PIECES = 1024


def grouped_quantiles(G: np.ndarray) -> np.ndarray:
    """(..., len(QUANTILES)) quantiles over the last axis of a grouped array, ignoring non-finite cells;
    linear interpolation, as :func:`numpy.quantile`; NaN where a row has no value."""
    G = np.where(np.isfinite(G), G, np.nan)
    S = np.sort(G, axis=-1)  # NaN last
    n = np.isfinite(G).sum(axis=-1)[..., None]
    pos = np.asarray(QUANTILES, dtype=np.float64) * np.maximum(n - 1, 0)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, np.maximum(n - 1, 0))
    a = np.take_along_axis(S, lo, axis=-1)
    b = np.take_along_axis(S, hi, axis=-1)
    with np.errstate(invalid="ignore"):
        out = a + (b - a) * (pos - lo)
    return np.where(n > 0, out, np.nan)


def piece_stats(frame: "StepFrame") -> dict[str, Any] | None:
    """Per-piece statistics of ``frame`` (None for one piece): ``names`` (each piece's label),
    ``scalars`` {name: (pieces, 5)}, ``layers`` {name: (pieces, layers, 5)}, ``n_layers`` (layers
    each piece's ranks sent), ``omitted`` (pieces past :data:`MAX_PIECES`)."""
    coords = known_coords(frame)
    groups = frame.peers
    if coords is None or groups.n <= 1:
        return None
    keep = min(groups.n, MAX_PIECES)
    first = groups.table[:keep, 0]  # each piece's lowest rank names it
    names = [piece_label(coords_of(coords, int(r))) for r in first]
    scalars: dict[str, np.ndarray] = {}
    if frame.scalars.size:
        q = grouped_quantiles(groups.gather(np.asarray(frame.scalars, dtype=np.float64).T)[:, :keep])
        scalars = {name: q[j] for j, name in enumerate(frame.scalar_names)}
    layers: dict[str, np.ndarray] = {}
    n_layers = np.zeros(keep, np.int64)
    if frame.layers.size:
        X = np.moveaxis(np.asarray(frame.layers, dtype=np.float64), 0, -1)  # (metrics, layers, world)
        q = grouped_quantiles(groups.gather(X)[:, :, :keep])  # (metrics, layers, pieces, 5)
        layers = {name: np.ascontiguousarray(q[m].transpose(1, 0, 2)) for m, name in enumerate(frame.layer_names)}
        if frame.layer_sent is None:
            sent = np.where(frame.present, frame.n_layers, 0)
        else:
            sent = np.asarray(frame.layer_sent, dtype=np.int64).max(axis=1, initial=0)
        per_piece = np.zeros(groups.n, np.int64)
        np.maximum.at(per_piece, groups.ids, sent)
        n_layers = per_piece[:keep]
    return {"names": names, "scalars": scalars, "layers": layers, "n_layers": n_layers, "omitted": groups.n - keep}
