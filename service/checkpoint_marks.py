"""Certified checkpoints: each checkpoint a run saved, marked clean, suspect or after-fault from its
incidents once its step is judged, again when a later incident began before it, and the rollback
target (rules and bounds: docs/messages.md, "Certified checkpoints in the service"). Two paths noted
for one step certify neither; notes of runs the service does not watch never push out those it does.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable

from sdcwatch.core.rank_notes import CheckpointMark, CheckpointNote
from sdcwatch.core.control import Decision
from sdcwatch.core.errors import RecordError
from sdcwatch.core.incident import Incident, IncidentEvent
from sdcwatch.core.kinds import GUARD_KINDS, SPIKE_KINDS
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
    "marking",
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
    """The marking an open incident gives the checkpoints after its onset (None: it does not count); a
    replica divergence seen only in canaries (no parameter fingerprint) has not changed the weights yet."""
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


def marking(
    step: int, incidents: Iterable[tuple[str, str, int, int | None, int, str]], guarded: dict[int, str] | None = None
) -> tuple[str, tuple[str, ...], tuple[dict[str, Any], ...]]:
    """(marking, ids of the incidents that made it, the evidence it rests on) of a checkpoint saved at
    ``step``, from ``(id, weight, first, resolved, last, reach)`` of the run's incidents and the steps at
    which the job's guard kept the weights clean (``guarded``: step -> skip, rerun or rollback): the
    worst weight of the incidents open at ``step`` (begun at or before it, not resolved by then). A
    fault the guard skipped or rolled back, or whose measured ``reach`` stayed within the checks'
    bounds (and no spike began after it), does not count; the evidence says so.

    >>> marking(60, [("r:silent_drift:50", "suspect", 50, None, 50, "")])[:2]
    ('suspect', ('r:silent_drift:50',))
    >>> marking(60, [("r:nonfinite:50", "after-fault", 50, 55, 55, "")])[:2]
    ('clean', ())
    >>> marking(60, [("r:nonfinite:50", "after-fault", 50, None, 50, "")], {50: "skip"})[:2]
    ('clean', ())
    >>> marking(60, [("r:nonfinite:50", "after-fault", 50, None, 50, "")], {})
    ('after-fault', ('r:nonfinite:50',), ({'incident': 'r:nonfinite:50', 'effect': 'after-fault', \
'why': 'began at step 50 and had not resolved'},))
    """
    guarded = guarded or {}
    incidents = list(incidents)
    spikes = [first for _, weight, first, *_ in incidents if weight == "spike"]
    ids, weights, evidence = [], set(), []
    for iid, weight, first, resolved, last, reach in incidents:
        if weight not in ("after-fault", "suspect") or first > step or (resolved is not None and resolved <= step):
            continue
        why = _guarded_from(step, first, last, guarded)
        if why is None and reach and not any(first <= s <= step for s in spikes):
            why = reach
        if why is None:
            ids.append(iid)
            weights.add(weight)
        open_ = f"began at step {first} and had not " + ("resolved" if weight == "after-fault" else "cleared")
        evidence.append({"incident": iid, "effect": "none" if why else weight, "why": why or open_})
    worst = "after-fault" if "after-fault" in weights else "suspect" if weights else "clean"
    return worst, tuple(ids), tuple(evidence)


def _guarded_from(step: int, first: int, last: int, guarded: dict[int, str]) -> str | None:
    """Why the job's guard kept the weights clean of a fault seen from ``first`` to ``last`` (None: it did not)."""
    acts = {guarded.get(first), guarded.get(last)}
    if acts <= {"skip", "rerun"}:
        what = "skipped the update of" if "rerun" not in acts else "reran (a transient fault: the clean rerun used)"
        at = f"step {first}" if first == last else f"steps {first} and {last}"
        return f"the guard {what} {at}: the weights never took the fault"
    back = [s for s, a in guarded.items() if a == "rollback" and last <= s < step]
    if back:
        return f"the guard rolled back at step {back[-1]}, after the fault's last step {last}: the weights restored"
    return None


def _keeps_weights_clean(inc: Incident) -> bool:
    """Whether the guard's action behind a guard incident left the weights clean: a skipped update, a
    rollback, or a rerun whose verdict was transient (its clean result used)."""
    action = inc.evidence.get("action")
    return action in ("skip", "rollback") or (action == "rerun" and inc.evidence.get("verdict") == "transient")


