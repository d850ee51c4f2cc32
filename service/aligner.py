"""Step alignment: one run's records grouped by step across ranks, closed in step order.

A step closes when every rank of the world sent it, or ``timeout`` seconds after its first record
(the missing-rank detector takes over). Frames leave in step order: a complete step that does not
follow the last closed one by the run's usual stride waits ``reorder_grace`` seconds, or up to
``timeout`` while :attr:`StepAligner.backlog` says records wait on the bus (Kafka partitions are read
at different paces). Duplicates and records of closed steps are counted and dropped; a change of
world size (elastic training) starts the run's alignment afresh. Records past the limits
(``step_jump``, ``step_size``) or past a run's budget (``budget``) are set aside in
:attr:`StepAligner.rejected`; a new run not admitted yet waits in a bounded buffer, dead-lettered
``runs`` only when the buffer overflows (docs/operating.md, "Limits"; admission and budget:
docs/service.md, "Run lifecycle"). Wire-v2 blocks are placed with array operations, one step's
arrays filled from them when it closes.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.record import from_dict, to_dict
from sdcwatch.core.record_type import Record
from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.frame import StepFrame, assemble_frame
from sdcwatch.service.alignment_state import OpenStep, RunSteps, WaitingRun, size_of, world_of
from sdcwatch.service.ingest import RecordColumns, as_records

__all__ = ["StepAligner"]


class StepAligner:
    """Turns a stream of records (any order, any duplicates) into complete-or-timed-out frames."""

    def __init__(
        self,
        timeout: float = 5.0,
        max_open: int = 64,
        *,
        reorder_grace: float = 1.0,
        max_step_jump: int = RecordLimits.max_step_jump,
        max_step_values: int = RecordLimits.max_step_values,
        probation_steps: int = 20,
        probation_s: float = 10.0,
        wait_records: int = 50_000,
        record_budget: float = float("inf"),
        budget_window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_positive(
            "aligner",
            timeout=timeout,
            max_open=max_open,
            reorder_grace=reorder_grace,
            max_step_jump=max_step_jump,
            max_step_values=max_step_values,
            probation_steps=probation_steps,
            probation_s=probation_s,
            wait_records=wait_records,
            record_budget=record_budget,
            budget_window=budget_window,
        )
        self.probation_steps = int(probation_steps)
        self.probation_s = float(probation_s)
        self.wait_records = int(wait_records)
        #: records and end markers of runs waiting for a place; the run that sent last is last.
        #: ``waiting_records`` counts them, ``lost_waiting`` the records of each run dead-lettered
        #: when the buffer overflowed (taken at its admission)
        self._waiting: dict[str, WaitingRun] = {}
        self.waiting_records = 0
        self.lost_waiting: dict[str, int] = {}
        self._arriving: dict[str, tuple[int, int]] = {}  # new runs in the poll being taken: records, world
        #: what runs that gave way had shown (whole steps, clock of the first, trained): they keep it
        self._credit: dict[str, tuple[int, float | None, bool]] = {}
        self._admitted: list[str] = []  # runs admitted from the buffer since take_admitted()
        self._ends: list[Record] = []  # their end markers
        self.record_budget = float(record_budget)
        self._budget_cap = self.record_budget * float(budget_window)  # the bucket's size
        self._probation: dict[str, float] = {}  # runs on probation -> clock of their last record, oldest first
        self.over_budget = 0  # records set aside past their run's budget
        self.max_step_jump = int(max_step_jump)
        self.max_step_values = int(max_step_values)
        #: records set aside, as (reason, description, records); the owner takes and dead-letters them
        self.rejected: list[tuple[str, str, list[Record]]] = []
        #: asked before a new run is taken; False keeps its records waiting for a place
        self.admit: Callable[[str], bool] = lambda run: True
        #: runs offered a place first among those waiting (the signed ones)
        self.first: Callable[[str], bool] = lambda run: False
        self.timeout = float(timeout)
        self.reorder_grace = min(float(reorder_grace), self.timeout)
        #: set by the reader of the bus: records are waiting there (consumer lag); a complete step
        #: out of order then waits for the earlier ones up to ``timeout``, not ``reorder_grace``
        self.backlog = False
        self.max_open = int(max_open)
        self.clock = clock
        self._runs: dict[str, RunSteps] = {}
        self.duplicates = 0
        self.late_records = 0
        self.world_changes = 0
        self.incomplete_steps = 0

    # -- input --------------------------------------------------------------------------------

    def add(self, records: Iterable[Record | RecordColumns]) -> list[StepFrame]:
        """Take records or v2 column blocks; returns the frames that closed (in step order per run)."""
        now = self.clock()
        out: list[StepFrame] = []
        touched: dict[str, None] = {}  # runs with a new record, in the order they came (a set's order is the hash's)
        over: dict[str, list[Record]] = {}  # records past their run's budget
        items = self._admission_order(records)
        if self._waiting:
            items = self._release() + items
        for rec in items:
            if rec.run not in self._runs and (rec.run in self._waiting or not self.admit(rec.run)):
                self._wait(rec)
                continue
            if isinstance(rec, RecordColumns):
                self._add_columns(rec, now, out, touched, over)
                continue
            st = self._run_state(rec.run, rec.world, now, out)
            if not self._grant(st, 1, now):
                over.setdefault(rec.run, []).append(rec)
                continue
            op = self._open_step(st, rec.step, now, 1)
            if op is None:
                continue
            if op.present[rec.rank]:
                self.duplicates += 1
                continue
            shape = (rec.scalars.keys(), rec.layers.keys(), max(map(len, rec.layers.values()), default=0))
            if self._fits(st, op, rec.step, rec.run, shape, lambda: [rec]):
                op.records[rec.rank] = rec
                op.present[rec.rank] = True
                op.count += 1
                touched[rec.run] = None
        for run in touched:
            st = self._runs.get(run)
            if st is not None:  # not given way to a signed run since
                out += self._drain(run, st, force=False, now=now)
        self._arriving = {}
        for run, recs in over.items():
            self.over_budget += len(recs)
            why = (
                f"run {run!r} sent more than its budget of {self.record_budget:g} records a second "
                f"(detectors.run_record_budget, averaged over detectors.run_budget_window_s)"
            )
            self.rejected.append(("budget", why, recs))
        return out

    def _admission_order(self, records: Iterable[Record | RecordColumns]) -> list:
        """The records of runs held first, then those of new runs, most records first (then by name),
        whatever the order a poll read them in; each run's own records keep their order."""
        items = records if isinstance(records, list) else list(records)
        new = {x.run for x in items}.difference(self._runs)
        if not new:
            return items
        count = dict.fromkeys(new, 0)
        worlds: dict[str, int] = {}
        for x in items:
            if x.run in count:
                count[x.run] += size_of(x)
                if x.run not in worlds:
                    worlds[x.run] = world_of(x)
        self._arriving = {run: (count[run], world) for run, world in worlds.items()}
        first = self.first
        rank = {run: i for i, run in enumerate(sorted(new, key=lambda run: (not first(run), -count[run], run)))}
        held = [x for x in items if x.run not in rank]
        return held + sorted((x for x in items if x.run in rank), key=lambda x: rank[x.run])

    def _grant(self, st: RunSteps, n: int, now: float) -> int:
        """How many of ``n`` records the run's budget (a token bucket) takes now."""
        if st.tokens < n:  # refill lazily: only when the bucket runs short
            st.tokens = min(self._budget_cap, st.tokens + (now - st.tokens_at) * self.record_budget)
            st.tokens_at = now
            n = min(n, int(st.tokens))
        st.tokens -= n
        return n

    def _wait(self, item: Record | RecordColumns, end: bool = False) -> None:
        """Keep a record, block or end marker (``end``) of a run not admitted yet; past
        ``wait_records`` the run that sent least recently loses its waiting records (dead-lettered
        ``runs``, counted for it)."""
        w = self._waiting.pop(item.run, None)
        if w is None:
            w = WaitingRun(world_of(item), self.clock())
        (w.ends if end else w.items).append(item)
        k = size_of(item)
        self._waiting[item.run] = w
        w.records += k
        self.waiting_records += k
        while self.waiting_records > self.wait_records:
            run = next(iter(self._waiting))
            w = self._waiting.pop(run)
            n = w.records
            self.waiting_records -= n
            if len(self.lost_waiting) >= self.wait_records:  # bounded: the oldest count goes
                del self.lost_waiting[next(iter(self.lost_waiting))]
            self.lost_waiting[run] = self.lost_waiting.get(run, 0) + n
            why = (
                f"run {run!r} waited for a place among detectors.max_runs and the {self.wait_records} "
                f"records runs may wait with are full (detectors.run_wait_records): its {n} waiting "
                f"record(s) are lost ({self.lost_waiting[run]} in all)"
            )
            self.rejected.append(("runs", why, as_records(w.items) + w.ends))

    def wait_end(self, marker: Record) -> bool:
        """Keep the end-of-run marker of a run that waits for a place with its records (it ends once
        admitted: :meth:`take_admitted`); False when the run does not wait."""
        if marker.run not in self._waiting:
            return False
        self._wait(marker, end=True)
        return True

    def _release(self) -> list:
        """The waiting records of the runs that get a place now, in their order: signed runs first,
        then the runs with most records waiting (a job's ranks), then by name; the first run refused
        a place ends the offers."""
        first = self.first
        out: list = []
        for run in sorted(self._waiting, key=lambda r: (not first(r), -self._waiting[r].records, r)):
            if run not in self._waiting:  # lost to the records of a run that gave way meanwhile
                continue
            if not self.admit(run):
                break
            w = self._waiting.pop(run, None)
            if w is None:  # its records were lost to those of the run that gave way for it
                continue
            self.waiting_records -= w.records
            self._admitted.append(run)
            self._ends += w.ends
            self._runs[run] = self._new_run(run, w.world, self.clock())
            out += w.items
        return out

    def _new_run(self, run: str, world: int, now: float) -> RunSteps:
        """A run taking a place: with the steps it showed before it gave way, if it did."""
        steps, since, trained = self._credit.pop(run, (0, None, False))
        if not trained:
            self._probation[run] = now
        return RunSteps(world, steps_complete=steps, complete_since=since, tokens=self._budget_cap, tokens_at=now)

    def _shown(self, run: str) -> tuple[bool, int]:
        """What a run not held has shown: whether it trained (before it gave way, or
        ``probation_steps`` whole steps' worth of records waiting over ``probation_s``), and how
        many whole steps' worth (records waiting and arriving over its world, or its credit)."""
        steps, _, trained = self._credit.get(run, (0, None, False))
        w = self._waiting.get(run)
        n, world = self._arriving.get(run, (0, 1))
        if w is None:
            return trained, max(steps, n // world)
        shown = (n + w.records - len(w.ends)) // w.world
        trained = trained or (shown >= self.probation_steps and self.clock() - w.since >= self.probation_s)
        return trained, max(steps, shown)

    def shown_training(self, run: str) -> bool:
        """Whether ``run``, not held, has shown training: before it gave way, or with its records
        waiting (``probation_steps`` whole steps' worth over ``probation_s``)."""
        return self._shown(run)[0]

    def new_run_waits(self) -> bool:
        """Whether a run that never gave way waits for a place (the held runs' excess waits then)."""
        return any(run not in self._credit for run in self._waiting)

    def waits(self, run: str) -> bool:
        """Whether records of ``run`` wait for a place."""
        return run in self._waiting

    def take_admitted(self) -> tuple[list[str], dict[str, int], list[Record]]:
        """The runs admitted from the buffer since the last call, of them those that lost records
        while waiting (how many), and the end markers that waited with them."""
        runs, self._admitted = self._admitted, []
        ends, self._ends = self._ends, []
        return runs, {run: self.lost_waiting.pop(run) for run in runs if run in self.lost_waiting}, ends

    def _run_state(self, run: str, world: int, now: float, out: list[StepFrame]) -> RunSteps:
        """The run's state (a new one for a run just admitted), started afresh (open steps closed
        first) when its world size changed."""
        st = self._runs.get(run)
        if st is None:  # admitted (add() asked)
            st = self._runs[run] = self._new_run(run, world, now)
        elif world != st.world:
            out += self._drain(run, st, force=True, now=now)
            self.world_changes += 1
            st = self._runs[run] = replace(st, world=world, open={}, generation=st.generation + 1)
        if run in self._probation or st.steps_complete < self.probation_steps:  # on probation: note its input
            self._probation.pop(run, None)  # most recent last
            self._probation[run] = now
        return st

    def _add_columns(
        self,
        cols: RecordColumns,
        now: float,
        out: list[StepFrame],
        touched: dict[str, None],
        over: dict[str, list[Record]],
    ) -> None:
        """Place a block's rows into their open steps: late, duplicate and new rows told apart with arrays."""
        worlds = cols.rows["world"]
        cuts = (np.flatnonzero(worlds[1:] != worlds[:-1]) + 1).tolist()  # a world change splits the block
        sch = cols.schema
        shape = (sch.scalars, [n for n, _ in sch.layers], max((k for _, k in sch.layers), default=0))
        for a, b in zip([0, *cuts], [*cuts, len(cols)]):
            part = cols if (a, b) == (0, len(cols)) else cols.take(slice(a, b))
            st = self._run_state(cols.run, int(worlds[a]), now, out)
            granted = self._grant(st, len(part), now)
            if granted < len(part):
                over.setdefault(cols.run, []).extend(part.take(slice(granted, None)).to_records())
                if not granted:
                    continue
                part = part.take(slice(0, granted))
            steps = part.rows["step"].astype(np.int64)
            order = np.argsort(steps, kind="stable")
            sorted_steps = steps[order]
            starts = np.flatnonzero(np.r_[True, sorted_steps[1:] != sorted_steps[:-1]])
            ranks_all = part.rows["rank"].astype(np.intp)
            for i, j in zip(starts.tolist(), [*starts[1:].tolist(), len(order)]):
                step = int(sorted_steps[i])
                idx = order[i:j]
                op = self._open_step(st, step, now, len(idx))
                if op is None:
                    continue
                ranks = ranks_all[idx]
                uniq, first = np.unique(ranks, return_index=True)
                new = ~op.present[uniq]
                self.duplicates += len(idx) - int(new.sum())
                if not new.any():
                    continue
                idx = idx[first[new]]
                if not self._fits(st, op, step, cols.run, shape, lambda idx=idx, part=part: part.to_records(idx)):
                    continue
                op.present[uniq[new]] = True
                op.count += len(idx)
                op.blocks.append((part, idx))
                touched[cols.run] = None

    def _open_step(self, st: RunSteps, step: int, now: float, n: int) -> OpenStep | None:
        """The run's open ``step`` (opened now if new); None when it closed already (its ``n`` records came late)."""
        if step <= st.last_closed:
            self.late_records += n
            return None
        op = st.open.get(step)
        if op is None:
            op = st.open[step] = OpenStep(first_seen=now, world=st.world)
        return op

    def _fits(
        self, st: RunSteps, op: OpenStep, step: int, run: str, shape: tuple, what: Callable[[], list[Record]]
    ) -> bool:
        """Whether records of this ``shape`` (scalar names, layer names, longest layer) keep their step
        within ``max_step_values``; widens ``op`` if so, sets the records (``what()``) aside if not."""
        scalar_names, layer_names, n = set(shape[0]), set(shape[1]), shape[2]
        if scalar_names <= op.scalar_names and layer_names <= op.layer_names and n <= op.layer_len:
            return True
        scalars = op.scalar_names | scalar_names
        layers = op.layer_names | layer_names
        length = max(n, op.layer_len)
        width = len(scalars) + len(layers) * length
        if st.world * width > self.max_step_values:
            why = (
                f"step {step} of run {run!r} would hold {st.world} ranks x "
                f"{width} values, the limit is {self.max_step_values} (limits.max_step_values)"
            )
            self.rejected.append(("step_size", why, what()))
            return False
        op.scalar_names, op.layer_names, op.layer_len = scalars, layers, length
        return True

    def take_rejected(self) -> list[tuple[str, str, list[Record]]]:
        """The records set aside since the last call."""
        out, self.rejected = self.rejected, []
        return out

    def poll(self, *, force: bool = False) -> list[StepFrame]:
        """Close steps whose deadline passed (call regularly); every open step with ``force``."""
        out = self.add([]) if self._waiting else []  # a place may have come free for a waiting run
        now = self.clock()
        return out + [f for run, st in list(self._runs.items()) for f in self._drain(run, st, force=force, now=now)]

    def flush(self) -> list[StepFrame]:
        """Close every open step now (end of a replay file, shutdown)."""
        return self.poll(force=True)

    def _drain(self, run: str, st: RunSteps, *, force: bool, now: float) -> list[StepFrame]:
        out = []
        while st.open:
            step = min(st.open)
            op = st.open[step]
            complete = op.count == st.world
            age = now - op.first_seen
            in_order = step == st.last_closed + st.stride
            ready = complete and (in_order or (age >= self.reorder_grace and not self.backlog))
            if not (ready or age >= self.timeout or force or len(st.open) > self.max_open):
                break
            del st.open[step]
            jump = step - st.last_closed
            if st.last_closed >= 0 and jump > self.max_step_jump and 2 * op.count <= st.world:
                why = (
                    f"step {step} of run {run!r} is {jump} steps ahead of its last "
                    f"step {st.last_closed} (limits.max_step_jump {self.max_step_jump}) and only "
                    f"{op.count} of {st.world} ranks sent it"
                )
                self.rejected.append(("step_jump", why, op.all_records()))
                continue
            if not complete:
                self.incomplete_steps += 1
            elif run in self._probation:  # evidence of training: whole steps, over probation_s
                st.steps_complete += 1
                if st.complete_since is None:
                    st.complete_since = now
                if st.steps_complete >= self.probation_steps and now - st.complete_since >= self.probation_s:
                    del self._probation[run]  # the run has shown its steps: it holds its place
            if st.last_closed >= 0:
                st.stride = step - st.last_closed
            st.last_closed = step
            out.append(assemble_frame(run, step, st.world, list(op.records.values()), op.blocks, wall=time.time()))
        return out

    def flush_run(self, run: str) -> list[StepFrame]:
        """Close every open step of ``run`` now (the run ended)."""
        st = self._runs.get(run)
        return [] if st is None else self._drain(run, st, force=True, now=self.clock())

    def holds(self, run: str) -> bool:
        """Whether ``run`` is being aligned (it was admitted and not forgotten)."""
        return run in self._runs

    def idlest_on_probation(
        self, idle: float, skip: Callable[[str], bool] = lambda run: False, newcomer: str | None = None
    ) -> str | None:
        """The run on probation silent longest (of those not ``skip``) of those silent ``idle``
        seconds, and with a ``newcomer``, of those that showed no more whole steps than it (counting
        at most ``probation_steps``; any, if it has shown training): a burst of first steps holds its
        place against a flood of lesser runs, and no burst holds it against one that showed as much."""
        now = self.clock()
        trained, shown = self._shown(newcomer) if newcomer is not None else (True, 0)
        shown = self.probation_steps if trained else min(shown, self.probation_steps)
        for run, last in self._probation.items():
            if now - last < idle:
                return None
            if not skip(run) and shown >= min(self._runs[run].steps_complete, self.probation_steps):
                return run
        return None

    def on_probation(self, run: str) -> bool:
        """Whether ``run`` is held and has not yet shown its training (``probation_steps`` whole
        steps over ``probation_s``)."""
        return run in self._probation

    def open_steps_of(self, run: str) -> int:
        """Steps of ``run`` waiting for ranks."""
        st = self._runs.get(run)
        return 0 if st is None else len(st.open)

    # -- state --------------------------------------------------------------------------------

    def last_closed(self, run: str) -> int:
        """The run's last closed step (-1: none yet)."""
        st = self._runs.get(run)
        return -1 if st is None else st.last_closed

    def runs(self) -> int:
        """Runs being aligned."""
        return len(self._runs)

    def held(self) -> list[str]:
        """The runs being aligned, in the order they were admitted."""
        return list(self._runs)

    def forget(self, run: str, gave_way: bool = False, behind: Sequence[Record] = ()) -> None:
        """Drop a run's alignment state. A run that ``gave_way`` to a new one keeps what it showed
        (its whole steps, whether it trained); its open steps' records, then ``behind`` (its records
        not aligned yet), wait for its return."""
        st = self._runs.pop(run, None)
        on_probation = self._probation.pop(run, None) is not None
        if gave_way and st is not None:
            if len(self._credit) >= self.wait_records:  # bounded: the oldest goes
                del self._credit[next(iter(self._credit))]
            self._credit[run] = (st.steps_complete, st.complete_since, not on_probation)
            for op in st.open.values():
                for rec in op.all_records():
                    self._wait(rec)
        for rec in behind:
            self._wait(rec)

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe state, including the records of still-open steps (they are not re-read)."""
        return {
            "runs": {
                run: {
                    "world": st.world,
                    "last_closed": st.last_closed,
                    "stride": st.stride,
                    "generation": st.generation,
                    "steps_complete": st.steps_complete,
                    "on_probation": run in self._probation,
                    "open": [[step, [to_dict(r) for r in op.all_records()]] for step, op in st.open.items()],
                }
                for run, st in self._runs.items()
            },
            "counters": [self.duplicates, self.late_records, self.world_changes, self.incomplete_steps],
            "waiting": [  # records and end markers of runs waiting (committed offsets are past them)
                [run, [to_dict(r) for r in as_records(w.items)], [to_dict(r) for r in w.ends]]
                for run, w in self._waiting.items()
            ],
            "lost_waiting": self.lost_waiting,
            "credit": [[run, steps, trained] for run, (steps, _, trained) in self._credit.items()],
        }

    def restore(self, state: dict[str, Any]) -> None:
        now = self.clock()
        self._runs, self._probation, self._waiting, self.waiting_records = {}, {}, {}, 0
        for run, recs, *ends in state.get("waiting", []):
            for rec in map(from_dict, recs):
                self._wait(rec)
            for rec in map(from_dict, ends[0] if ends else []):
                self._wait(rec, end=True)
        self._credit = {run: (int(steps), None, bool(trained)) for run, steps, trained in state.get("credit", [])}
        self.lost_waiting = {run: int(n) for run, n in state.get("lost_waiting", {}).items()}
        for run, d in state["runs"].items():
            st = RunSteps(
                world=int(d["world"]),
                last_closed=int(d["last_closed"]),
                stride=int(d.get("stride", 1)),
                generation=int(d["generation"]),
                steps_complete=int(d.get("steps_complete", d.get("steps_closed", self.probation_steps))),
                tokens=self._budget_cap,
                tokens_at=now,
            )
            # older states: a run that closed probation_steps steps was training
            if d.get("on_probation", st.steps_complete < self.probation_steps):
                self._probation[run] = now
            for step, recs in d["open"]:
                op = st.open[int(step)] = OpenStep(first_seen=now, world=st.world)
                for r in map(from_dict, recs):
                    if 0 <= r.rank < st.world and not op.present[r.rank]:
                        op.records[r.rank] = r
                        op.present[r.rank] = True
                        op.count += 1
            self._runs[run] = st
        self.duplicates, self.late_records, self.world_changes, self.incomplete_steps = state["counters"]
