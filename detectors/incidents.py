"""The incident book: folds findings into incidents, one per problem, and announces each change.

A finding opens an incident or updates the open one with the same key: (run, kind) for problems
of the whole job (a loss spike, non-finite values, diverged replicas), (run, kind, rank) for
rank-local ones (SDC suspected on rank 5, a straggler). An incident resolves once its signal has
been quiet for ``quiet_steps`` steps of its run. Info findings never open incidents.
Every change (opened, updated, resolved) goes to the sinks as an :class:`IncidentEvent`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Iterable

from sdcwatch.core.jsonsafe import parse_float
from sdcwatch.core.kinds import RANK_FAULT_KINDS, RANK_LOCAL_KINDS, SPIKE_KINDS
from sdcwatch.core.validate import check_positive
from sdcwatch.core.incident import Finding, Incident, IncidentEvent, Severity

__all__ = ["IncidentBook", "incident_from_dict"]

_MAX_RANKS = 64  # ranks listed on one incident (the count is in the evidence)


def incident_from_dict(d: dict[str, Any]) -> Incident:
    """Inverse of :meth:`Incident.to_dict` (restoring a snapshot, reading the anomalies topic)."""
    return Incident(
        id=d["id"],
        run=d["run"],
        kind=d["kind"],
        severity=Severity(d["severity"]),
        first_step=int(d["first_step"]),
        last_step=int(d["last_step"]),
        message=d["message"],
        ranks=tuple(d.get("ranks", ())),
        hosts=tuple(d.get("hosts", ())),
        metric=d.get("metric", ""),
        layer=d.get("layer"),
        score=parse_float(d.get("score", 0.0)),
        evidence=dict(d.get("evidence", {})),
        detector=d.get("detector", ""),
        peak_step=d.get("peak_step"),
        resolved_step=d.get("resolved_step"),
        opened_at=float(d.get("opened_at", 0.0)),
        resolved_at=d.get("resolved_at"),
        coords=tuple({str(k): int(v) for k, v in c.items()} for c in d.get("coords", ())),
    )


def _event(change: str, inc: Incident) -> IncidentEvent:
    """An event carries a copy: sinks may read it on their own thread while the book moves on."""
    return IncidentEvent(change, replace(inc, evidence=dict(inc.evidence)))


class IncidentBook:
    """Open and recently resolved incidents, counters, and the sinks that hear of every change."""

    def __init__(
        self,
        quiet_steps: int = 50,
        *,
        spike_quiet_steps: int = 20,
        keep_resolved: int = 200,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_positive(
            "incidents", quiet_steps=quiet_steps, spike_quiet_steps=spike_quiet_steps, keep_resolved=keep_resolved
        )
        self.quiet_steps = int(quiet_steps)
        # a spike has its own onset and recovery: a burst of spikes closer than this is one incident
        self.spike_quiet_steps = int(spike_quiet_steps)
        self.clock = clock
        self._open: dict[tuple, Incident] = {}
        self._resolved: deque[Incident] = deque(maxlen=int(keep_resolved))
        self.opened_total: dict[tuple[str, str], int] = {}
        self.history: list[Incident] | None = None  # set to [] to keep every incident (offline replay)

    @staticmethod
    def key(f: Finding) -> tuple:
        kind = "rank_fault" if f.kind in RANK_FAULT_KINDS else f.kind
        if f.kind in RANK_LOCAL_KINDS and f.ranks:
            return (f.run, kind, f.ranks[0])
        return (f.run, kind)

    # -- folding ------------------------------------------------------------------------------

    def add(self, findings: Iterable[Finding]) -> list[IncidentEvent]:
        """Fold findings into incidents; returns the events (opened / updated) they caused."""
        events: list[IncidentEvent] = []
        for f in findings:
            if f.severity is Severity.INFO:
                continue
            k = self.key(f)
            inc = self._open.get(k)
            if inc is None:
                inc = Incident(
                    id=f"{f.run}:{f.kind}:{f.step}" + (f":r{f.ranks[0]}" if len(k) == 3 else ""),
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
                    score=f.score,
                    evidence=dict(f.evidence),
                    detector=f.detector,
                    peak_step=f.step,
                    opened_at=self.clock(),
                    coords=f.coords[:_MAX_RANKS],
                )
                self._open[k] = inc
                self.opened_total[(f.kind, f.severity.value)] = self.opened_total.get((f.kind, f.severity.value), 0) + 1
                if self.history is not None:
                    self.history.append(inc)
                events.append(_event("opened", inc))
                continue
            changed = False
            inc.last_step = max(inc.last_step, f.step)
            if f.severity.rank > inc.severity.rank:
                inc.severity, changed = f.severity, True
                if f.kind != inc.kind:  # escalation (silent drift -> SDC suspected) names the new kind,
                    inc.kind = f.kind  # and counts as an incident of that kind being opened
                    self.opened_total[(f.kind, f.severity.value)] = (
                        self.opened_total.get((f.kind, f.severity.value), 0) + 1
                    )
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
            if changed:
                events.append(_event("updated", inc))
        return events

    def advance(self, run: str, step: int) -> list[IncidentEvent]:
        """The run reached ``step``: resolve its incidents quiet for ``quiet_steps`` steps."""
        events = []
        for k, inc in list(self._open.items()):
            quiet = self.spike_quiet_steps if inc.kind in SPIKE_KINDS else self.quiet_steps
            if inc.run == run and step - inc.last_step >= quiet:
                events.append(self._resolve(k, step))
        return events

    def close_run(self, run: str, step: int) -> list[IncidentEvent]:
        """Resolve every open incident of ``run`` (its end, or a new alignment after a world change)."""
        return [self._resolve(k, step) for k, inc in list(self._open.items()) if inc.run == run]

    def forget_run(self, run: str) -> None:
        """Drop ``run``'s resolved incidents (the run was evicted; resolve its open ones first)."""
        kept = [i for i in self._resolved if i.run != run]
        if len(kept) != len(self._resolved):
            self._resolved.clear()
            self._resolved.extend(kept)

    def _resolve(self, k: tuple, step: int) -> IncidentEvent:
        inc = self._open.pop(k)
        inc.resolved_step = step
        inc.resolved_at = self.clock()
        self._resolved.append(inc)
        return _event("resolved", inc)

    # -- reading ------------------------------------------------------------------------------

    @property
    def open_incidents(self) -> list[Incident]:
        return list(self._open.values())

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
        self._open = {tuple(k): incident_from_dict(d) for k, d in state["open"]}
        self._resolved.clear()
        self._resolved.extend(incident_from_dict(d) for d in state["resolved"])
        self.opened_total = {(k, s): int(n) for k, s, n in state["opened_total"]}
