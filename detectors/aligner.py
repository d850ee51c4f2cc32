"""Step alignment: one run's records grouped by step across ranks, closed in step order.

A step closes when all ranks of the world have arrived, or ``timeout`` seconds after its first
record (late or missing ranks are then absent in the frame, and the missing-rank detector takes
over). Frames leave in increasing step order: a complete step waits for earlier open steps (at
most ``timeout``, or until more than ``max_open`` steps are open); a complete step that does not
follow the last closed one by the run's usual stride waits ``reorder_grace`` seconds, since an
earlier step may still be on its way (Kafka partitions are read at different paces). Duplicates (at-least-once
delivery) and records for steps already closed are counted and dropped. Runs are kept apart; a
change of world size (elastic training) closes what is open and starts the run's alignment afresh.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.telemetry.record import Record
from sdcwatch.telemetry.record_json import from_dict, to_dict

__all__ = ["StepAligner"]


@dataclass
class _OpenStep:
    first_seen: float
    records: dict[int, Record] = field(default_factory=dict)


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
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_positive("aligner", timeout=timeout, max_open=max_open, reorder_grace=reorder_grace)
        self.timeout = float(timeout)
        self.reorder_grace = min(float(reorder_grace), self.timeout)
        self.max_open = int(max_open)
        self.clock = clock
        self._runs: dict[str, _RunState] = {}
        self.duplicates = 0
        self.late_records = 0
        self.world_changes = 0
        self.incomplete_steps = 0

    # -- input --------------------------------------------------------------------------------

    def add(self, records: Iterable[Record]) -> list[StepFrame]:
        """Take records; returns the frames that closed (in step order per run)."""
        now = self.clock()
        out: list[StepFrame] = []
        touched: set[str] = set()
        for rec in records:
            st = self._runs.get(rec.run)
            if st is None:
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
            op.records[rec.rank] = rec
            touched.add(rec.run)
        for run in touched:
            out += self._drain(run, self._runs[run], force=False, now=now)
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
            if not complete:
                self.incomplete_steps += 1
            if st.last_closed >= 0:
                st.stride = step - st.last_closed
            st.last_closed = step
            out.append(StepFrame.from_records(run, step, st.world, list(op.records.values()), wall=time.time()))
        return out

    # -- state --------------------------------------------------------------------------------

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
