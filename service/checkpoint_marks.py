"""Certified checkpoints: each checkpoint a run saved, marked clean, suspect or after-fault from its incidents.

:class:`CheckpointBook` takes the ranks' notes out of the stream, marks each once the service has
judged its step and again when a later incident began before it, and names the rollback target
(rules and bounds: docs/messages.md, "Certified checkpoints in the service").
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable

from sdcwatch.core.rank_notes import CheckpointMark, CheckpointNote
from sdcwatch.core.control import Decision
from sdcwatch.core.errors import RecordError
from sdcwatch.core.incident import Incident, IncidentEvent
from sdcwatch.service.control_policy import ControlPolicy
from sdcwatch.service.summary import StepSummary

__all__ = [
    "AFTER_FAULT_KINDS",
    "SUSPECT_KINDS",
    "MAX_PER_RUN",
    "MAX_INCIDENTS_PER_RUN",
    "MAX_EXPORTED",
    "SUMMARY_KEY",
    "incident_weight",
    "mark_of",
    "CheckpointBook",
    "CertifiedPolicy",
]

log = logging.getLogger("sdcwatch.service.checkpoint_marks")

#: Incident kinds of a fault that reaches the weights: a checkpoint saved after one is ``after-fault``.
AFTER_FAULT_KINDS = frozenset({"nonfinite", "checksum_mismatch", "sdc_suspected", "replica_divergence"})
#: Incident kinds that make the checkpoints after their onset ``suspect`` until they resolve.
SUSPECT_KINDS = frozenset({"silent_drift"})
#: Checkpoints kept a run (the oldest goes first).
MAX_PER_RUN = 256
#: Incidents a run keeps for marking (the oldest resolved one goes first).
MAX_INCIDENTS_PER_RUN = 256
#: Marked checkpoints a run shows on /metrics (newest first; its newest clean one besides).
MAX_EXPORTED = 8
#: Where a spatial stage puts a run's notes on a step summary (no detector has this name).
SUMMARY_KEY = "checkpoint_notes"


def incident_weight(kind: str, evidence: Any = None) -> str | None:
    """The marking an open incident gives the checkpoints after its onset (None: it does not count).
    A replica divergence seen only in canaries (no parameter fingerprint) computes wrongly without
    (yet) changing the weights: suspect."""
    if kind == "replica_divergence":
        metrics = evidence.get("metrics") if isinstance(evidence, dict) else None
        if isinstance(metrics, dict) and metrics and "param_fp" not in metrics:
            return "suspect"
        return "after-fault"
    if kind in AFTER_FAULT_KINDS:
        return "after-fault"
    if kind in SUSPECT_KINDS:
        return "suspect"
    return None


def mark_of(step: int, incidents: Iterable[tuple[str, str, int, int | None]]) -> tuple[str, tuple[str, ...]]:
    """(marking, ids of the incidents that made it) of a checkpoint saved at ``step``, from
    ``(id, weight, first_step, resolved_step)`` of the run's incidents.

    >>> mark_of(40, [("r:silent_drift:50", "suspect", 50, None)])
    ('clean', ())
    >>> mark_of(60, [("r:silent_drift:50", "suspect", 50, None)])
    ('suspect', ('r:silent_drift:50',))
    >>> mark_of(60, [("r:nonfinite:50", "after-fault", 50, 55)])
    ('clean', ())
    """
    worst, ids = "clean", []
    for iid, weight, first, resolved in incidents:
        if first <= step and (resolved is None or resolved > step):
            ids.append(iid)
            if weight == "after-fault" or worst == "clean":
                worst = weight
    return worst, tuple(ids)


@dataclass
class _Checkpoint:
    path: str
    mark: str | None = None  # None: its step not judged yet
    incidents: tuple[str, ...] = ()


class _Run:
    __slots__ = ("checkpoints", "incidents", "judged")

    def __init__(self) -> None:
        self.checkpoints: OrderedDict[int, _Checkpoint] = OrderedDict()  # by step, oldest first
        self.incidents: OrderedDict[str, tuple[str, int, int | None]] = OrderedDict()  # id -> weight, first, resolved
        self.judged = -1  # the last step the service judged


class CheckpointBook:
    """Per run, its checkpoints and their markings; the incidents that mark them."""

    def __init__(self, max_runs: int = 1000, *, forwards: bool = False, clock: Callable[[], float] = time.time) -> None:
        self.max_runs = max_runs
        self.forwards = forwards  # a spatial stage's: it puts the notes on the summaries instead of marking
        self.clock = clock
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        self._unsent: dict[str, list[CheckpointNote]] = {}  # spatial stage: notes for the next summary
        self._marks: list[CheckpointMark] = []  # markings not yet published
        self.noted = 0  # checkpoints noted
        self.refused = 0  # notes off a summary that did not check

    # -- input --------------------------------------------------------------------------------

    def take(self, items: Iterable[Any]) -> list:
        """Learn the notes among decoded items (and those a spatial stage put on step summaries);
        returns the other items."""
        out = []
        for x in items:
            if isinstance(x, CheckpointNote):
                self.note(x)
                continue
            if isinstance(x, StepSummary) and SUMMARY_KEY in x.observations:
                self._absorb(x.run, x.world, x.observations.pop(SUMMARY_KEY))
            out.append(x)
        return out

    def note(self, note: CheckpointNote) -> None:
        """A checkpoint saved (every rank may say so: one entry per run and step)."""
        if self.forwards:
            self._unsent.setdefault(note.run, []).append(note)
            return
        run = self._run(note.run)
        known = run.checkpoints.get(note.step)
        if known is not None:
            if not known.path and note.path:
                known.path = note.path
            return
        run.checkpoints[note.step] = _Checkpoint(note.path)
        self.noted += 1
        while len(run.checkpoints) > MAX_PER_RUN:
            run.checkpoints.popitem(last=False)
        if note.step <= run.judged:  # its step judged already (a note that came late): marked now
            self._remark(note.run, run, only=note.step)

    def _absorb(self, run: str, world: int, notes: Any) -> None:
        try:
            for step, path in notes:
                self.note(CheckpointNote(run, 0, max(int(world), 1), step, path))
        except (TypeError, ValueError, RecordError) as exc:
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning(
                    "checkpoint notes of run %r on a summary not taken (%d so far): %s", run[:80], self.refused, exc
                )

    def stamp(self, summaries: list[StepSummary]) -> list[StepSummary]:
        """A spatial stage's book: put each run's notes on its next summary."""
        for s in summaries:
            notes = self._unsent.pop(s.run, None) if not s.ended else None
            if notes:
                s.observations[SUMMARY_KEY] = [[n.step, n.path] for n in notes]
        return summaries

    def events(self, events: Iterable[IncidentEvent]) -> None:
        """Incident changes: the checkpoints of their runs are marked again."""
        touched: set[str] = set()
        for ev in events:
            inc = ev.incident
            weight = incident_weight(inc.kind, inc.evidence)
            run = self._runs.get(inc.run)
            if weight is None and (run is None or inc.id not in run.incidents):
                continue
            run = self._run(inc.run)
            if weight is None:  # escalated out of the kinds that count (cannot happen today): forgotten
                run.incidents.pop(inc.id, None)
            else:
                run.incidents[inc.id] = (weight, int(inc.first_step), inc.resolved_step)
                self._bound_incidents(run)
            touched.add(inc.run)
        for name in touched:
            self._remark(name, self._runs[name])

    def judged(self, run: str, step: int) -> None:
        """The service judged ``step`` of ``run``: checkpoints up to it are marked."""
        st = self._runs.get(run)
        if st is None or step <= st.judged:
            return
        st.judged = step
        if any(c.mark is None and s <= step for s, c in st.checkpoints.items()):
            self._remark(run, st)

    # -- marking ------------------------------------------------------------------------------

    def _remark(self, name: str, run: _Run, only: int | None = None) -> None:
        incidents = [(iid, *v) for iid, v in run.incidents.items()]
        for step, c in run.checkpoints.items():
            if step > run.judged or (only is not None and step != only):
                continue
            mark, ids = mark_of(step, incidents)
            if mark == c.mark and ids == c.incidents:
                continue
            was, c.mark, c.incidents = c.mark, mark, ids
            self._marks.append(
                CheckpointMark(name, step, c.path, mark, ids, _reason(mark, ids, was), was, self.clock())
            )

    def take_marks(self) -> list[CheckpointMark]:
        """The markings made since the last call (first ones and changes), for the anomalies topic."""
        marks, self._marks = self._marks, []
        return marks

    # -- reading ------------------------------------------------------------------------------

    def marks(self, run: str) -> list[CheckpointMark]:
        """``run``'s marked checkpoints, oldest first."""
        st = self._runs.get(run)
        if st is None:
            return []
        return [
            CheckpointMark(run, s, c.path, c.mark, c.incidents) for s, c in st.checkpoints.items() if c.mark is not None
        ]

    def runs(self) -> list[str]:
        """Runs with checkpoints noted."""
        return [r for r, st in self._runs.items() if st.checkpoints]

    def view(self, runs: Iterable[str]) -> list[CheckpointMark]:
        """What /metrics shows of ``runs``: each run's newest :data:`MAX_EXPORTED` marked checkpoints,
        and its newest clean one when older (newest first)."""
        out: list[CheckpointMark] = []
        for run in runs:
            marks = self.marks(run)[::-1]
            shown = marks[:MAX_EXPORTED]
            clean = next((m for m in marks if m.mark == "clean"), None)
            if clean is not None and clean not in shown:
                shown.append(clean)
            out += shown
        return out

    def rollback_target(self, run: str, onset: int | None) -> CheckpointMark | None:
        """The newest clean checkpoint of ``run`` at or before ``onset`` (None: there is none)."""
        best = None
        for m in self.marks(run):
            if m.mark == "clean" and (onset is None or m.step <= onset):
                best = m
        return best

    # -- state --------------------------------------------------------------------------------

    def _run(self, name: str) -> _Run:
        st = self._runs.get(name)
        if st is None:
            while len(self._runs) >= self.max_runs:
                self._runs.popitem(last=False)
            st = self._runs[name] = _Run()
        else:
            self._runs.move_to_end(name)
        return st

    @staticmethod
    def _bound_incidents(run: _Run) -> None:
        while len(run.incidents) > MAX_INCIDENTS_PER_RUN:
            old = next((i for i, v in run.incidents.items() if v[2] is not None), next(iter(run.incidents)))
            del run.incidents[old]

    def forget(self, run: str) -> None:
        self._runs.pop(run, None)
        self._unsent.pop(run, None)

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe: per run, its checkpoints, incidents that mark them, and the last step judged."""
        return {
            "runs": {
                name: {
                    "judged": st.judged,
                    "checkpoints": [[s, c.path, c.mark, list(c.incidents)] for s, c in st.checkpoints.items()],
                    "incidents": [[i, *v] for i, v in st.incidents.items()],
                }
                for name, st in self._runs.items()
            },
            "unsent": {run: [[n.step, n.path] for n in notes] for run, notes in self._unsent.items()},
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take back a :meth:`snapshot` (an older state without checkpoints: none)."""
        self._runs.clear()
        self._unsent.clear()
        for name, d in (state.get("runs") or {}).items():
            st = self._run(str(name))
            st.judged = int(d.get("judged", -1))
            for s, path, mark, ids in d.get("checkpoints", [])[-MAX_PER_RUN:]:
                st.checkpoints[int(s)] = _Checkpoint(str(path), mark if mark is None else str(mark), tuple(ids))
            for iid, weight, first, resolved in d.get("incidents", [])[-MAX_INCIDENTS_PER_RUN:]:
                st.incidents[str(iid)] = (str(weight), int(first), None if resolved is None else int(resolved))
        for run, notes in (state.get("unsent") or {}).items():
            self._absorb(str(run), 1, notes)


def _reason(mark: str, ids: tuple[str, ...], was: str | None) -> str:
    why = "no incident before it" if mark == "clean" else f"incident(s) {', '.join(ids)} began at or before it"
    return why + (f" (re-marked: was {was})" if was is not None else "")


@dataclass
class CertifiedPolicy(ControlPolicy):
    """A :class:`ControlPolicy` whose rollback decisions name the newest clean checkpoint at or
    before the incident's onset (``Decision.checkpoint``; its path, or ``step N`` without one)."""

    book: CheckpointBook | None = None

    @classmethod
    def around(cls, policy: ControlPolicy, book: CheckpointBook) -> "CertifiedPolicy":
        """``policy``'s rules, with ``book``'s checkpoints."""
        settings = {k: v for k, v in asdict(policy).items() if k != "book"}
        return cls(**settings, book=book)

    def decide(self, incident: Incident) -> Decision | None:
        decision = super().decide(incident)
        if decision is None or decision.action != "rollback" or self.book is None:
            return decision
        target = self.book.rollback_target(incident.run, decision.since_step)
        if target is None:
            return decision
        return replace(decision, checkpoint=target.path or f"step {target.step}")
