"""DetectionPipeline: aligner -> detectors -> attribution -> incident book, for any number of runs.

The pipeline is the whole detection state of the service and of offline replay. It is plain,
single-threaded and clocked from outside, so tests drive it step by step; ``view()`` gives the
exporter a consistent :class:`ServiceView`, ``save()``/``load()`` put the entire state in one JSON
file so a restarted service resumes without a new warm-up and without repeating alerts.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from sdcwatch.detectors.aligner import StepAligner
from sdcwatch.detectors.attribution import Attribution
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.incidents import IncidentBook
from sdcwatch.detectors.nonfinite import NonFiniteDetector
from sdcwatch.detectors.rank_outlier import RankOutlierDetector
from sdcwatch.detectors.replica import ReplicaDivergenceDetector
from sdcwatch.detectors.spike import SpikeDetector
from sdcwatch.detectors.straggler import MissingRankDetector, StragglerDetector
from sdcwatch.detectors.types import IncidentEvent, PipelineView, RunView, ServiceView, _json_safe
from sdcwatch.errors import ConfigError
from sdcwatch.telemetry.record import Record

__all__ = ["DetectionPipeline", "PipelineSettings", "default_detectors", "STATE_VERSION"]

STATE_VERSION = 1
_QUANTILES = np.array([0.0, 0.25, 0.5, 0.75, 1.0])


def default_detectors() -> list:
    """The detectors a run gets by default (river's HalfSpaceTrees is opt-in: it is the slow baseline)."""
    return [NonFiniteDetector(), SpikeDetector(), RankOutlierDetector(), ReplicaDivergenceDetector(),
            StragglerDetector(), MissingRankDetector()]


@dataclass(frozen=True)
class PipelineSettings:
    """Settings of the detection pipeline."""

    step_timeout: float = 5.0
    """Seconds after a step's first record before it closes without the late ranks."""
    max_open_steps: int = 64
    """Open steps per run before the oldest is closed regardless of its deadline."""
    quiet_steps: int = 50
    """Steps without a finding after which an incident resolves."""
    attribution_window: int = 50
    """Steps within which a spike and rank-local evidence are joined."""
    stale_after: float = 900.0
    """Seconds without a step after which a run's open incidents resolve (the run ended or died;
    the exporter's last-step age and the missing-rank alerts say which)."""

    def __post_init__(self) -> None:
        for key in ("step_timeout", "max_open_steps", "quiet_steps", "attribution_window", "stale_after"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"pipeline.{key}", f"must be a positive number, got {v!r}")


@dataclass
class _Run:
    detectors: list
    attribution: Attribution
    world: int = 0
    steps_total: int = 0
    last_step: int = -1
    last_step_wall: float = 0.0
    hosts: list[str] = field(default_factory=list)
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0))
    frame: StepFrame | None = None  # latest frame (read by view())


