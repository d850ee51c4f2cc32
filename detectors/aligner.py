"""Step alignment: one run's records grouped by step across ranks, closed in step order.

A step closes when all ranks of the world have arrived, or ``timeout`` seconds after its first
record (late or missing ranks are then absent in the frame, and the missing-rank detector takes
over). Frames leave in increasing step order: a complete step waits for earlier open steps (at
most ``timeout``, or until more than ``max_open`` steps are open); a complete step that does not
follow the last closed one by the run's usual stride waits ``reorder_grace`` seconds, since an
earlier step may still be on its way (Kafka partitions are read at different paces). Duplicates (at-least-once
delivery) and records for steps already closed are counted and dropped. Runs are kept apart; a
change of world size (elastic training) closes what is open and starts the run's alignment afresh.

Two guards keep one record from blinding or swamping a run. A step more than ``max_step_jump``
steps ahead of the run's last closed step closes only if most of the run's ranks sent it (a real
jump: every rank restarted from a later checkpoint); otherwise its records are set aside in
:attr:`StepAligner.rejected` (reason ``step_jump``) instead of making every later record late.
A record that would make its step hold more than ``max_step_values`` values (world x the union
of the metrics its ranks sent) is set aside too (reason ``step_size``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.telemetry.limits import RecordLimits
from sdcwatch.telemetry.record import Record
from sdcwatch.telemetry.record_json import from_dict, to_dict

__all__ = ["StepAligner"]


@dataclass
class _OpenStep:
    first_seen: float
    records: dict[int, Record] = field(default_factory=dict)
    scalar_names: set[str] = field(default_factory=set)  # union over its records (the frame's width)
    layer_names: set[str] = field(default_factory=set)
    layer_len: int = 0


@dataclass
class _RunState:
    world: int
    open: dict[int, _OpenStep] = field(default_factory=dict)
    last_closed: int = -1
    stride: int = 1  # usual distance between consecutive closed steps (runs may log every N steps)
    generation: int = 0  # bumped by a world-size change


class StepAligner:
    """Turns a stream of records (any order, any duplicates) into complete-or-timed-out frames."""

    def __init__(self, timeout: float = 5.0, max_open: int = 64, *, reorder_grace: float = 1.0,
                 max_step_jump: int = RecordLimits.max_step_jump, max_step_values: int = RecordLimits.max_step_values,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_positive("aligner", timeout=timeout, max_open=max_open, reorder_grace=reorder_grace,
                       max_step_jump=max_step_jump, max_step_values=max_step_values)
        self.max_step_jump = int(max_step_jump)
        self.max_step_values = int(max_step_values)
        #: records set aside, as (reason, description, records); the owner takes and dead-letters them
        self.rejected: list[tuple[str, str, list[Record]]] = []
        #: asked before a new run is taken; False sets its record aside (reason ``runs``)
        self.admit: Callable[[str], bool] = lambda run: True
        self.timeout = float(timeout)
        self.reorder_grace = min(float(reorder_grace), self.timeout)
        self.max_open = int(max_open)
        self.clock = clock
        self._runs: dict[str, _RunState] = {}
        self.duplicates = 0
        self.late_records = 0
        self.world_changes = 0
        self.incomplete_steps = 0
        self.jumps_rejected = 0  # steps set aside as implausibly far ahead

    # -- input --------------------------------------------------------------------------------

    def add(self, records: Iterable[Record]) -> list[StepFrame]:
        """Take records; returns the frames that closed (in step order per run)."""
        now = self.clock()
        out: list[StepFrame] = []
        touched: set[str] = set()
        for rec in records:
            st = self._runs.get(rec.run)
            if st is None:
                if not self.admit(rec.run):
                    self.rejected.append(("runs", f"run {rec.run!r} is one more than the service keeps "
                                          "(detectors.max_runs) and no run is stale enough to make room", [rec]))
                    continue
                st = self._runs[rec.run] = _RunState(world=rec.world)
            elif rec.world != st.world:
                out += self._drain(rec.run, st, force=True, now=now)
                self.world_changes += 1
                st = self._runs[rec.run] = _RunState(world=rec.world, last_closed=st.last_closed, stride=st.stride,
                                                     generation=st.generation + 1)
            if rec.step <= st.last_closed:
                self.late_records += 1
                continue
            op = st.open.get(rec.step)
            if op is None:
                op = st.open[rec.step] = _OpenStep(first_seen=now)
            if rec.rank in op.records:
                self.duplicates += 1
                continue
            if not self._fits(st, op, rec):
                continue
            op.records[rec.rank] = rec
            touched.add(rec.run)
        for run in touched:
            out += self._drain(run, self._runs[run], force=False, now=now)
        return out

    def _fits(self, st: _RunState, op: _OpenStep, rec: Record) -> bool:
        """Whether ``rec`` keeps its step within ``max_step_values``; records it into ``op`` if so."""
        n = max(map(len, rec.layers.values()), default=0)
        if rec.scalars.keys() <= op.scalar_names and rec.layers.keys() <= op.layer_names and n <= op.layer_len:
            return True
        scalars = op.scalar_names.union(rec.scalars)
        layers = op.layer_names.union(rec.layers)
        length = max(n, op.layer_len)
        width = len(scalars) + len(layers) * length
        if st.world * width > self.max_step_values:
            self.rejected.append(("step_size", f"step {rec.step} of run {rec.run!r} would hold {st.world} ranks x "
                                  f"{width} values, the limit is {self.max_step_values} (limits.max_step_values)",
                                  [rec]))
            return False
        op.scalar_names, op.layer_names, op.layer_len = scalars, layers, length
        return True

    def take_rejected(self) -> list[tuple[str, str, list[Record]]]:
        """The records set aside since the last call (see the module docstring)."""
        out, self.rejected = self.rejected, []
        return out

    def poll(self) -> list[StepFrame]:
        """Close steps whose deadline passed (call regularly, also when no records arrive)."""
        now = self.clock()
        out: list[StepFrame] = []
        for run, st in list(self._runs.items()):
            out += self._drain(run, st, force=False, now=now)
        return out

    def flush(self) -> list[StepFrame]:
        """Close every open step now (end of a replay file, shutdown)."""
        now = self.clock()
        out: list[StepFrame] = []
        for run, st in list(self._runs.items()):
            out += self._drain(run, st, force=True, now=now)
        return out

    def _drain(self, run: str, st: _RunState, *, force: bool, now: float) -> list[StepFrame]:
        out = []
        while st.open:
            step = min(st.open)
            op = st.open[step]
            complete = len(op.records) == st.world
            age = now - op.first_seen
            in_order = step == st.last_closed + st.stride
            ready = complete and (in_order or age >= self.reorder_grace)
            if not (ready or age >= self.timeout or force or len(st.open) > self.max_open):
                break
            del st.open[step]
            jump = step - st.last_closed
            if st.last_closed >= 0 and jump > self.max_step_jump and 2 * len(op.records) <= st.world:
                self.jumps_rejected += 1
                self.rejected.append(("step_jump", f"step {step} of run {run!r} is {jump} steps ahead of its last "
                                      f"step {st.last_closed} (limits.max_step_jump {self.max_step_jump}) and only "
                                      f"{len(op.records)} of {st.world} ranks sent it", list(op.records.values())))
                continue
            if not complete:
                self.incomplete_steps += 1
            if st.last_closed >= 0:
                st.stride = step - st.last_closed
            st.last_closed = step
            out.append(StepFrame.from_records(run, step, st.world, list(op.records.values()), wall=time.time()))
        return out

    def flush_run(self, run: str) -> list[StepFrame]:
        """Close every open step of ``run`` now (the run ended)."""
        st = self._runs.get(run)
        return [] if st is None else self._drain(run, st, force=True, now=self.clock())

    def holds(self, run: str) -> bool:
        """Whether ``run`` is being aligned (it was admitted and not forgotten)."""
        return run in self._runs

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

    def forget(self, run: str) -> None:
        """Drop a run's alignment state (its open steps are discarded)."""
        self._runs.pop(run, None)

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe state, including the records of still-open steps (they are not re-read)."""
        return {"runs": {run: {
            "world": st.world, "last_closed": st.last_closed, "stride": st.stride, "generation": st.generation,
            "open": [[step, [to_dict(r) for r in op.records.values()]] for step, op in st.open.items()],
        } for run, st in self._runs.items()},
            "counters": [self.duplicates, self.late_records, self.world_changes, self.incomplete_steps]}

    def restore(self, state: dict[str, Any]) -> None:
        now = self.clock()
        self._runs = {}
        for run, d in state["runs"].items():
            st = _RunState(world=int(d["world"]), last_closed=int(d["last_closed"]), stride=int(d.get("stride", 1)),
                           generation=int(d["generation"]))
            for step, recs in d["open"]:
                st.open[int(step)] = _OpenStep(first_seen=now, records={r.rank: r for r in map(from_dict, recs)})
            self._runs[run] = st
        self.duplicates, self.late_records, self.world_changes, self.incomplete_steps = state["counters"]
