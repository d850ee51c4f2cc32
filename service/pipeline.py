"""DetectionPipeline: aligner -> detectors -> attribution -> incident book, for any number of runs.

The whole detection state of the service and of offline replay: single-threaded and clocked from
outside (tests drive it step by step); ``view()`` for the exporter, ``save()``/``load()`` one JSON file.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import IncidentEvent, PipelineView, RunView, ServiceView
from sdcwatch.core.jsonsafe import json_safe
from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.validate import check_choice, check_int, check_number
from sdcwatch.detectors.attribution import Attribution
from sdcwatch.detectors.base import SplitDetector
from sdcwatch.detectors.frame import StepFrame, frame_stats
from sdcwatch.detectors.peers import coords_of, known_coords
from sdcwatch.detectors.registry import default_detectors
from sdcwatch.service.aligner import StepAligner
from sdcwatch.service.checkpoint_marks import CheckpointBook
from sdcwatch.service.hosts import HostLedger, HostSettings, credit_hosts
from sdcwatch.service.incidents import IncidentBook
from sdcwatch.service.ingest import count_records
from sdcwatch.service.layer_name_book import LayerNameBook
from sdcwatch.service.run_backlog import RunBacklog
from sdcwatch.service.run_lifecycle import RunLifecycle
from sdcwatch.service.run_state import RunState, run_view
from sdcwatch.service.statefile import read_state, restoring, write_state
from sdcwatch.service.summary import StepSummary, SummaryOrder

__all__ = ["DetectionPipeline", "PipelineSettings", "STATE_VERSION", "STAGES"]

#: What a pipeline does: both stages (the default), or one stage of the scale-out.
STAGES = ("both", "spatial", "temporal")

STATE_VERSION = 1

log = logging.getLogger("sdcwatch.service.pipeline")


def _fixed(default: float) -> Any:
    """A setting ``sdcwatch serve`` keeps at its default (no key: the config schema skips ``fixed`` fields)."""
    return field(default=default, metadata={"fixed": True})


@dataclass
class PipelineSettings:
    """Settings of the detection pipeline: the ``[detectors]`` table of ``sdcwatch serve``
    (:class:`sdcwatch.config.DetectorsConfig` adds the stage, the schema wait and one table per
    detector). The docstrings are the reference of the keys; errors name ``detectors.<key>``.
    """

    resolve_after_steps: int = 50
    """An incident is resolved after this many consecutive steps without a new finding."""
    align_timeout_s: float = 5.0
    """Seconds the step aligner waits for the last ranks of a step before closing it without them."""
    max_runs: int = 1000
    """Runs whose detection state is kept (memory and the state file grow with them). Past it a new
    run's records wait (run_wait_records) until a run gives way: a signed newcomer takes the place of
    an unsigned run at once; else a run on probation silent for run_probation_idle_s, else a run
    silent for run_yield_idle_s, gives way (docs/service.md, "Run lifecycle")."""
    max_unsigned_runs: int = 100
    """Places unsigned runs may hold while the service holds a signed run (keys on, unsigned
    accepted): past it an unsigned newcomer waits."""
    run_wait_records: int = 50000
    """Records of new runs that may wait for a place. Past it the run that sent least recently loses
    its waiting records (dead-lettered, reason runs, with its name and count; said again when it is
    admitted)."""
    run_probation_steps: int = 20
    """Whole steps (every rank of its world sent them) a new run must show, over at least
    run_probation_s, before it holds its place: until then it is on probation, and past max_runs it
    gives way to a new run once silent for run_probation_idle_s."""
    run_probation_s: float = 10.0
    """Seconds between a run's first whole step and the one that ends its probation (a flood of
    steps sent at once is no evidence of training)."""
    run_probation_idle_s: float = 2.0
    """Seconds without a record after which a run on probation gives way to a new run (only when
    a new run waits for a place, and has shown as many whole steps or training)."""
    run_yield_idle_s: float = 30.0
    """Seconds without a step after which a run past probation gives way to a new run (only when a
    new run that has shown training waits for a place, and never a signed run to an unsigned one)."""
    run_stale_s: float = 900.0
    """Seconds without a step after which a run's open incidents resolve (the run ended or died;
    the exporter's last-step age and the missing-rank alerts say which); a run silent this long also
    is forgotten when a new run waits (run_yield_idle_s comes first)."""
    run_record_budget: float = 250000.0
    """Records a run may send a second, averaged over run_budget_window_s (a 16,384-rank job at 15
    steps a second fits); records past it are dead-lettered (reason budget), so one run cannot flood
    the service."""
    run_budget_window_s: float = 10.0
    """Seconds over which a run's record budget is averaged: a run may send run_record_budget x this
    many records at once (a burst, a catch-up after an outage) before its budget binds."""
    run_backlog_records: int = 50000
    """Records that may wait for their run's share of a pass: while several runs send more than the
    service judges in one, each run gets an equal share at most (a run needing less leaves the rest
    to the others) and its excess waits, in order, for later passes. Past it the runs read last lose
    theirs first (dead-lettered, reason budget, with the run's name and count)."""
    run_end_expiry_s: float = 300.0
    """Seconds a finished run (every rank sent its end-of-run marker; its incidents resolved) stays
    in memory and /metrics before its series are dropped."""
    run_idle_expiry_s: float = 21600.0
    """Seconds without a record after which a run that did not finish is evicted from memory and
    /metrics, its open incidents resolved. Keep it above the stall alert's 11 minutes."""
    names_resend_s: float = 300.0
    """Spatial stage: seconds over which it sends every rank's layer names to the temporal stage
    again, a few ranks on each step summary, so a temporal instance that started without its
    state names the modules again within this time (at most 4,096 ranks a summary)."""

    # fixed in the service (no key): tuned by tests and benchmarks
    max_open_steps: int = _fixed(64)
    """Open steps per run before the oldest is closed regardless of its deadline."""
    attribution_window: int = _fixed(50)
    """Steps within which a spike and rank-local evidence are joined, and within which findings of
    one fault on the same ranks are one incident (the others its related evidence)."""
    order_grace: float = _fixed(2.0)
    """Temporal stage: seconds a step summary waits for the summaries of earlier steps."""
    stats_every: int = _fixed(10)
    """Spatial stage: steps between the cross-rank quantiles it sends for the dashboards."""
    pass_records: int = _fixed(2048)
    """Records judged in one pass of the service's loop while several runs have more to judge
    (run_backlog_records): a run's records queued behind a flood wait for one pass, not for the flood."""

    def __post_init__(self) -> None:
        for f in fields(PipelineSettings):  # steps, runs: at least one; seconds: above zero
            if f.type in ("int", int):
                check_int(f"detectors.{f.name}", getattr(self, f.name), lo=1)
            else:
                check_number(f"detectors.{f.name}", getattr(self, f.name), 0, lo_open=True)


def _name_coords(findings: list, coords: np.ndarray | None) -> list:
    """Give each finding the mesh coordinates of the ranks it names (when the run has them)."""
    if coords is not None:
        for f in findings:
            if f.ranks and not f.coords:
                f.coords = tuple(coords_of(coords, r) for r in f.ranks[:64])
    return findings


def _no_ranks(findings: list) -> list:
    """The findings of a single series no rank sent (a CSV log), which a detector reads as rank 0's."""
    return [replace(f, ranks=(), hosts=(), coords=()) if f.ranks else f for f in findings]


class DetectionPipeline:
    """All detection state: feed records (or frames), get incident events; read ``view()``."""

    def __init__(
        self,
        settings: PipelineSettings | None = None,
        *,
        detectors: Callable[[], Sequence] = default_detectors,
        stage: str = "both",
        limits: RecordLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        hosts: HostSettings | None = None,
    ) -> None:
        self.settings = settings or PipelineSettings()
        self.stage = check_choice("detectors.stage", stage, STAGES)
        self.make_detectors = detectors
        if stage != "both":
            whole = [d.name for d in detectors() if not isinstance(d, SplitDetector)]
            if whole:
                raise ConfigError(
                    "detectors",
                    f"{', '.join(whole)} need(s) whole steps and cannot run in a "
                    f'split {stage} stage; run the service with stage = "both"',
                )
        self.wall = wall
        self.limits = limits or RecordLimits()
        self.aligner = StepAligner(
            self.settings.align_timeout_s,
            self.settings.max_open_steps,
            clock=clock,
            max_step_jump=self.limits.max_step_jump,
            max_step_values=self.limits.max_step_values,
            probation_steps=self.settings.run_probation_steps,
            probation_s=self.settings.run_probation_s,
            wait_records=self.settings.run_wait_records,
            record_budget=self.settings.run_record_budget,
            budget_window=self.settings.run_budget_window_s,
        )
        self.aligner.admit = self._admit
        #: whether a run signs its records (set by the service when it holds keys)
        self.signed: Callable[[str], bool] | None = None
        self.aligner.first = lambda run: self.signed is not None and self.signed(run)
        self.book = IncidentBook(
            self.settings.resolve_after_steps, related_steps=self.settings.attribution_window, clock=wall
        )
        resend = self.settings.names_resend_s if stage == "spatial" else None  # a spatial stage forwards the names
        self.names = LayerNameBook(self.settings.max_runs, resend=resend, clock=clock)  # incidents name modules
        # the checkpoints the runs saved, marked from their incidents (a spatial stage forwards the notes)
        self.checkpoints = CheckpointBook(
            self.settings.max_runs, forwards=stage == "spatial", clock=wall, holds=self.holds
        )  # the notes of runs it does not watch never push out those it does
        self.lifecycle = RunLifecycle(
            self.settings.run_end_expiry_s,
            self.settings.run_idle_expiry_s,
            close_grace=self.settings.align_timeout_s,
            clock=wall,
        )
        self._runs: dict[str, RunState] = {}
        # each run's share of a pass of the loop (share()): a flood's excess waits there
        self.backlog = RunBacklog(self.settings.pass_records, self.settings.run_backlog_records, clock=clock)
        self.hosts = HostLedger(hosts)  # evidence per host across runs (docs/hosts.md)
        self.findings_total: dict[tuple[str, str], int] = {}
        self.records_total = 0
        self.runs_forgotten = 0  # runs dropped to make room for new ones (settings.max_runs)
        self.last_record_wall = 0.0
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)
        self.order = SummaryOrder(self.settings.order_grace, clock=clock)
        self.summaries_total = 0  # temporal stage: summaries received
        self.outbox: list[StepSummary] = []  # spatial stage: summaries for the temporal stage
        self.forgotten_events: list[IncidentEvent] = []  # resolutions of forgotten runs' incidents
        self.carried: dict[str, Any] = {}  # the service's other parts' state (the runs' key bindings), saved with it

    # -- input --------------------------------------------------------------------------------

    def process(self, records: Iterable[Any]) -> list[IncidentEvent]:
        """Align records (v1 ``Record``, v2 ``RecordColumns``); run every closed step through the detectors."""
        records, markers, restarted, new = self.lifecycle.sort(self.checkpoints.take(self.names.take(records)))
        self.records_total += (n := count_records(records))  # telemetry: end-of-run markers not counted
        self._arrived(n + len(markers))
        events: list[IncidentEvent] = []
        for run in restarted:  # a finished run's name is used again: the old run goes first
            events += self.evict(run, "finished")
        self.lifecycle.arrived(restarted)
        events += self._judge_frames(self.aligner.add(records))
        self.lifecycle.arrived([run for run in new if self.aligner.holds(run)])  # admitted (max_runs)
        self._admitted_from_wait()
        for marker in markers:  # the run closes in expire(), once its last steps are judged
            if not self.aligner.wait_end(marker):  # a waiting run's end waits with its records
                self.lifecycle.end(marker)
        return self._with_forgotten(events)

    def share(self, items: list) -> list:
        """Of a poll's items, those to process in this pass: each run's share first (runs read
        before a flood's before its runs), then the excess of runs that sent more (:class:`RunBacklog`).
        While a new run (not one that gave way) waits for a place, the excess of a run on probation
        waits whole until it sends again: silent, it gives way as if its records had been judged,
        and runs that gave way do not take turns (docs/service.md, "Run lifecycle")."""
        hold = self.aligner.on_probation if self.aligner.new_run_waits() else None
        items, lost = self.backlog.take(items, hold)
        self.aligner.rejected += lost
        return items

    def _judge_frames(self, frames: Iterable[StepFrame]) -> list[IncidentEvent]:
        return [e for frame in frames for e in self.process_frame(frame)]

    def _with_forgotten(self, events: list[IncidentEvent]) -> list[IncidentEvent]:
        if self.forgotten_events:
            events, self.forgotten_events = self.forgotten_events + events, []
        return events

    def tick(self) -> list[IncidentEvent]:
        """Close steps whose alignment deadline passed, release waiting summaries (call regularly)."""
        events = self._judge_frames(self.aligner.poll())
        self._admitted_from_wait()
        return self._with_forgotten(events + [e for s in self.order.poll() for e in self.judge_step(s)])

    def expire(self) -> list[IncidentEvent]:
        """Resolve incidents of runs silent for ``run_stale_s``, close finished runs, evict expired ones."""
        now = self.wall()
        events: list[IncidentEvent] = []
        for run, st in self._runs.items():
            if st.last_step >= 0 and now - st.last_step_wall >= self.settings.run_stale_s:
                events += self.book.close_run(run, st.last_step)
        waiting = self.order.held if self.stage == "temporal" else self.aligner.open_steps_of
        for run in self.lifecycle.to_close(waiting):
            events += self._judge_frames(self.aligner.flush_run(run))
            st = self._runs.get(run)
            events += self.book.close_run(run, st.last_step if st is not None else -1)
            self.lifecycle.closed(run)
            if self.stage == "spatial" and st is not None:  # tell the temporal stage, after the last steps
                self.outbox.append(StepSummary.end_of(run, st.last_step, st.world))
        for run, why in self.lifecycle.to_evict():
            events += self.evict(run, why)
        self.checkpoints.events(events)  # resolutions of stale and closed runs' incidents
        return events

    def evict(self, run: str, why: str = "") -> list[IncidentEvent]:
        """Forget ``run``: its open incidents resolve (the events say so), its state and series go."""
        st = self._runs.pop(run, None)
        events = self.book.close_run(run, st.last_step if st is not None else -1)
        self.book.forget_run(run)
        self.names.forget(run)
        self.checkpoints.forget(run)
        self.aligner.forget(run)
        self.order.forget(run)
        self.lifecycle.forget(run, why)
        return events

    def flush(self) -> list[IncidentEvent]:
        """Close every open step and release every waiting summary (end of input)."""
        events = self._judge_frames(self.aligner.flush())
        return events + [e for s in self.order.flush() for e in self.judge_step(s)]

    def process_frame(self, frame: StepFrame) -> list[IncidentEvent]:
        """One aligned step: observe it (spatial), then judge it (temporal) or queue its summary."""
        summary = self.observe_step(frame)
        if self.stage == "spatial":
            self.outbox.append(summary)
            return []
        return self.judge_step(summary)

    def process_summaries(self, summaries: Iterable[StepSummary]) -> list[IncidentEvent]:
        """Temporal stage: take summaries from the spatial instances, judge them in step order."""
        summaries = list(summaries)
        self.summaries_total += len(summaries)
        self._arrived(len(summaries))
        # the end closes a run in expire()
        summaries = self.lifecycle.take_summaries(self.checkpoints.take(self.names.take(summaries)))
        return self._with_forgotten([e for s in self.order.add(summaries) for e in self.judge_step(s)])

    def _arrived(self, n: int) -> None:
        """Input rate and age of the last input: records (one process, spatial) or summaries (temporal)."""
        if n:
            self.last_record_wall = self.wall()
            self._rate.append((self.last_record_wall, n))

    def _state(self, run: str) -> RunState:
        st = self._runs.get(run)
        if st is None:
            dets = list(self.make_detectors())
            if self.stage == "spatial":
                for d in dets:
                    d.sparse = True
            st = self._runs[run] = RunState(dets, Attribution(self.settings.attribution_window))
        return st

    def _admit(self, run: str) -> bool:
        """Whether a new run gets a place within ``max_runs`` now (else its records wait): while signed
        runs are held, an unsigned one only below ``max_unsigned_runs``; when all are taken, the run the
        first rule that applies names gives way, its waiting records kept (docs/service.md, "Run lifecycle")."""
        s, signed, aligner = self.settings, self.signed, self.aligner
        first_class = signed is not None and signed(run)
        if signed is not None and not first_class and aligner.runs() >= s.max_unsigned_runs:
            kinds = [signed(r) for r in aligner.held()]
            if any(kinds) and kinds.count(False) >= s.max_unsigned_runs:
                return False
        if aligner.runs() < s.max_runs:
            return True
        keep = signed if signed is not None and not first_class else (lambda r: False)  # unsigned never evicts signed
        rules = (  # (the newcomer it applies to, the run that gives way), in order
            # any that has shown as many whole steps: the run on probation silent longest, run_probation_idle_s
            (True, lambda: aligner.idlest_on_probation(s.run_probation_idle_s, keep, newcomer=run)),
            # signed, at once: the idlest unsigned run, on probation first
            (first_class, lambda: aligner.idlest_on_probation(0.0, signed) or self._idlest(signed)),
            # any: a run silent run_stale_s
            (True, lambda: self._idlest(keep, s.run_stale_s)),
            # any that has shown training: the idlest training run silent run_yield_idle_s
            (aligner.shown_training(run), lambda: self._idlest(keep, s.run_yield_idle_s, training=True)),
        )
        if (victim := next((v for applies, pick in rules if applies and (v := pick()) is not None), None)) is None:
            return False
        self.runs_forgotten += 1
        behind = self.backlog.drop(victim)  # not processed yet: they wait with its open steps' records
        self.records_total += len(behind)
        self.aligner.forget(victim, gave_way=True, behind=behind)
        self.forgotten_events += self.evict(victim)
        return True

    def _idlest(self, skip: Callable[[str], bool], silent_s: float | None = None, training: bool = False) -> str | None:
        """The run silent longest of those not ``skip`` (past probation, with ``training``), if silent ``silent_s``."""
        run = next((r for r in self._runs if not skip(r) and not (training and self.aligner.on_probation(r))), None)
        silent = run is not None and (silent_s is None or self.wall() - self._runs[run].last_step_wall >= silent_s)
        return run if silent else None

    def _admitted_from_wait(self) -> None:
        """Runs given a place after waiting: their lifecycle starts; one that lost records waiting says so."""
        runs, lost, ends = self.aligner.take_admitted()
        self.lifecycle.arrived(runs)
        for marker in ends:
            self.lifecycle.end(marker)
        for run, n in lost.items():
            log.warning(
                "run %r admitted after %d of its records were dead-lettered (reason runs) while it waited for a "
                "place (detectors.run_wait_records): its first steps are missing",
                run[:80],
                n,
            )

    def holds(self, run: str) -> bool:
        """Whether the pipeline keeps ``run`` (its schemas are then kept too: see ``SchemaRegistry.holds``)."""
        return self.aligner.holds(run) or self.aligner.waits(run) or run in self._runs

    def observe_step(self, frame: StepFrame) -> StepSummary:
        """The cross-rank half of every detector on one step, as a :class:`StepSummary`."""
        frame.departed = self.lifecycle.departed(frame.run, frame.step, frame.world)
        st = self._state(frame.run)
        known = st.hosts if len(st.hosts) == frame.world else [""] * frame.world
        hosts = tuple(frame.hosts) if frame.complete else tuple(new or old for new, old in zip(frame.hosts, known))
        col = frame.scalar("emitter_dropped")
        dropped: dict[int, float] = {}
        if col is not None:
            nz = np.flatnonzero(np.isfinite(col) & (col > 0))
            dropped = dict(zip(nz.tolist(), col[nz].tolist()))
        summary = StepSummary(
            run=frame.run,
            step=frame.step,
            world=frame.world,
            n_present=int(frame.present.sum()),
            complete=frame.complete,
            hosts=None if hosts == st.sent_hosts else hosts,
            dropped=dropped,
            frame=frame,
        )
        st.sent_hosts = hosts
        coords = known_coords(frame)
        if coords is not None:
            known = st.coords
            if not frame.complete and known is not None and known.shape == coords.shape:
                coords = np.where(frame.present[:, None], coords, known)  # absent ranks: as last seen
            if st.sent_coords is None or st.sent_coords.shape != coords.shape or (st.sent_coords != coords).any():
                summary.coords = coords
            st.sent_coords = st.coords = coords
        obs = summary.observations
        for det in st.detectors:
            if isinstance(det, SplitDetector):
                obs[det.name] = det.observe(frame)
        spatial = self.stage == "spatial"
        # a step measuring a sampled layer metric (attention statistics) keeps its statistics: held on view
        if st.held.measures_sampled(frame.layer_names) or (spatial and st.steps_total % self.settings.stats_every == 0):
            summary.stats = frame_stats(frame)
        if spatial:
            st.hosts = list(hosts)
            st.steps_total += 1
            st.last_step, st.last_step_wall, st.world = frame.step, self.wall(), frame.world
            self._runs[frame.run] = self._runs.pop(frame.run)  # most recently active last
        return summary

    def judge_step(self, summary: StepSummary) -> list[IncidentEvent]:
        """The temporal half: every detector's judgement, attribution and the incident book."""
        st = self._state(summary.run)
        self._runs[summary.run] = self._runs.pop(summary.run)  # most recently active last
        st.remember(summary, self.wall())
        if summary.hosts is None:
            summary.hosts = tuple(st.hosts)
        if summary.coords is None and st.coords is not None and st.coords.shape[0] == summary.world:
            summary.coords = st.coords
        findings = []
        for det in st.detectors:
            if isinstance(det, SplitDetector):
                found = det.judge(summary, summary.observations.get(det.name))
            elif summary.frame is not None:  # a detector that needs the whole step (both stages here)
                found = det.update(summary.frame)
            else:
                found = []
            _name_coords(found, summary.coords)
            for f in found:
                k = (f.detector, f.kind)
                self.findings_total[k] = self.findings_total.get(k, 0) + 1
            findings += found
        findings = self.names.enrich(findings, summary.run)  # a layer index names its module
        # a step judged from ranks' records (over the bus, or here) has ranks, a single series has none
        ranks_known = summary.frame is None or summary.frame.ranks_known
        raw = findings  # the single-step rank deviations attribution consumes are host evidence too
        findings = st.attribution.apply(summary.step, summary.world, findings, ranks_known)
        findings = _name_coords(findings if ranks_known else _no_ranks(findings), summary.coords)
        gpus = self.names.gpus_of(summary.run)  # each rank's GPU, as it said (empty: none did)
        credit_hosts(self.hosts, findings, summary.hosts, self.wall(), gpus, deviations=raw if ranks_known else ())
        events = self.book.add(findings, summary.hosts) + self.book.advance(summary.run, summary.step)
        self.checkpoints.events(events)  # incidents first: a checkpoint of this step is marked with them
        self.checkpoints.judged(summary.run, summary.step)
        return events

    # -- reading ------------------------------------------------------------------------------

    def incidents(self) -> list:
        """Open incidents and the recently resolved ones."""
        return self.book.current()

    def take_summaries(self) -> list[StepSummary]:
        """Spatial stage: the step summaries made since the last call, for the summaries topic."""
        summaries, self.outbox = self.outbox, []
        summaries = self.names.stamp(summaries)  # with the layer names the temporal stage has not had
        return self.checkpoints.stamp(summaries)  # and the checkpoints the ranks saved

    def take_marks(self) -> list:
        """The checkpoints marked (or marked again) since the last call, for the anomalies topic."""
        return self.checkpoints.take_marks()

    def _run_views(self, max_runs: int | None) -> list[RunView]:
        """Views of the runs to export: all, or the ``max_runs`` with open incidents first, then the
        most recently active (each built once per step)."""
        runs = [(run, st) for run, st in self._runs.items() if st.summary is not None]
        if max_runs is not None and len(runs) > max_runs:
            alerting = {inc.run for inc in self.book.current() if inc.open}
            runs.sort(key=lambda rs: (rs[0] not in alerting, -rs[1].last_step_wall, rs[0]))
            runs = runs[:max_runs]
        out = []
        for run, st in runs:
            if st.view is None or st.view.finished != self.lifecycle.finished(run):  # built per step or end
                st.view = run_view(run, st, self.lifecycle.finished(run), self.names.names_of)
            out.append(st.view)
        return out

    def view(self, *, max_runs: int | None = None, **health: Any) -> ServiceView:
        """What the exporter shows: runs (at most ``max_runs``), pipeline health, incidents, counters;
        ``health``: the :class:`PipelineView` fields of the source and the state file (the service's)."""
        runs = [] if self.stage == "spatial" else self._run_views(max_runs)
        now = self.wall()
        recent = [(t, n) for t, n in self._rate if now - t <= 10.0]
        rps = 0.0
        if len(recent) >= 2 and now > recent[0][0]:
            rps = sum(n for _, n in recent[1:]) / max(now - recent[0][0], 1e-6)
        pipe = PipelineView(
            records_total=self.records_total,
            records_per_second=rps,
            duplicates_total=self.aligner.duplicates + self.order.duplicates,
            summaries_total=self.summaries_total,
            summaries_late_total=self.order.late,
            last_record_wall=self.last_record_wall,
            late_records_total=self.aligner.late_records,
            world_changes_total=self.aligner.world_changes,
            incomplete_steps_total=self.aligner.incomplete_steps,
            runs_total=len(self._runs),
            runs_forgotten_total=self.runs_forgotten,
            runs_evicted_total=dict(self.lifecycle.evicted_total),
            **health,
        )
        return ServiceView(
            runs=runs,
            pipeline=pipe,
            incidents=self.book.current(),
            incidents_total=dict(self.book.opened_total),
            findings_total=dict(self.findings_total),
            checkpoints=self.checkpoints.view({r.run for r in runs}),
        )

    # -- state ----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The entire detection state, JSON-safe."""
        return {
            "version": STATE_VERSION,
            "aligner": self.aligner.snapshot(),
            "book": self.book.snapshot(),
            "runs": {run: st.snapshot() for run, st in self._runs.items()},
            "findings_total": [[d, k, n] for (d, k), n in self.findings_total.items()],
            "records_total": self.records_total,
            "stage": self.stage,
            "order": self.order.snapshot(),
            "summaries_total": self.summaries_total,
            "lifecycle": self.lifecycle.snapshot(),
            "layer_names": self.names.snapshot(),
            "checkpoints": self.checkpoints.snapshot(),
            "carried": self.carried,
            "hosts": self.hosts.snapshot(),
            "backlog": self.backlog.snapshot(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take back a :meth:`snapshot` (detectors missing from it start fresh)."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError("state.version", f"unknown pipeline state version {state.get('version')!r}")
        saved = state.get("stage", state.get("role", "both"))  # "role": the key of older states
        if saved != self.stage:
            which = f"the state was saved by a {saved!r} stage, this is a {self.stage!r} stage"
            raise ConfigError("state.file", f"{which}: give each stage its own state directory")
        self.aligner.restore(state["aligner"])
        self.book.restore(state["book"])
        self._runs = {}
        for run, d in state["runs"].items():
            st = self._state(run)
            st.restore(d, self.wall())  # the stale clock restarts with the service
            self._runs[run] = st
        self.findings_total = {(a, b): int(n) for a, b, n in state["findings_total"]}
        self.records_total = int(state["records_total"])
        self.order.restore(state.get("order", {}))
        self.summaries_total = int(state.get("summaries_total", 0))
        self.lifecycle.restore(state.get("lifecycle", {}), runs=self._runs)
        self.names.restore(state.get("layer_names", {}))
        self.checkpoints.restore(state.get("checkpoints", {}))
        self.hosts.restore(state.get("hosts", {}))
        self.backlog.restore(state.get("backlog", []))
        carried = state.get("carried")
        self.carried = carried if isinstance(carried, dict) else {}

    def save(self, path: str | os.PathLike, state: dict[str, Any] | None = None) -> None:
        """Write the state (``state``, or a snapshot taken now)."""
        write_state(path, json_safe(state if state is not None else self.snapshot()))

    def load(self, path: str | os.PathLike) -> bool:
        """Restore from ``path`` if it exists; returns whether it did (ConfigError for a damaged file)."""
        state = read_state(path)
        if state is None:
            return False
        with restoring(path):
            self.restore(state)
        return True
