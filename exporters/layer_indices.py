"""Which indices of each layer metric a run has, and what each index is called, for ``/metrics``.

The service lays a step's layer metrics out on one axis as long as the longest, so a metric with
fewer indices than another (a model's 2 attention layers beside its 15 checked products) comes
padded with NaN. The padding is no series: a metric's series exist for the indices it has. When a
piece's ranks sent their names (:mod:`sdcwatch.core.layer_names`, ``RunView.layer_names``), a
metric has as many indices as its family's list and each series carries the module's name in
``layer_name`` beside the index; without names, up to its last index with a value on some rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from sdcwatch.core.incident import RunView
from sdcwatch.core.layer_names import family_of

__all__ = ["MAX_LABEL_CHARS", "PieceNames", "bounded_label", "index_names", "layer_extents", "index_name"]

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
    """Per layer metric (``layers``: metric -> (pieces, indices, 5) statistics), the (pieces,)
    number of indices each piece has of it: its family's list of names where the piece has one,
    else up to the last index with a statistic that is not NaN; never more than the piece holds
    (``run.piece_layers``)."""
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
