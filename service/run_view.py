"""The exporter's view of one run: a :class:`~sdcwatch.core.incident.RunView` of its latest step.

Built once per step from the run's state and read by every scrape until the next step. Each
detector reports its own numbers (``metrics_view()``; the first to report a name wins); what no
detector follows (the loss and gradient norm when no spike detector runs) is read off the step.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from sdcwatch.core.incident import RunView
from sdcwatch.detectors.frame import frame_stats
from sdcwatch.service.run_state import RunState

__all__ = ["count_total", "run_view"]


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


def run_view(run: str, st: RunState, finished: bool, names_of: NamesOf | None = None) -> RunView:
    """The view of ``run``'s latest judged step (``st.summary`` must be set); ``names_of`` gives the
    names the run's ranks sent (the pipeline's ``LayerNameBook.names_of``), for the labels."""
    f = st.summary
    shown: dict[str, Any] = {}
    for det in st.detectors:  # each detector reports its own numbers; the first to report one wins
        for key, value in det.metrics_view().items():
            shown.setdefault(key, value)
    if f.frame is not None:  # one process: this step's, taken when it was judged if it measured a sampled metric
        stats = f.stats if f.stats is not None else frame_stats(f.frame)
    else:  # temporal stage: the latest a spatial stage sent
        stats = st.stats or {"scalars": {}, "layers": {}}
    rank_scores = shown.get("rank_scores")
    if rank_scores is None or rank_scores.shape[0] != f.world:
        rank_scores = np.zeros(f.world)
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
    nan = float("nan")
    if "loss" not in shown:  # no detector follows the global series: read them off the last step
        shown["loss"] = f.frame.global_value("loss_global", "loss") if f.frame else nan
        shown["grad_norm"] = f.frame.global_value("grad_norm_global", reduce="median") if f.frame else nan
    return RunView(
        run=run,
        world=f.world,
        last_step=st.last_step,
        last_step_wall=st.last_step_wall,
        loss=shown["loss"],
        grad_norm=shown["grad_norm"],
        spike_scores=shown.get("spike_scores", {}),
        rank_scores=np.array(rank_scores, copy=True),
        hosts=list(st.hosts) if st.hosts else [""] * f.world,
        scalar_stats={k: np.asarray(v, dtype=float) for k, v in scalars.items()},
        layer_stats={k: np.asarray(v, dtype=float) for k, v in layers.items()},
        steps_total=st.steps_total,
        late_ranks=int(f.world - f.n_present),
        missing_ranks=shown.get("missing_ranks", 0),
        emitter_dropped=count_total(st.dropped),
        finished=finished,
        layer_names=_index_names(run, st, len(piece_view.get("pieces", ("",))), names_of) if names_of else (),
        **piece_view,
    )
