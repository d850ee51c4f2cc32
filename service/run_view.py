"""The exporter's view of one run: a :class:`~sdcwatch.core.incident.RunView` of its latest step.

Built once per step from the run's state and read by every scrape until the next step. Each
detector's own numbers are read off its state here, as its ``metrics`` declare (the first detector
to declare a name gives it); the rest is the run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
from sdcwatch.core.incident import RunView
from sdcwatch.core.metric_spec import MetricSpec
from sdcwatch.detectors.frame import frame_stats
from sdcwatch.service.run_state import RunState

__all__ = ["count_total", "detector_values", "run_view"]


def count_total(values: np.ndarray) -> int:
    """The sum of per-rank counters, as an int whatever they hold (NaN and negatives count 0)."""
    v = np.asarray(values, dtype=float)
    with np.errstate(over="ignore"):
        total = float(np.sum(v[np.isfinite(v) & (v > 0)]))
    return int(min(total, 2.0**53))  # past it a float no longer counts by ones


#: The lists of names a rank of a run sent (``LayerNameBook.names_of``; rank None: the run's only list).
NamesOf = Callable[[str, "int | None"], "dict[str, tuple[str, ...]] | None"]


def _index_names(run: str, st: RunState, n_pieces: int, names_of: NamesOf) -> tuple[dict[str, tuple[str, ...]], ...]:
    """Per piece, the names one of its ranks sent (each piece's lowest rank, the one that names it);
    () when no rank sent any."""
    frame = st.summary.frame
    if n_pieces == 1:
        lists = names_of(run, None) or names_of(run, 0)
        return (dict(lists),) if lists else ()
    if frame is None:  # temporal stage: which ranks make each piece is the spatial stage's
        return ()
    first = frame.peers.table[:n_pieces, 0]
    found = tuple(dict(names_of(run, int(r)) or {}) for r in first)
    return found if any(found) else ()


def detector_values(detectors: list, world: int) -> tuple[tuple[MetricSpec, ...], dict[str, Any]]:
    """The families ``detectors`` declare in their ``metrics`` and their values, read off their state
    now (copies: a detector goes on); the first to declare a name gives it. A per-rank array of
    another world size (a world change the detector has not seen yet) reads as zeros."""
    specs: list[MetricSpec] = []
    values: dict[str, Any] = {}
    for det in detectors:
        for spec in det.metrics:
            if spec.name in values:
                continue
            specs.append(spec)
            value = spec.read(det)
            if spec.per_rank:
                value = np.array(value, dtype=float).reshape(-1)
                value = value if value.shape[0] == world else np.zeros(world)
            values[spec.name] = dict(value) if isinstance(value, Mapping) else value
    return tuple(specs), values


def run_view(run: str, st: RunState, finished: bool, names_of: NamesOf | None = None) -> RunView:
    """The view of ``run``'s latest judged step (``st.summary`` must be set); ``names_of`` gives the
    names the run's ranks sent (the pipeline's ``LayerNameBook.names_of``), for the labels."""
    f = st.summary
    specs, values = detector_values(st.detectors, f.world)
    if f.frame is not None:  # one process: this step's, taken when it was judged if it measured a sampled metric
        stats = f.stats if f.stats is not None else frame_stats(f.frame)
    else:  # temporal stage: the latest a spatial stage sent
        stats = st.stats or {"scalars": {}, "layers": {}}
    scalars, layers, pieces = stats["scalars"], stats["layers"], stats.get("pieces")
    piece_view: dict[str, Any] = {}
    if pieces:  # tensor or pipeline parallel: the statistics of each model piece, not of all ranks
        scalars, layers = pieces["scalars"], pieces["layers"]
        piece_view = {
            "pieces": tuple(str(p) for p in pieces["names"]),
            "piece_layers": tuple(int(n) for n in np.asarray(pieces["n_layers"]).reshape(-1)),
            "pieces_omitted": int(pieces["omitted"]),
        }
    layers = st.held.fill(layers, piece_view.get("pieces", ()), st.last_step)  # sampled metrics: their last
    return RunView(
        run=run,
        world=f.world,
        last_step=st.last_step,
        last_step_wall=st.last_step_wall,
        hosts=list(st.hosts) if st.hosts else [""] * f.world,
        scalar_stats={k: np.asarray(v, dtype=float) for k, v in scalars.items()},
        layer_stats={k: np.asarray(v, dtype=float) for k, v in layers.items()},
        steps_total=st.steps_total,
        late_ranks=int(f.world - f.n_present),
        emitter_dropped=count_total(st.dropped),
        finished=finished,
        layer_names=_index_names(run, st, len(piece_view.get("pieces", ("",))), names_of) if names_of else (),
        detector_metrics=specs,
        detector_values=values,
        **piece_view,
    )