def _reach(inc: Incident) -> str:
    """Why a finite checksum mismatch did not reach the weights measurably (no related non-finite value,
    spike, drift or divergence); "" for every other incident."""
    if inc.kind != "checksum_mismatch" or not math.isfinite(inc.score):
        return ""
    related = {r.get("kind") for r in inc.evidence.get("related", ()) if isinstance(r, dict)}
    if related & (AFTER_FAULT_KINDS | SUSPECT_KINDS | SPIKE_KINDS):
        return ""
    return (
        f"a finite flip ({inc.score:.3g} x its product's rounding bound at step {inc.first_step}) whose effect "
        "stayed within the non-finite, spike, drift and replica checks' bounds"
    )


@dataclass
class _Checkpoint:
    path: str
    mark: str | None = None  # None: its step not judged yet
    incidents: tuple[str, ...] = ()
    evidence: tuple[dict[str, Any], ...] = ()
    disputed: bool = False  # two paths were noted for its step: neither is certified


@dataclass(slots=True)
class _Run:
    checkpoints: OrderedDict[int, _Checkpoint] = field(default_factory=OrderedDict)  # by step, oldest first
    # id -> weight, first, resolved, last step, reach (why a fault's effect stayed within bounds, or "")
    incidents: OrderedDict[str, tuple[str, int, int | None, int, str]] = field(default_factory=OrderedDict)
    # step -> the guard's action that kept the weights clean
    guarded: OrderedDict[int, str] = field(default_factory=OrderedDict)
    judged: int = -1  # the last step the service judged


