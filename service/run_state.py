"""One run in the pipeline: its detection state between steps and what its latest steps said of the ranks
(:class:`RunState`, its part of the state file), and the exporter's view of its latest step (:func:`run_view`),
where a metric measured on sampled steps only shows its last measurement (:class:`HeldLayers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
from sdcwatch.core.incident import RunView
from sdcwatch.core.metric_spec import MetricSpec
from sdcwatch.detectors.attribution import Attribution
from sdcwatch.detectors.frame import frame_stats
from sdcwatch.service.summary import StepSummary

__all__ = ["HOLD_STEPS", "HeldLayers", "RunState", "count_total", "detector_values", "run_view"]


#: Steps a layer metric's last statistics stay on view without being measured again.
HOLD_STEPS = 256
#: Distinct layer metric names remembered before the memory starts over (the record limits bound them far lower).
MAX_NAMES = 1024


class HeldLayers:
    """Per layer metric: the statistics (run-wide and per model piece) of the last step that measured it."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.sampled: set[str] = set()
        self._held: dict[str, tuple[int, Any, tuple[str, ...] | None, Any]] = {}

    def measures_sampled(self, names: Iterable[str]) -> bool:
        """Whether a step with these layer metrics carries a sampled or new one (its statistics are
        taken now); learns which metrics come and go."""
        current = set(names)
        if len(self.seen) > MAX_NAMES:
            self.seen.clear()
            self.sampled.clear()
        self.sampled |= self.seen - current
        new = current - self.seen
        self.seen |= current
        return bool(new or current & self.sampled)

    def hold(self, stats: dict[str, Any], step: int) -> None:
        """Keep the layer statistics of ``frame_stats``'s ``stats``, measured at ``step``."""
        pieces = stats.get("pieces")
        names = tuple(str(p) for p in pieces["names"]) if pieces else None
        for name, whole in stats.get("layers", {}).items():
            per_piece = pieces["layers"].get(name) if pieces else None
            self._held[name] = (step, whole, names, per_piece)

    def fill(self, layers: dict[str, Any], pieces: tuple[str, ...], step: int) -> dict[str, Any]:
        """``layers`` (this step's, per piece when ``pieces`` names them) plus the held statistics of every
        metric it lacks, measured at most :data:`HOLD_STEPS` steps before (per piece: same pieces only)."""
        out = dict(layers)
        for name, (at, whole, names, per_piece) in list(self._held.items()):
            if name in out:
                continue
            if not 0 <= step - at <= HOLD_STEPS:
                del self._held[name]
                continue
            value = (per_piece if names == pieces else None) if pieces else whole
            if value is not None:
                out[name] = value
        return out


@dataclass
class RunState:
    """One run's detection state (detectors, attribution) and what its latest steps said."""

    detectors: list
    attribution: Attribution
    world: int = 0
    steps_total: int = 0
    last_step: int = -1
    last_step_wall: float = 0.0
    hosts: list[str] = field(default_factory=list)
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0))
    summary: StepSummary | None = None  # latest step (read by view())
    stats: dict[str, Any] | None = None  # latest cross-rank quantiles a spatial stage sent
    sent_hosts: tuple[str, ...] | None = None  # spatial: host table last put in a summary
    coords: np.ndarray | None = None  # (world, mesh dims) last known coordinates of each rank
    sent_coords: np.ndarray | None = None  # spatial: coordinate table last put in a summary
    view: RunView | None = None  # the exporter's view of the latest step, built once per step
    held: HeldLayers = field(default_factory=HeldLayers)  # last statistics of sampled layer metrics

    def remember(self, summary: StepSummary, wall: float) -> None:
        """Take what a judged step says of the run (a new world size starts the rank tables over)."""
        if self.world != summary.world:
            self.world = summary.world
            self.hosts = [""] * summary.world
            self.coords = None
            self.dropped = np.zeros(summary.world)
        if summary.hosts is not None:
            self.hosts = list(summary.hosts)
        if summary.coords is not None:
            self.coords = summary.coords
        for r, n in summary.dropped.items():
            if 0 <= r < summary.world:
                self.dropped[r] = n
        if summary.stats is not None:
            self.stats = summary.stats
            self.held.hold(summary.stats, summary.step)
        self.steps_total += 1
        self.last_step = summary.step
        self.last_step_wall = wall
        self.summary = summary
        self.view = None

    def snapshot(self) -> dict[str, Any]:
        """The run's part of the state file."""
        return {
            "detectors": {d.name: d.snapshot() for d in self.detectors},
            "attribution": self.attribution.snapshot(),
            "world": self.world,
            "steps_total": self.steps_total,
            "last_step": self.last_step,
            "hosts": self.hosts,
            "dropped": self.dropped.tolist(),
            **({} if self.coords is None else {"coords": self.coords.tolist()}),
        }

    def restore(self, d: dict[str, Any], wall: float) -> None:
        """Take back a :meth:`snapshot` (detectors missing from it start fresh); ``wall`` restarts
        the stale clock with the service."""
        for det in self.detectors:
            if det.name in d["detectors"]:
                det.restore(d["detectors"][det.name])
        self.attribution.restore(d["attribution"])
        self.world, self.steps_total, self.last_step = int(d["world"]), int(d["steps_total"]), int(d["last_step"])
        self.hosts, self.dropped = list(d["hosts"]), np.array(d["dropped"], dtype=float)
        if d.get("coords") is not None:
            self.coords = np.array(d["coords"], dtype=np.int64).reshape(self.world, -1)
        self.last_step_wall = wall


def count_total(values: np.ndarray) -> int:
    """The sum of per-rank counters, as an int whatever they hold (NaN and negatives count 0)."""
    v = np.asarray(values, dtype=float)
    with np.errstate(over="ignore"):
        total = float(np.sum(v[np.isfinite(v) & (v > 0)]))
    return int(min(total, 2.0**53))  # past it a float no longer counts by ones


#: The lists of names a rank of a run sent (``LayerNameBook.names_of``; rank None: the run's only list).
NamesOf = Callable[[str, "int | None"], "dict[str, tuple[str, ...]] | None"]


def _index_names(run: str, st: RunState, n_pieces: int, names_of: NamesOf) -> tuple[dict[str, tuple[str, ...]], ...]:
    """Per piece, the names its lowest rank sent; () when no rank sent any."""
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
    """The families ``detectors`` declare in their ``metrics`` (the first to declare a name gives it)
    and copies of their values now; a per-rank array of another world size reads as zeros."""
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
    """The view of ``run``'s latest judged step (``st.summary`` set); ``names_of``: ``LayerNameBook.names_of``."""
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
