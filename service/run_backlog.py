"""RunBacklog: each poll's records shared between runs before the costly work (alignment, detectors),
so a flood's cost falls on its own run: a run takes at most its share of a pass while others wait,
and its excess waits here, in order, bounded (docs/service.md, "Run lifecycle").
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from sdcwatch.core.record import from_dict, to_dict
from sdcwatch.core.record_type import Record
from sdcwatch.service.alignment_state import size_of, world_of
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


class RunBacklog:
    """The records and column blocks of runs past their share, per run, in order.

    :meth:`take` gives a pass at most ``pass_records`` records: each run with records read or
    waiting gets its :func:`fair_share` of the pass (max-min: a run that needs less leaves the rest
    to the others; with keys on, of its key's share: ``key_of``); while the pass has room, runs
    short of one record a rank of their world (so whole steps move) get it, then the runs read first
    the rest they have. A poll of one run, or of no more than ``pass_records``, passes as it came. Past ``max_records`` waiting, the runs read last lose
    theirs first, the one with most waiting first among them (``budget`` dead letters that name
    it), and what such a run sends next waits behind the others' shares until its backlog drains.
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
        self.key_of: Callable[[str], str | None] | None = None  # the job key a run signs with (keys on)

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
                fresh[x.run] = fresh.get(x.run, 0) + size_of(x)
                world.setdefault(x.run, world_of(x))
                if self._seen.setdefault(x.run, self._polls) == self._polls and len(self._seen) > 1 << 16:
                    del self._seen[next(iter(self._seen))]  # bounded: the run seen first is forgotten
        if not self._runs and (len(fresh) <= 1 or sum(fresh.values()) <= self.pass_records):
            return items, []  # nothing to share: as read
        waiting = [run for run in self._runs if hold is None or self._heard[run] == now or not hold(run)]
        world.update((run, world_of(self._runs[run][0])) for run in waiting)
        allow = self._shares({**{run: self._counts[run] for run in waiting}, **fresh}, world)
        for x in items:
            if not isinstance(x, (Record, RecordColumns)) or x.run not in fresh:
                continue
            n, k = allow[x.run], size_of(x)
            if k <= n:
                out.append(x)
            else:  # past its share: the rest waits (a block is cut at the share)
                if n:
                    out.append(x.take(slice(0, n)))
                    x = x.take(slice(n, None))
                self._push(x.run, x, now)
            allow[x.run] = max(0, n - k)
        for run in waiting:
            out += self._pop(run, allow[run])
        lost = self._overflow()
        self.ready = any(hold is None or self._heard[run] == now or not hold(run) for run in self._runs)
        return out, lost

    def _shares(self, demand: dict[str, int], world: dict[str, int]) -> dict[str, int]:
        """Records each run may have this pass (see the class): the takers of a pass are the keys
        (all the runs a job key signs for share one fair share: another tenant's flood over many
        names is one taker), each unsigned run, and the unsigned runs first read in this poll
        together (a flood of new names is one more taker, not thousands); a taker's share is split
        fairly among its runs. Then, while the pass has room, a rank of its world to each run short
        of one, runs read first first, and the rest of what they have to the runs read first."""
        new = {run for run in demand if self._seen.get(run) == self._polls}
        key_of = self.key_of or (lambda run: None)
        takers: dict[object, dict[str, int]] = {}
        for run, n in demand.items():
            kid = key_of(run)
            taker = ("key", kid) if kid is not None else None if run in new else run
            takers.setdefault(taker, {})[run] = n
        share = fair_share({t: sum(runs.values()) for t, runs in takers.items()}, self.pass_records)
        allow: dict[str, int] = {}
        for runs in takers.values():
            split = fair_share(runs, min(sum(runs.values()), share))
            allow.update((run, min(n, split)) for run, n in runs.items())
        room = self.pass_records - sum(allow.values())
        order = sorted(demand, key=lambda r: self._seen.get(r, 0))
        for want in (lambda r: min(demand[r], world[r]), demand.__getitem__):
            for run in order:
                more = min(want(run) - allow[run], room)
                if more > 0:
                    allow[run] += more
                    room -= more
        return allow

    def _push(self, run: str, x: Record | RecordColumns, now: float) -> None:
        q = self._runs.pop(run, None) or deque()
        q.append(x)
        self._runs[run] = q
        self._heard.pop(run, None)
        self._heard[run] = now
        self._counts[run] = self._counts.get(run, 0) + size_of(x)
        self.records += size_of(x)

    def _pop(self, run: str, n: int) -> list:
        """Up to ``n`` records of ``run``'s backlog, oldest first."""
        q, out = self._runs[run], []
        while q and n > 0:
            x = q.popleft()
            if size_of(x) > n:
                q.appendleft(x.take(slice(n, None)))
                x = x.take(slice(0, n))
            out.append(x)
            n -= size_of(x)
            self._counts[run] -= size_of(x)
            self.records -= size_of(x)
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
        last_read_first = sorted(self._counts, key=lambda r: (self._seen.get(r, 0), self._counts[r]), reverse=True)
        for run in last_read_first:
            if self.records <= self.max_records:
                break
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
