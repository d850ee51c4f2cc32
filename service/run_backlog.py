"""RunBacklog: each poll's records shared between runs before the costly work (alignment, detectors),
so a flood's cost falls on its own run: a run takes at most its share of a pass while others wait,
and its excess waits here, in order, bounded (docs/service.md, "Run lifecycle").
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from sdcwatch.core.record import from_dict, to_dict
from sdcwatch.core.record_type import Record
from sdcwatch.service.ingest import RecordColumns, as_records

__all__ = ["RunBacklog", "fair_share"]


def fair_share(demand: dict[str, int], budget: int) -> int:
    """The largest share ``s`` with ``sum(min(d, s)) <= budget`` (max-min fairness): a run that
    needs less than an equal share leaves the rest to the others."""
    left, n = budget, len(demand)
    for d in sorted(demand.values()):
        if d * n > left:
            return left // n
        left, n = left - d, n - 1
    return max(demand.values(), default=0)


def _size(x: Record | RecordColumns) -> int:
    return len(x) if isinstance(x, RecordColumns) else 1


def _world(x: Record | RecordColumns) -> int:
    return x.world if isinstance(x, Record) else int(x.rows["world"][0])


class RunBacklog:
    """The records and column blocks of runs past their share, per run, in order.

    :meth:`take` gives a pass about ``pass_records`` records: runs with nothing waiting first, each
    at most its :func:`fair_share` among the runs first read in the same poll, those read earlier
    first (at least one record a rank of its world each, so whole steps move); what is left of the
    pass goes to the runs with records waiting, shared the same way. A poll of one run, or of no
    more than ``pass_records``, passes as it came. Past ``max_records`` waiting,
    the run with most waiting loses them (``budget`` dead letters that name it), and what it sends
    next waits behind the others' shares until its backlog drains.
    """

    def __init__(self, pass_records: int, max_records: int, *, clock: Callable[[], float]) -> None:
        self.pass_records = pass_records
        self.max_records = max_records
        self.clock = clock
        self._runs: dict[str, deque] = {}  # run -> its waiting items; the run heard from last is last
        self._counts: dict[str, int] = {}
        self._heard: dict[str, float] = {}  # clock of each waiting run's last arrival (a hold ends)
        self.records = 0  # records waiting
        self.ready = False  # whether some of them may be taken in the next pass (none held)
        self._flooded: dict[str, None] = {}  # runs that lost their backlog: they wait until it drains
        self._seen: dict[str, int] = {}  # the poll each run was first read in (a flood's runs come after)
        self._polls = 0

    def __len__(self) -> int:
        return self.records

    def take(
        self, items: list, hold: Callable[[str], bool] | None = None
    ) -> tuple[list, list[tuple[str, str, list[Record]]]]:
        """(the items to process now, the dead letters of runs whose backlog overflowed); the
        backlog of a run ``hold`` names waits whole while the run sends nothing new."""
        self._polls += 1
        out: list = []
        fresh: dict[str, int] = {}
        world: dict[str, int] = {}
        now = self.clock()
        for x in items:
            if not isinstance(x, (Record, RecordColumns)):
                out.append(x)  # layer names, checkpoint notes: cheap, never held back
            elif x.run in self._runs or x.run in self._flooded:
                self._push(x.run, x, now)  # behind what it sent before
            else:
                fresh[x.run] = fresh.get(x.run, 0) + _size(x)
                world.setdefault(x.run, _world(x))
                if self._seen.setdefault(x.run, self._polls) == self._polls and len(self._seen) > 1 << 16:
                    del self._seen[next(iter(self._seen))]  # bounded: the run seen first is forgotten
        if not self._runs and (len(fresh) <= 1 or sum(fresh.values()) <= self.pass_records):
            return items, []  # nothing to share: as read
        waiting = [run for run in self._runs if hold is None or self._heard[run] == now or not hold(run)]
        left, allow = self.pass_records, {}
        for first in sorted({self._seen.get(run, 0) for run in fresh}):  # runs seen earlier first
            demand = {run: n for run, n in fresh.items() if self._seen.get(run, 0) == first}
            share = fair_share(demand, max(left, 0))
            allow.update((run, min(n, max(share, world[run]))) for run, n in demand.items())
            left -= sum(allow[run] for run in demand)
        for x in items:
            if not isinstance(x, (Record, RecordColumns)) or x.run not in allow:
                continue
            n, k = allow[x.run], _size(x)
            if k <= n:
                out.append(x)
            else:  # past its share: the rest waits (a block is cut at the share)
                if n:
                    out.append(x.take(slice(0, n)))
                    x = x.take(slice(n, None))
                self._push(x.run, x, now)
            allow[x.run] = max(0, n - k)
        old = {run: self._counts[run] for run in waiting}
        share = fair_share(old, max(left, 0))
        for run in waiting:
            out += self._pop(run, max(share, _world(self._runs[run][0])))
        lost = self._overflow()
        self.ready = any(hold is None or self._heard[run] == now or not hold(run) for run in self._runs)
        return out, lost

    def _push(self, run: str, x: Record | RecordColumns, now: float) -> None:
        q = self._runs.pop(run, None) or deque()
        q.append(x)
        self._runs[run] = q
        self._heard.pop(run, None)
        self._heard[run] = now
        self._counts[run] = self._counts.get(run, 0) + _size(x)
        self.records += _size(x)

    def _pop(self, run: str, n: int) -> list:
        """Up to ``n`` records of ``run``'s backlog, oldest first."""
        q, out = self._runs[run], []
        while q and n > 0:
            x = q.popleft()
            if _size(x) > n:
                q.appendleft(x.take(slice(n, None)))
                x = x.take(slice(0, n))
            out.append(x)
            n -= _size(x)
            self._counts[run] -= _size(x)
            self.records -= _size(x)
        if not q:
            self._forget(run)
        return out

    def _forget(self, run: str) -> None:
        self._runs.pop(run, None)
        self._flooded.pop(run, None)
        self._heard.pop(run, None)
        self.records -= self._counts.pop(run, 0)

    def drop(self, run: str) -> list[Record]:
        """Forget ``run``'s backlog; its records (for the caller to dead-letter)."""
        recs = as_records(self._runs.get(run, ()))
        self._forget(run)
        return recs

    def _overflow(self) -> list[tuple[str, str, list[Record]]]:
        out = []
        while self.records > self.max_records:
            run = max(self._counts, key=self._counts.__getitem__)
            n = self._counts[run]
            why = (
                f"run {run!r} sent more than the service could judge while other runs waited: its {n} "
                f"record(s) waiting for their share are lost (detectors.run_backlog_records "
                f"{self.max_records} in all)"
            )
            out.append(("budget", why, self.drop(run)))
            self._flooded[run] = None  # what it sends next waits too, not ahead of the others
            if len(self._flooded) > self.max_records:
                del self._flooded[next(iter(self._flooded))]
        return out

    def snapshot(self) -> list:
        """The waiting records, JSON-safe: ``[[run, [record dict, ...]], ...]`` (committed offsets are past them)."""
        return [[run, [to_dict(r) for r in as_records(q)]] for run, q in self._runs.items()]

    def restore(self, state: list) -> None:
        self._runs, self._counts, self._heard, self.records = {}, {}, {}, 0
        now = self.clock()
        for run, recs in state:
            for r in map(from_dict, recs):
                self._push(run, r, now)
        self.ready = bool(self.records)
