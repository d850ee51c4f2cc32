"""Run lifecycle in the service: which runs are live, finished (every rank sent its end-of-run
marker) or idle, when each is closed and forgotten, and when one starts afresh (docs/service.md,
"Run lifecycle"). Times are the service's wall clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sdcwatch.core.record_type import Record
from sdcwatch.core.validate import check_positive
from sdcwatch.core.vocabulary import RUN_END

__all__ = ["RunLifecycle"]


@dataclass
class _Life:
    last_input: float  # service wall time of the run's last record (or summary)
    world: int = 0  # world size the markers were sent for
    ended: dict[int, float] = field(default_factory=dict)  # rank -> time field of its marker
    ended_step: dict[int, int] = field(default_factory=dict)  # rank -> the step its marker names
    end_step: int = -1  # highest step named by a marker
    finished_at: float | None = None  # service wall time the last marker arrived
    closed: bool = False  # open steps judged and incidents resolved after the run finished


class RunLifecycle:
    """Tracks every run's input and end markers; says which runs to close and which to evict.
    ``close_grace``: the longest wait after the last marker for the run's open steps (the aligner's
    step timeout) before it is closed anyway."""

    def __init__(
        self,
        end_expiry: float = 300.0,
        idle_expiry: float = 6 * 3600.0,
        *,
        close_grace: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_positive("runs", end_expiry=end_expiry, idle_expiry=idle_expiry, close_grace=close_grace)
        self.end_expiry = float(end_expiry)
        self.idle_expiry = float(idle_expiry)
        self.close_grace = float(close_grace)
        self.clock = clock
        self._runs: dict[str, _Life] = {}
        self.finished_total = 0  # runs that finished with every rank's marker
        self.evicted_total: dict[str, int] = {"finished": 0, "idle": 0}

    # -- input --------------------------------------------------------------------------------

    def sort(self, items: list) -> tuple[list, list[Record], set[str], set[str]]:
        """Split records and wire-v2 column blocks into (telemetry, end markers, runs started again,
        runs not known yet), and note the input time of the known runs.

        A run is started again when one of its ranks sends telemetry newer than its marker after the
        run finished (the caller evicts the old run first); new runs are the caller's to admit and
        report with :meth:`arrived`. A block carrying end markers, or of a run with ranks that ended,
        is taken as records (rare); any other counts by its run only and is returned as it is.
        """
        blocks = [x for x in items if hasattr(x, "schema")]
        records = [x for x in items if not hasattr(x, "schema")] if blocks else items
        kept = []
        for b in blocks:
            if RUN_END in b.schema.scalars or self.ended_ranks(b.run):
                records += b.to_records()
            else:
                kept.append(b)
        now = self.clock()
        runs = self._runs
        # the hot path of ingest: comprehensions over every record, a loop only over the ranks of
        # runs that have sent markers
        markers = [rec for rec in records if RUN_END in rec.scalars]
        data = [rec for rec in records if RUN_END not in rec.scalars] if markers else records
        seen = {rec.run for rec in records}.union(b.run for b in kept)
        restarted: set[str] = set()
        watched = {run for run in seen if run in runs and runs[run].ended}
        for rec in data if watched else ():
            if rec.run in watched:
                life = runs[rec.run]
                t = life.ended.get(rec.rank)
                if t is not None and rec.time > t:  # newer than the rank's marker: the rank is back
                    if life.finished_at is not None:
                        restarted.add(rec.run)
                    else:
                        del life.ended[rec.rank]
                        life.ended_step.pop(rec.rank, None)
        new: set[str] = set()
        for run in seen - restarted:  # the caller evicts a restarted run, then reports its input
            life = runs.get(run)
            if life is None:
                new.add(run)
            else:
                life.last_input = now
        return data + kept, markers, restarted, new

    def arrived(self, runs: Iterable[str]) -> None:
        """Input for ``runs`` that carries no markers (the temporal stage's step summaries)."""
        now = self.clock()
        for run in runs:
            self._runs.setdefault(run, _Life(now)).last_input = now

    def take_summaries(self, summaries: list) -> list:
        """The temporal stage's input: note it, finish the runs whose end it says; the steps to judge."""
        self.arrived({s.run for s in summaries})
        for s in summaries:
            if s.ended:
                self.finish(s.run)
        return [s for s in summaries if not s.ended]

    def end(self, marker: Record) -> bool:
        """Take one rank's marker; True when it completes the run (every rank of its world ended)."""
        life = self._runs.get(marker.run)
        if life is None or life.finished_at is not None:
            return False  # a run never admitted, or a redelivered marker of a finished run
        if marker.world != life.world:  # the world changed (elastic): only markers of the new world count
            life.world, life.ended, life.ended_step = marker.world, {}, {}
        life.ended[marker.rank] = marker.time
        life.ended_step[marker.rank] = marker.step
        life.end_step = max(life.end_step, marker.step)
        if len(life.ended) < life.world:
            return False
        life.finished_at = self.clock()
        self.finished_total += 1
        return True

    def finish(self, run: str) -> bool:
        """The run ended as a whole (the temporal stage hears it from the spatial stage's summary)."""
        life = self._runs.setdefault(run, _Life(self.clock()))
        if life.finished_at is not None:
            return False
        life.finished_at = self.clock()
        self.finished_total += 1
        return True

    # -- decisions ----------------------------------------------------------------------------

    def to_close(self, open_steps: Callable[[str], int]) -> list[str]:
        """Finished runs to close now: their open steps are done, or ``close_grace`` has passed."""
        now = self.clock()
        return [
            run
            for run, life in self._runs.items()
            if life.finished_at is not None
            and not life.closed
            and (open_steps(run) == 0 or now - life.finished_at >= self.close_grace)
        ]

    def closed(self, run: str) -> None:
        life = self._runs.get(run)
        if life is not None:
            life.closed = True

    def to_evict(self) -> list[tuple[str, str]]:
        """(run, why) of the runs to evict now: ``finished`` past ``end_expiry``, ``idle`` past ``idle_expiry``."""
        now = self.clock()
        out = []
        for run, life in self._runs.items():
            if life.finished_at is not None:
                if life.closed and now - life.finished_at >= self.end_expiry:
                    out.append((run, "finished"))
            elif now - life.last_input >= self.idle_expiry:
                out.append((run, "idle"))
        return out

    def forget(self, run: str, why: str | None = None) -> None:
        if self._runs.pop(run, None) is not None and why in self.evicted_total:
            self.evicted_total[why] += 1

    # -- reading ------------------------------------------------------------------------------

    def finished(self, run: str) -> bool:
        life = self._runs.get(run)
        return life is not None and life.finished_at is not None

    def departed(self, run: str, step: int, world: int) -> np.ndarray | None:
        """(world,) mask of the ranks whose end-of-run marker names a step before ``step`` (a replica
        that left the job while the others go on); None when there is none."""
        life = self._runs.get(run)
        if life is None or not life.ended_step:
            return None
        gone = [r for r, s in life.ended_step.items() if s < step and r < world]
        if not gone:
            return None
        mask = np.zeros(world, bool)
        mask[gone] = True
        return mask

    def ended_ranks(self, run: str) -> int:
        life = self._runs.get(run)
        return 0 if life is None else len(life.ended)

    def __contains__(self, run: str) -> bool:
        return run in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    # -- state --------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return {
            "runs": {
                run: {
                    "world": life.world,
                    "ended": [[r, t] for r, t in life.ended.items()],
                    "ended_steps": [[r, s] for r, s in life.ended_step.items()],
                    "end_step": life.end_step,
                    "finished": life.finished_at is not None,
                    "closed": life.closed,
                }
                for run, life in self._runs.items()
            },
            "finished_total": self.finished_total,
            "evicted_total": dict(self.evicted_total),
        }

    def restore(self, state: dict[str, Any], runs: Iterable[str] = ()) -> None:
        """Take back a :meth:`snapshot` (``runs``: those the pipeline holds); every clock starts again now."""
        now = self.clock()
        self._runs = {}
        for run, d in state.get("runs", {}).items():
            self._runs[run] = _Life(
                now,
                world=int(d["world"]),
                ended={int(r): float(t) for r, t in d["ended"]},
                ended_step={int(r): int(s) for r, s in d.get("ended_steps", ())},
                end_step=int(d["end_step"]),
                finished_at=now if d["finished"] else None,
                closed=bool(d["closed"]),
            )
        for run in runs:
            self._runs.setdefault(run, _Life(now))
        self.finished_total = int(state.get("finished_total", 0))
        self.evicted_total.update(
            {k: int(v) for k, v in state.get("evicted_total", {}).items() if k in self.evicted_total}
        )
