"""The layer names each run's ranks sent, and the findings named with them before they become incidents
(one copy of each distinct list per run; split into stages, carried on the step summaries and sent
again over ``resend`` seconds: docs/messages.md, "Layer names in the service"); and each rank's GPU,
which the host ledger credits with its host, kept and carried the same way.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from sdcwatch.core.errors import RecordError
from sdcwatch.core.rank_notes import LayerNames, RankDevice
from sdcwatch.core.validate import check_number
from sdcwatch.core.vocabulary import NOUNS, family_of
from sdcwatch.service.summary import StepSummary

__all__ = ["LayerNameBook", "MAX_TABLES_PER_RUN", "MAX_RANK_ENTRIES", "MAX_RESEND_RANKS"]

log = logging.getLogger("sdcwatch.detectors")

#: Distinct name lists one run may hold (a pipeline stage, or a virtual stage, each has its own).
MAX_TABLES_PER_RUN = 64
#: Ranks whose list the book remembers, over all runs (a 100,000-rank job fits five times).
MAX_RANK_ENTRIES = 1 << 19
#: Bytes of names kept over all runs.
MAX_BYTES = 64 << 20
#: Most ranks whose lists one summary sends again.
MAX_RESEND_RANKS = 4096


def _size(names: dict[str, tuple[str, ...]]) -> int:
    return sum(len(n) + 8 for lst in names.values() for n in lst) + 64


@dataclass(slots=True)
class _Run:
    world: int
    tables: dict[int, dict[str, tuple[str, ...]]] = field(default_factory=dict)  # digest -> {family: names}
    by_rank: dict[int, int] = field(default_factory=dict)  # rank -> digest of its list
    gpus: list[str] = field(default_factory=list)  # rank -> its GPU ("": not said); empty until a rank says one
    unsent: set[int] = field(default_factory=set)  # ranks whose list the temporal stage has not been sent
    cursor: int = 0  # the next rank whose list is sent again
    credit: float = 0.0  # ranks owed to the cycle's pace (< 0: sent ahead; at most one cycle)
    stamped: float | None = None  # when a summary of the run was last stamped


class LayerNameBook:
    """Per run, each rank's layer names; names the modules of findings."""

    def __init__(
        self,
        max_runs: int = 1000,
        *,
        max_bytes: int = MAX_BYTES,
        resend: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # resend: a spatial stage's book puts the lists on the summaries, each rank's again within resend seconds
        if resend is not None:
            check_number("detectors.names_resend_s", resend, 0, lo_open=True)
        self.max_runs = max_runs
        self.max_bytes = max_bytes
        self.resend = resend
        self.forwards = resend is not None  # a spatial stage's: it sends what it learns on with the summaries
        self.clock = clock
        self._runs: OrderedDict[str, _Run] = OrderedDict()  # least recently named first
        self.bytes = 0
        self.ranks = 0
        self.refused = 0  # lists refused at a bound

    def take(self, items: Iterable[Any]) -> list:
        """Learn the :class:`LayerNames` and :class:`RankDevice` among decoded items and on step
        summaries; returns the other items."""
        out = []
        for x in items:
            if isinstance(x, LayerNames):
                self.learn(x)
                continue
            if isinstance(x, RankDevice):
                self.place(x.run, x.rank, x.world, x.gpu)
                continue
            if isinstance(x, StepSummary) and x.names is not None:
                self.absorb(x.run, x.names)
            out.append(x)
        return out

    def stamp(self, summaries: list[StepSummary]) -> list[StepSummary]:
        """Put on a run's summary the lists its ranks took since the last one, and the next ranks' once more."""
        now = self.clock()
        for s in summaries:
            st = self._runs.get(s.run)
            if st is None or s.ended or not self.forwards:
                continue
            ranks = st.unsent.union(self._again(st, now))
            if ranks:
                s.names, st.unsent = self._lists(st, sorted(ranks)), set()
        return summaries

    def _again(self, st: _Run, now: float) -> list[int]:
        """The ranks whose lists go again on this summary: the next ``world x elapsed / resend`` from the
        run's cursor that sent names, rounded up and at most :data:`MAX_RESEND_RANKS` (what the
        rounding and the cap hold back is owed to the next summaries, up to one cycle)."""
        if st.stamped is None:  # the run's first summary: its lists are all new
            st.stamped = now
            return []
        due = st.credit + st.world * max(now - st.stamped, 0.0) / self.resend
        st.stamped = now
        n = min(math.ceil(due), MAX_RESEND_RANKS, st.world)
        st.credit = min(due - n, float(st.world))  # what the cap held back goes on the next ones
        if n <= 0:
            return []
        start, st.cursor = st.cursor, (st.cursor + n) % st.world
        return [r % st.world for r in range(start, start + n) if _known(st, r % st.world)]

    def absorb(self, run: str, lists: Any) -> None:
        """Take ``run``'s lists as :meth:`snapshot` keeps them, from the state or a summary, each checked
        as a names message is and its digest computed afresh; what does not check is left out."""
        try:
            world = int(lists["world"])
            for digest, names in lists["tables"].items():
                msg = self._held(run, digest, names) or LayerNames.build(run, 0, world, 0, names)
                for r in lists["ranks"].get(digest, ()):
                    if 0 <= int(r) < world:
                        self._bind(run, int(r), world, msg.digest, msg.names)
            for r, gpu in dict(lists.get("gpus") or {}).items():
                if 0 <= int(r) < world:
                    said = RankDevice(run, int(r), world, 0, gpu)  # checked as a rank's message is
                    self.place(run, said.rank, world, said.gpu)
        except (KeyError, TypeError, ValueError, AttributeError, RecordError) as exc:
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning("layer names of run %r not taken (%d so far): %s", str(run)[:80], self.refused, exc)

    def _held(self, run: str, digest: Any, names: Any) -> LayerNames | None:
        """The list held under ``digest`` when ``names`` is that very list (sent again), else None."""
        st = self._runs.get(run)
        held = st.tables.get(int(digest, 16)) if st is not None and isinstance(digest, str) else None
        if held is None or not isinstance(names, dict) or names != {k: list(v) for k, v in held.items()}:
            return None
        return LayerNames(run, 0, st.world, 0, held, int(digest, 16), b"")

    def learn(self, msg: LayerNames) -> bool:
        """Remember ``msg``'s lists for its rank; False when a bound refused them."""
        return self._bind(msg.run, msg.rank, msg.world, msg.digest, msg.names)

    def place(self, name: str, rank: int, world: int, gpu: str) -> bool:
        """Remember that ``rank`` of run ``name`` runs on ``gpu``; False when a bound refused it
        (a run's table of GPUs costs 8 bytes a rank and its labels of the ``max_bytes`` shared)."""
        run = self._run(name, world)
        if not run.gpus:
            if not self._room(name, 8 * world, 0):
                return self._refuse(name, rank, f"past {self.max_bytes} bytes")
            run.gpus = [""] * world
            self.bytes += 8 * world
        old = run.gpus[rank]
        if old != gpu:
            if not self._room(name, len(gpu) - len(old), 0):
                return self._refuse(name, rank, f"past {self.max_bytes} bytes")
            run.gpus[rank] = gpu
            self.bytes += len(gpu) - len(old)
            if self.forwards:
                run.unsent.add(rank)
        return True

    def gpus_of(self, run: str) -> list[str]:
        """Per rank of ``run``, its GPU ("": not said; empty: no rank said one)."""
        st = self._runs.get(run)
        return st.gpus if st is not None else []

    def _run(self, name: str, world: int) -> _Run:
        """Run ``name``'s entry, made (past ``max_runs``, the least recently named run goes) or the
        most recently named now, with ``world`` ranks."""
        run = self._runs.get(name)
        if run is None:
            while len(self._runs) >= self.max_runs:
                self.forget(next(iter(self._runs)))
            run = self._runs[name] = _Run(world)
        else:
            self._runs.move_to_end(name)
        if world != run.world:  # a new world size: ranks past it are gone
            self._rebind(run, {r: d for r, d in run.by_rank.items() if r < world})
            if run.gpus:
                self.bytes += 8 * (world - run.world) - sum(len(g) for g in run.gpus[world:])
                run.gpus = run.gpus[:world] + [""] * (world - len(run.gpus))
            run.unsent = {r for r in run.unsent if r < world}
            run.world = world
        return run

    def _bind(self, name: str, rank: int, world: int, digest: int, names: dict[str, tuple[str, ...]]) -> bool:
        """Point ``rank`` of run ``name`` at the list ``names`` (whose digest was computed from it)."""
        run = self._run(name, world)
        old = run.by_rank.get(rank)
        if old == digest:
            return True
        if digest not in run.tables:
            size = _size(names)
            if len(run.tables) >= MAX_TABLES_PER_RUN or not self._room(name, size, 0):
                return self._refuse(name, rank, f"past {MAX_TABLES_PER_RUN} lists a run or {self.max_bytes} bytes")
            run.tables[digest] = names
            self.bytes += size
        if old is None and not self._room(name, 0, 1):
            return self._refuse(name, rank, f"past {MAX_RANK_ENTRIES} ranks over all runs")
        run.by_rank[rank] = digest
        if self.forwards:
            run.unsent.add(rank)
        if old is None:
            self.ranks += 1
        elif old not in run.by_rank.values():  # the rank's list changed (it grew): the old one may go
            self.bytes -= _size(run.tables.pop(old))
        return True

    def _room(self, keep: str, size: int, ranks: int) -> bool:
        """Make room for ``size`` bytes and ``ranks`` ranks by forgetting the least recently named other runs."""
        while self.bytes + size > self.max_bytes or self.ranks + ranks > MAX_RANK_ENTRIES:
            other = next((r for r in self._runs if r != keep), None)
            if other is None:
                return False
            self.forget(other)
        return True

    def _refuse(self, run: str, rank: int, why: str) -> bool:
        self.refused += 1
        if self.refused == 1:
            log.warning("layer names of run %r rank %d not kept: %s", run[:80], rank, why)
        return False

    def _rebind(self, run: _Run, by_rank: dict[int, int]) -> None:
        """Point the run's ranks at their lists; drop lists no rank points at."""
        self.ranks += len(by_rank) - len(run.by_rank)
        run.by_rank = by_rank
        used = set(by_rank.values())
        for digest in [d for d in run.tables if d not in used]:
            self.bytes -= _size(run.tables.pop(digest))

    def forget(self, run: str) -> None:
        """Drop ``run``'s names (the run was evicted)."""
        st = self._runs.pop(run, None)
        if st is not None:
            self.ranks -= len(st.by_rank)
            self.bytes -= sum(_size(t) for t in st.tables.values()) + 8 * len(st.gpus) + sum(map(len, st.gpus))

    def names_of(self, run: str, rank: int | None) -> dict[str, tuple[str, ...]] | None:
        """The lists ``rank`` of ``run`` sent; with no rank, the run's only list (None: unknown)."""
        st = self._runs.get(run)
        if st is None:
            return None
        if rank is not None:
            digest = st.by_rank.get(rank)
            return None if digest is None else st.tables[digest]
        return next(iter(st.tables.values())) if len(st.tables) == 1 else None

    def enrich(self, findings: list, run: str) -> list:
        """Give each finding of ``run`` that names a place, and its listed hits, its module's name (in place)."""
        if run not in self._runs:
            return findings
        for f in findings:
            if not f.layer_name and (f.layer is not None or f.metric == "act_max"):
                module = f.evidence.get("act_max_module") if f.metric == "act_max" else None
                named = self._module(run, f.ranks[0] if f.ranks else None, f.metric, f.layer, module)
                if named is not None:
                    f.name_module(*named)
            self._name_hits(f.evidence.get("hits"), run)
        return findings

    def _module(self, run: str, rank: int | None, metric: str, layer: Any, module: Any) -> tuple[str, str] | None:
        """``(name, noun)`` of the module a place on ``rank`` is in, from that rank's own lists (None: not
        known); an ``act_max`` names its leaf module (``module``) when the rank sent them."""
        names = self.names_of(run, rank)
        if names is None:
            return None
        if metric == "act_max" and isinstance(module, int):
            leaves = names.get("modules", ())
            if 0 <= module < len(leaves) and leaves[module]:
                return leaves[module], "layer"
        fam = family_of(metric)
        if fam is None or not isinstance(layer, int):
            return None
        lst = names.get(fam, ())
        return (lst[layer], NOUNS.get(fam, "index")) if 0 <= layer < len(lst) and lst[layer] else None

    def _name_hits(self, hits: Any, run: str) -> None:
        """Each listed hit (``{rank, metric, layer[, module]}``) gets its module's name from its rank's list."""
        for h in hits if isinstance(hits, list) else ():
            if not isinstance(h, dict) or "layer_name" in h or not isinstance(h.get("rank"), int):
                continue
            named = self._module(run, h["rank"], str(h.get("metric")), h.get("layer"), h.get("module"))
            if named is not None:
                h["layer_name"] = named[0]

    @staticmethod
    def _lists(st: _Run, ranks: Iterable[int]) -> dict[str, Any]:
        """JSON-safe ``{world, tables, ranks[, gpus]}``: the lists of ``ranks`` by digest, which point
        at each, and their GPUs (``{rank: gpu}``, when any said one)."""
        by: dict[str, list[int]] = {}
        gpus: dict[str, str] = {}
        for r in ranks:
            if r in st.by_rank:
                by.setdefault(f"{st.by_rank[r]:016x}", []).append(r)
            if st.gpus and st.gpus[r]:
                gpus[str(r)] = st.gpus[r]
        tables = {d: {k: list(v) for k, v in st.tables[int(d, 16)].items()} for d in by}
        return {"world": st.world, "tables": tables, "ranks": by, **({"gpus": gpus} if gpus else {})}

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe: per run, its world, its lists by digest, which ranks point at each, their GPUs."""
        return {"runs": {name: self._lists(st, _ranks(st)) for name, st in self._runs.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        """Take back a :meth:`snapshot`; what breaks a bound or does not parse is left out."""
        self._runs.clear()
        self.bytes = self.ranks = 0
        for name, st in (state.get("runs") or {}).items():
            self.absorb(str(name), st)


def _known(st: _Run, rank: int) -> bool:
    """Whether ``rank`` sent its names or its GPU."""
    return rank in st.by_rank or bool(st.gpus and st.gpus[rank])


def _ranks(st: _Run) -> list[int]:
    """The ranks of ``st`` that sent their names (in the order they did), then those that sent only their GPU."""
    return [*st.by_rank, *(r for r, g in enumerate(st.gpus) if g and r not in st.by_rank)]