class CheckpointBook:
    """Per run, its checkpoints and their markings; the incidents that mark them.

    At most ``max_runs`` runs: past it, the least recently noted run that ``holds`` (the pipeline's
    runs) does not claim goes first, so notes for runs nobody watches never push out a watched one.
    """

    def __init__(
        self,
        max_runs: int = 1000,
        *,
        forwards: bool = False,
        clock: Callable[[], float] = time.time,
        holds: Callable[[str], bool] | None = None,
    ) -> None:
        self.max_runs = max_runs
        self.forwards = forwards  # a spatial stage's: it puts the notes on the summaries instead of marking
        self.clock = clock
        self.holds = holds
        self.disputed = 0  # checkpoints two paths were noted for
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        self._unsent: dict[str, list[CheckpointNote]] = {}  # spatial stage: notes for the next summary
        self._marks: list[CheckpointMark] = []  # markings not yet published
        self.refused = 0  # notes off a summary that did not check

    # -- input --------------------------------------------------------------------------------

    def take(self, items: Iterable[Any]) -> list:
        """Learn the notes among decoded items and on step summaries; returns the other items."""
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
            if note.run not in self._unsent:
                self._make_room(self._unsent)
            notes = self._unsent.setdefault(note.run, [])
            notes.append(note)
            del notes[:-MAX_PER_RUN]
            return
        run = self._run(note.run)
        known = run.checkpoints.get(note.step)
        if known is not None:
            if known.disputed or not note.path or note.path == known.path:
                return
            if known.path:  # another path for the same step: which one the job saved is not known
                known.path, known.disputed = "", True
                self.disputed += 1
                log.warning(
                    "run %r: two paths noted for the checkpoint of step %d; neither is certified (%r)",
                    note.run[:80],
                    note.step,
                    note.path[:200],
                )
                if note.step <= run.judged:  # published with a path: published again without one
                    known.mark = None
                    self._remark(note.run, run, only=note.step)
            else:
                known.path = note.path
            return
        run.checkpoints[note.step] = _Checkpoint(note.path)
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
            if inc.kind in GUARD_KINDS:
                if _keeps_weights_clean(inc):
                    guarded = self._run(inc.run).guarded
                    guarded[int(inc.last_step)] = str(inc.evidence["action"])
                    while len(guarded) > MAX_INCIDENTS_PER_RUN:
                        guarded.popitem(last=False)
                    touched.add(inc.run)
                continue
            weight = "spike" if inc.kind in SPIKE_KINDS else incident_weight(inc.kind, inc.evidence)
            if weight is None:  # an escalation raises the severity: it never leaves the kinds that count
                continue
            run = self._run(inc.run)
            run.incidents[inc.id] = (weight, int(inc.first_step), inc.resolved_step, int(inc.last_step), _reach(inc))
            while len(run.incidents) > MAX_INCIDENTS_PER_RUN:  # the oldest resolved one goes first
                resolved = (i for i, v in run.incidents.items() if v[2] is not None)
                del run.incidents[next(resolved, next(iter(run.incidents)))]
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
            mark, ids, evidence = marking(step, incidents, run.guarded)
            if mark == c.mark and ids == c.incidents and evidence == c.evidence:
                continue
            was, c.mark, c.incidents, c.evidence = c.mark, mark, ids, evidence
            reason = _reason(mark, ids, was, evidence)
            self._marks.append(CheckpointMark(name, step, c.path, mark, ids, reason, was, self.clock(), evidence))

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
            CheckpointMark(run, s, c.path, c.mark, c.incidents, evidence=c.evidence)
            for s, c in st.checkpoints.items()
            if c.mark is not None
        ]

    def view(self, runs: Iterable[str]) -> list[CheckpointMark]:
        """Each run's newest :data:`MAX_EXPORTED` marked checkpoints and its newest clean one (newest first)."""
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
        clean = (m for m in reversed(self.marks(run)) if m.mark == "clean" and (onset is None or m.step <= onset))
        return next(clean, None)

    # -- state --------------------------------------------------------------------------------

    def _make_room(self, runs: dict) -> None:
        """Forget runs of ``runs`` (oldest first) until one more fits: first those ``holds`` does not claim."""
        while len(runs) >= self.max_runs:
            free = (r for r in runs if self.holds is None or not self.holds(r))
            runs.pop(next(free, next(iter(runs))))

    def _run(self, name: str) -> _Run:
        st = self._runs.get(name)
        if st is None:
            self._make_room(self._runs)
            st = self._runs[name] = _Run()
        else:
            self._runs.move_to_end(name)
        return st

    def forget(self, run: str) -> None:
        self._runs.pop(run, None)
        self._unsent.pop(run, None)

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe: per run, its checkpoints (and which are disputed), their incidents, the last step judged."""
        return {
            "runs": {
                name: {
                    "judged": st.judged,
                    "checkpoints": [
                        [s, c.path, c.mark, list(c.incidents), list(c.evidence)] for s, c in st.checkpoints.items()
                    ],
                    "incidents": [[i, *v] for i, v in st.incidents.items()],
                    "guarded": [[s, a] for s, a in st.guarded.items()],
                    "disputed": [s for s, c in st.checkpoints.items() if c.disputed],
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
            for s, path, mark, ids, *evidence in d.get("checkpoints", [])[-MAX_PER_RUN:]:  # older: no evidence
                mark = mark if mark is None else str(mark)
                st.checkpoints[int(s)] = _Checkpoint(str(path), mark, tuple(ids), tuple(*evidence))
            for s in d.get("disputed", ()):  # two paths were noted: a third note must not certify one
                if int(s) in st.checkpoints:
                    st.checkpoints[int(s)].disputed = True
            for iid, weight, first, resolved, *more in d.get("incidents", [])[-MAX_INCIDENTS_PER_RUN:]:
                last, reach = (int(more[0]), str(more[1])) if more else (int(resolved or first), "")
                resolved = None if resolved is None else int(resolved)
                st.incidents[str(iid)] = (str(weight), int(first), resolved, last, reach)
            st.guarded.update((int(s), str(a)) for s, a in d.get("guarded", [])[-MAX_INCIDENTS_PER_RUN:])
        for run, notes in (state.get("unsent") or {}).items():
            self._absorb(str(run), 1, notes)


def _reason(mark: str, ids: tuple[str, ...], was: str | None, evidence: tuple[dict[str, Any], ...] = ()) -> str:
    why = "no incident before it" if mark == "clean" else f"incident(s) {', '.join(ids)} began at or before it"
    if mark == "clean" and evidence:
        why = "; ".join(f"{e['incident']}: {e['why']}" for e in evidence)
    return why + (f" (re-marked: was {was})" if was is not None else "")


@dataclass
class CertifiedPolicy(ControlPolicy):
    """A :class:`ControlPolicy` whose rollback decisions name the newest clean checkpoint at or before
    the incident's onset (its path, or ``step N`` without one)."""

    book: CheckpointBook | None = None

    @classmethod
    def around(cls, policy: ControlPolicy, book: CheckpointBook) -> "CertifiedPolicy":
        """``policy``'s rules, with ``book``'s checkpoints."""
        return cls(**asdict(policy), book=book)

    def decide(self, incident: Incident) -> Decision | None:
        decision = super().decide(incident)
        if decision is None or decision.action != "rollback" or self.book is None:
            return decision
        target = self.book.rollback_target(incident.run, decision.since_step)
        if target is None:
            return decision
        return replace(decision, checkpoint=target.path or f"step {target.step}")
