"""The incident book: folds findings into incidents, one per problem (per run and kind, rank or onset;
other detectors' findings of one fault its related evidence; info findings open none), resolves those
quiet for ``quiet_steps`` steps and announces each change (docs/detectors.md, "Incidents: one fault").
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

from sdcwatch.core.incident import Finding, Incident, IncidentEvent, Severity
from sdcwatch.core.jsonsafe import parse_float
from sdcwatch.core.kinds import LOCALISING_KINDS, RANK_FAULT_KINDS, RANK_LOCAL_KINDS, SPIKE_KINDS
from sdcwatch.core.validate import check_positive

__all__ = ["IncidentBook", "KEEP_RESOLVED", "SPIKE_QUIET_STEPS"]

_MAX_RANKS = 64  # ranks listed on one incident (the count is in the evidence)
#: A spike has its own onset and recovery: a burst of spikes closer than this many steps is one incident.
SPIKE_QUIET_STEPS = 20
#: Resolved incidents kept for the view (the newest).
KEEP_RESOLVED = 200


def _event(change: str, inc: Incident) -> IncidentEvent:
    """An event carries a copy: sinks may read it on their own thread while the book moves on."""
    return IncidentEvent(change, replace(inc, evidence=dict(inc.evidence)))


def _family(kind: str) -> str:
    """The kinds that share one incident: a rank fault seen more clearly over time escalates in place."""
    return "rank_fault" if kind in RANK_FAULT_KINDS else kind


#: Job-level kinds that blame ranks: one incident per onset (the module docstring).
_ONSET_KINDS = LOCALISING_KINDS - RANK_LOCAL_KINDS


def _narrow(f: Finding, ranks: tuple[int, ...], hosts: Sequence[str] | None) -> Finding:
    """The part of ``f`` about ``ranks`` only: their coordinates, hosts, and the metric and layer of
    their first listed hit; the message stays the step's (``evidence["finding_ranks"]``: all of ``f``'s)."""
    if ranks == f.ranks:
        return f
    where = dict(zip(f.ranks, f.coords))
    if hosts is not None:
        named = tuple(sorted({hosts[r] for r in ranks if 0 <= r < len(hosts)} - {""}))
    else:  # without the host table, one host can only be every rank's
        named = f.hosts if len(f.hosts) == 1 else ()
    metric, layer, layer_name = f.metric, f.layer, f.layer_name
    hits = f.evidence.get("hits")
    if isinstance(hits, list):
        hit = next((h for h in hits if isinstance(h, dict) and h.get("rank") in ranks), None)
        if hit is not None and "metric" in hit:
            metric, layer, layer_name = str(hit["metric"]), hit.get("layer"), hit.get("layer_name")
    return replace(
        f,
        ranks=ranks,
        hosts=named,
        coords=tuple(where.get(r, {}) for r in ranks) if f.coords else (),
        metric=metric,
        layer=layer,
        layer_name=layer_name,
        evidence={**f.evidence, "finding_ranks": list(f.ranks[:_MAX_RANKS])},
    )


def _relates(inc: Incident, kind: str) -> bool:
    """Whether ``inc`` already lists findings of ``kind`` as related evidence."""
    return any(isinstance(r, dict) and r.get("kind") == kind for r in inc.evidence.get("related", ()))


def _onset(f: Finding) -> dict[str, Any]:
    """What an incident keeps of the finding that opened it, beside the latest (its related evidence aside)."""
    return {
        "step": f.step,
        "ranks": list(f.ranks[:_MAX_RANKS]),
        "hosts": list(f.hosts[:_MAX_RANKS]),
        "metric": f.metric,
        "layer": f.layer,
        "layer_name": f.layer_name,
        "message": f.message,
        "evidence": {k: v for k, v in f.evidence.items() if k != "related"},
    }


def _related_entry(f: Finding) -> dict[str, Any]:
    """What an incident keeps of a related finding (see the module docstring)."""
    return {
        "kind": f.kind,
        "detector": f.detector,
        "severity": f.severity.value,
        "ranks": list(f.ranks[:_MAX_RANKS]),
        **({"coords": [dict(c) for c in f.coords[:_MAX_RANKS]]} if f.coords else {}),
        "metric": f.metric,
        "layer": f.layer,
        **({"layer_name": f.layer_name} if f.layer_name else {}),
        "first_step": f.step,
        "last_step": f.step,
        "score": f.score,
        "message": f.message,
        "findings": 1,
    }


class IncidentBook:
    """Open and recently resolved incidents, counters, and the sinks that hear of every change."""

    def __init__(
        self, quiet_steps: int = 50, *, related_steps: int = 50, clock: Callable[[], float] = time.time
    ) -> None:
        check_positive("incidents", quiet_steps=quiet_steps, related_steps=related_steps)
        self.quiet_steps = int(quiet_steps)
        # a finding of another localising kind naming the incident's ranks this close is its evidence
        self.related_steps = int(related_steps)
        self.clock = clock
        self._open: dict[tuple, Incident] = {}
        self._resolved: deque[Incident] = deque(maxlen=KEEP_RESOLVED)
        self.opened_total: Counter[tuple[str, str]] = Counter()
        self.history: list[Incident] | None = None  # set to [] to keep every incident (offline replay)

    @staticmethod
    def key(f: Finding) -> tuple:
        """The key of the incident ``f`` opens: per kind, per rank, or per onset step."""
        family = _family(f.kind)
        if f.kind in RANK_LOCAL_KINDS and f.ranks:
            return (f.run, family, f.ranks[0])
        if f.kind in _ONSET_KINDS:
            return (f.run, family, f.step)
        return (f.run, family)

    # -- folding ------------------------------------------------------------------------------

    def add(self, findings: Iterable[Finding], hosts: Sequence[str] | None = None) -> list[IncidentEvent]:
        """Fold findings into incidents; the events (opened / updated) they caused. ``hosts``: the run's
        host table, naming the hosts of each part of a finding split over several incidents."""
        events: list[IncidentEvent] = []
        for f in findings:
            if f.severity is Severity.INFO:
                continue
            for k, part in self._place(f, hosts):
                home = None if k in self._open else self._related_home(part)
                events += self._fold(k, part) if home is None else self._relate(home, part)
        return events

    def _related_home(self, f: Finding) -> tuple | None:
        """The key of the open incident ``f`` is related evidence of (the module docstring), or None."""
        if f.kind not in LOCALISING_KINDS or not f.ranks:
            return None
        ranks, family, near = set(f.ranks), _family(f.kind), self.related_steps
        homes = [
            (inc.first_step, inc.id, k)
            for k, inc in self._open.items()
            if inc.run == f.run
            and inc.kind in LOCALISING_KINDS
            and _family(inc.kind) != family
            and ranks <= set(inc.ranks)
            and (abs(f.step - inc.first_step) <= near or _relates(inc, f.kind))
        ]
        return min(homes)[2] if homes else None

    def _relate(self, k: tuple, f: Finding) -> list[IncidentEvent]:
        """Add ``f`` to the related evidence of incident ``k`` (an event when its kind is new or severity rises)."""
        inc = self._open[k]
        inc.last_step = max(inc.last_step, f.step)
        related = [dict(r) for r in inc.evidence.get("related", ())]  # copies: events hold the old ones
        entry = next((r for r in related if r.get("kind") == f.kind), None)
        changed = entry is None
        if entry is None:
            related.append(_related_entry(f))
        else:
            entry["last_step"] = max(int(entry["last_step"]), f.step)
            entry["findings"] = int(entry.get("findings", 1)) + 1
            if f.score > parse_float(entry.get("score", 0.0)):
                entry["score"] = f.score
        if f.severity.rank > inc.severity.rank:
            inc.severity, changed = f.severity, True
        inc.evidence = {**inc.evidence, "related": related}
        return [_event("updated", inc)] if changed else []

    def _place(self, f: Finding, hosts: Sequence[str] | None) -> list[tuple[tuple, Finding]]:
        """(incident key, the part of ``f`` that goes there) for each incident ``f`` feeds."""
        if f.kind in RANK_LOCAL_KINDS and f.ranks:  # each rank its own incident
            return [(self.key(part), part) for part in (_narrow(f, (r,), hosts) for r in dict.fromkeys(f.ranks))]
        if f.kind not in _ONSET_KINDS:
            return [(self.key(f), f)]
        family = _family(f.kind)
        mine = [(k, inc) for k, inc in self._open.items() if inc.run == f.run and _family(inc.kind) == family]
        if not f.ranks:  # blames no rank: the kind's latest incident goes on, or this one begins
            if mine:
                return [(max(mine, key=lambda ki: (ki[1].last_step, ki[1].first_step))[0], f)]
            return [(self.key(f), f)]
        holder: dict[int, tuple] = {}
        for k, inc in mine:
            for r in inc.ranks:
                holder.setdefault(r, k)
        listed = f.ranks[:_MAX_RANKS]  # what an incident lists; the rest go with the first part
        parts: dict[tuple, list[int]] = {}
        for r in listed:
            parts.setdefault(holder.get(r, self.key(f)), []).append(r)
        if len(parts) == 1:
            return [(next(iter(parts)), f)]
        first = holder.get(listed[0], self.key(f))
        parts[first] += f.ranks[_MAX_RANKS:]
        return [(k, _narrow(f, tuple(ranks), hosts)) for k, ranks in parts.items()]

    def _fold(self, k: tuple, f: Finding) -> list[IncidentEvent]:
        """Open the incident ``k`` with ``f``, or update it; the events that caused."""
        inc = self._open.get(k)
        if inc is None:
            inc = Incident(
                id=f"{f.run}:{f.kind}:{f.step}" + (f":r{f.ranks[0]}" if f.kind in RANK_LOCAL_KINDS and f.ranks else ""),
                run=f.run,
                kind=f.kind,
                severity=f.severity,
                first_step=f.step,
                last_step=f.step,
                message=f.message,
                ranks=f.ranks[:_MAX_RANKS],
                hosts=f.hosts[:_MAX_RANKS],
                metric=f.metric,
                layer=f.layer,
                layer_name=f.layer_name,
                score=f.score,
                evidence=dict(f.evidence),
                detector=f.detector,
                peak_step=f.step,
                opened_at=self.clock(),
                coords=f.coords[:_MAX_RANKS],
                onset=_onset(f),
            )
            self._open[k] = inc
            self.opened_total[(f.kind, f.severity.value)] += 1
            if self.history is not None:
                self.history.append(inc)
            return [_event("opened", inc)]
        changed = False
        inc.last_step = max(inc.last_step, f.step)
        if f.severity.rank > inc.severity.rank:
            inc.severity, changed = f.severity, True
            if f.kind != inc.kind:  # escalation (silent drift -> SDC suspected) names the new kind,
                inc.kind = f.kind  # and counts as an incident of that kind being opened
                self.opened_total[(f.kind, f.severity.value)] += 1
        ranks = tuple(sorted(set(inc.ranks) | set(f.ranks)))[:_MAX_RANKS]
        if ranks != inc.ranks:
            if inc.coords or f.coords:  # each rank's coordinates, in the order of ranks
                where = {**dict(zip(f.ranks, f.coords)), **dict(zip(inc.ranks, inc.coords))}
                inc.coords = tuple(where.get(r, {}) for r in ranks)
            inc.ranks, changed = ranks, True
            inc.hosts = tuple(sorted(set(inc.hosts) | set(f.hosts)))[:_MAX_RANKS]
        if f.score > inc.score:
            inc.score, inc.peak_step = f.score, f.step
        inc.evidence = {**inc.evidence, **f.evidence}
        # the message follows a new spike onset or an escalation; not every step's wording. The
        # metric and layer are the message's: an incident says one thing
        if f.message != inc.message and (changed or f.evidence.get("phase") == "onset"):
            inc.message, changed = f.message, True
            inc.metric, inc.layer = f.metric or inc.metric, f.layer if f.layer is not None else inc.layer
            inc.layer_name = f.layer_name if f.layer is not None else inc.layer_name
        return [_event("updated", inc)] if changed else []

    def advance(self, run: str, step: int) -> list[IncidentEvent]:
        """The run reached ``step``: resolve its incidents quiet for ``quiet_steps`` steps."""
        events = []
        for k, inc in list(self._open.items()):
            quiet = SPIKE_QUIET_STEPS if inc.kind in SPIKE_KINDS else self.quiet_steps
            if inc.run == run and step - inc.last_step >= quiet:
                events.append(self._resolve(k, step))
        return events

    def close_run(self, run: str, step: int) -> list[IncidentEvent]:
        """Resolve every open incident of ``run`` (its end, or a new alignment after a world change)."""
        return [self._resolve(k, step) for k, inc in list(self._open.items()) if inc.run == run]

    def forget_run(self, run: str) -> None:
        """Drop ``run``'s resolved incidents (the run was evicted; resolve its open ones first)."""
        self._resolved = deque((i for i in self._resolved if i.run != run), maxlen=self._resolved.maxlen)

    def _resolve(self, k: tuple, step: int) -> IncidentEvent:
        inc = self._open.pop(k)
        inc.resolved_step = step
        inc.resolved_at = self.clock()
        self._resolved.append(inc)
        return _event("resolved", inc)

    # -- reading ------------------------------------------------------------------------------

    def current(self) -> list[Incident]:
        """Open incidents plus the recently resolved ones (copies, safe to hand to another thread)."""
        return [replace(i, evidence=dict(i.evidence)) for i in (*self._open.values(), *self._resolved)]

    def snapshot(self) -> dict[str, Any]:
        return {
            "open": [[list(k), i.to_dict()] for k, i in self._open.items()],
            "resolved": [i.to_dict() for i in self._resolved],
            "opened_total": [[k, s, n] for (k, s), n in self.opened_total.items()],
        }

    def restore(self, state: dict[str, Any]) -> None:
        self._open = {tuple(k): Incident.from_dict(d) for k, d in state["open"]}
        self._resolved.clear()
        self._resolved.extend(Incident.from_dict(d) for d in state["resolved"])
        self.opened_total = Counter({(k, s): int(n) for k, s, n in state["opened_total"]})