class DetectionPipeline:
    """All detection state: feed records (or frames), get incident events; read ``view()``."""

    def __init__(self, settings: PipelineSettings | None = None, *,
                 detectors: Callable[[], Sequence] = default_detectors,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.settings = settings or PipelineSettings()
        self.make_detectors = detectors
        self.wall = wall
        self.aligner = StepAligner(self.settings.step_timeout, self.settings.max_open_steps, clock=clock)
        self.book = IncidentBook(self.settings.quiet_steps, clock=wall)
        self._runs: dict[str, _Run] = {}
        self.findings_total: dict[tuple[str, str], int] = {}
        self.records_total = 0
        self.dead_letters_total = 0  # set by the service from its source
        self.consumer_lag = 0  # set by the service from its source
        self.last_record_wall = 0.0
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)

    # -- input --------------------------------------------------------------------------------

    def process(self, records: Iterable[Record]) -> list[IncidentEvent]:
        """Align records and run every closed step through the detectors."""
        records = list(records)
        if records:
            self.records_total += len(records)
            self.last_record_wall = self.wall()
            self._rate.append((self.last_record_wall, len(records)))
        events: list[IncidentEvent] = []
        for frame in self.aligner.add(records):
            events += self.process_frame(frame)
        return events

    def tick(self) -> list[IncidentEvent]:
        """Close steps whose alignment deadline passed (call regularly)."""
        return [e for frame in self.aligner.poll() for e in self.process_frame(frame)]

    def expire(self) -> list[IncidentEvent]:
        """Resolve the open incidents of runs silent for ``stale_after`` seconds (call regularly)."""
        now = self.wall()
        events: list[IncidentEvent] = []
        for run, st in self._runs.items():
            if st.last_step >= 0 and now - st.last_step_wall >= self.settings.stale_after:
                events += self.book.close_run(run, st.last_step)
        return events

    def flush(self) -> list[IncidentEvent]:
        """Close every open step (end of input)."""
        return [e for frame in self.aligner.flush() for e in self.process_frame(frame)]

    def process_frame(self, frame: StepFrame) -> list[IncidentEvent]:
        """Run one aligned step through the detectors, attribution and the incident book."""
        st = self._runs.get(frame.run)
        if st is None:
            st = self._runs[frame.run] = _Run(list(self.make_detectors()),
                                              Attribution(self.settings.attribution_window))
        findings = []
        for det in st.detectors:
            found = det.update(frame)
            for f in found:
                k = (f.detector, f.kind)
                self.findings_total[k] = self.findings_total.get(k, 0) + 1
            findings += found
        findings = st.attribution.apply(frame.step, frame.world, findings)
        self._remember(st, frame)
        return self.book.add(findings) + self.book.advance(frame.run, frame.step)

    def _remember(self, st: _Run, frame: StepFrame) -> None:
        if st.world != frame.world:
            st.world = frame.world
            st.hosts = [""] * frame.world
            st.dropped = np.zeros(frame.world)
        if frame.complete:
            st.hosts = list(frame.hosts)
        else:  # keep the hosts of absent ranks
            st.hosts = [new or old for new, old in zip(frame.hosts, st.hosts)]
        col = frame.scalar("emitter_dropped")
        if col is not None:
            st.dropped = np.where(np.isfinite(col), col, st.dropped)
        st.steps_total += 1
        st.last_step = frame.step
        st.last_step_wall = self.wall()
        st.frame = frame

    # -- reading ------------------------------------------------------------------------------

    def incidents(self) -> list:
        """Open incidents and the recently resolved ones."""
        return self.book.current()

    def view(self) -> ServiceView:
        """What the exporter shows: runs, pipeline health, incidents, counters."""
        runs = [self._run_view(run, st) for run, st in self._runs.items() if st.frame is not None]
        now = self.wall()
        recent = [(t, n) for t, n in self._rate if now - t <= 10.0]
        rps = 0.0
        if len(recent) >= 2 and now > recent[0][0]:
            rps = sum(n for _, n in recent[1:]) / max(now - recent[0][0], 1e-6)
        pipe = PipelineView(
            records_total=self.records_total, records_per_second=rps, duplicates_total=self.aligner.duplicates,
            dead_letters_total=self.dead_letters_total, consumer_lag=self.consumer_lag,
            last_record_wall=self.last_record_wall,
        )
        return ServiceView(runs=runs, pipeline=pipe, incidents=self.book.current(),
                           incidents_total=dict(self.book.opened_total), findings_total=dict(self.findings_total))

    def _run_view(self, run: str, st: _Run) -> RunView:
        f = st.frame
        spike = next((d for d in st.detectors if isinstance(d, SpikeDetector)), None)
        ranks = next((d for d in st.detectors if isinstance(d, RankOutlierDetector)), None)
        missing = next((d for d in st.detectors if isinstance(d, MissingRankDetector)), None)
        scalar_stats = {}
        for j, name in enumerate(f.scalar_names):
            col = f.scalars[:, j]
            col = col[np.isfinite(col)]
            if col.size:
                scalar_stats[name] = np.quantile(col, _QUANTILES)
        layer_stats = {}
        if f.layers.size:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN layer gives NaN stats
                for m, name in enumerate(f.layer_names):
                    block = np.where(np.isfinite(f.layers[:, m, :]), f.layers[:, m, :], np.nan)
                    layer_stats[name] = np.nanquantile(block, _QUANTILES, axis=0).T
        rank_scores = ranks.rank_scores if ranks is not None and ranks.rank_scores.shape[0] == f.world else np.zeros(f.world)
        return RunView(
            run=run, world=f.world, last_step=st.last_step, last_step_wall=st.last_step_wall,
            loss=spike.latest["loss"] if spike else f.global_value("loss_global", "loss"),
            grad_norm=spike.latest["grad_norm"] if spike else f.global_value("grad_norm_global", reduce="median"),
            spike_scores=dict(spike.scores) if spike else {}, rank_scores=np.array(rank_scores, copy=True),
            hosts=list(st.hosts) if st.hosts else [""] * f.world, scalar_stats=scalar_stats, layer_stats=layer_stats,
            steps_total=st.steps_total, late_ranks=int(f.world - f.present.sum()),
            missing_ranks=missing.missing if missing else 0, emitter_dropped=int(np.nansum(st.dropped)),
        )

    # -- state ----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The entire detection state, JSON-safe."""
        return {
            "version": STATE_VERSION,
            "aligner": self.aligner.snapshot(),
            "book": self.book.snapshot(),
            "runs": {run: {
                "detectors": {d.name: d.snapshot() for d in st.detectors},
                "attribution": st.attribution.snapshot(),
                "world": st.world, "steps_total": st.steps_total, "last_step": st.last_step,
                "hosts": st.hosts, "dropped": st.dropped.tolist(),
            } for run, st in self._runs.items()},
            "findings_total": [[d, k, n] for (d, k), n in self.findings_total.items()],
            "records_total": self.records_total,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take back a :meth:`snapshot` (detectors missing from it start fresh)."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError("state.version", f"unknown pipeline state version {state.get('version')!r}")
        self.aligner.restore(state["aligner"])
        self.book.restore(state["book"])
        self._runs = {}
        for run, d in state["runs"].items():
            st = _Run(list(self.make_detectors()), Attribution(self.settings.attribution_window))
            for det in st.detectors:
                if det.name in d["detectors"]:
                    det.restore(d["detectors"][det.name])
            st.attribution.restore(d["attribution"])
            st.world, st.steps_total, st.last_step = int(d["world"]), int(d["steps_total"]), int(d["last_step"])
            st.hosts, st.dropped = list(d["hosts"]), np.array(d["dropped"], dtype=float)
            st.last_step_wall = self.wall()  # the stale clock restarts with the service
            self._runs[run] = st
        self.findings_total = {(a, b): int(n) for a, b, n in state["findings_total"]}
        self.records_total = int(state["records_total"])

    def save(self, path: str | os.PathLike) -> None:
        """Write the state atomically (a crash mid-write leaves the previous file intact)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(_json_safe(self.snapshot()), fh, separators=(",", ":"), allow_nan=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> bool:
        """Restore from ``path`` if it exists; returns whether it did."""
        try:
            with open(path, encoding="utf-8") as fh:
                state = json.load(fh)
        except FileNotFoundError:
            return False
        except ValueError as exc:
            raise ConfigError("state.file", f"{path}: not a valid state file: {exc}") from None
        self.restore(state)
        return True
