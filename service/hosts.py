"""The host ledger: evidence that names a rank credits that rank's host, across runs, so the one
service that watches every run of a cluster sees the machine named again and again below each
run's alerting bound; a verdict per host (clean, suspect, quarantine, cleared) says on what evidence.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Sequence

from sdcwatch.core.validate import check_int, check_number, settings_from
from sdcwatch.detectors.attribution import hardware_like

__all__ = ["EVIDENCE", "HostLedger", "HostSettings", "HostVerdict", "VERDICTS", "credit_hosts"]

#: A host's verdicts, from harmless to decisive (``cleared``: an operator's clear after a repair).
VERDICTS = ("clean", "cleared", "suspect", "quarantine")
_FLAGGED = ("suspect", "quarantine")

#: What a finding of each kind is worth against the host of the rank(s) it names, by how specific it
#: is: (evidence kind, weight). Kinds not here (spikes, stragglers, missing ranks, the guard's own
#: reports) credit no host; a single-step ``rank_deviation`` counts only when a bad batch would not
#: explain it (the rule attribution applies).
EVIDENCE = {
    "checksum_mismatch": ("checksum", 0.6),
    "checksum_outlier": ("checksum", 0.3),
    "nonfinite": ("nonfinite", 0.4),
    "replica_divergence": ("replica", 0.6),
    "sdc_suspected": ("rank_outlier", 0.5),
    "silent_drift": ("rank_outlier", 0.4),
    "rank_outlier": ("rank_outlier", 0.3),
    "rank_deviation": ("rank_outlier", 0.15),
}


@dataclass
class HostSettings:
    """The ``[hosts]`` table of ``sdcwatch serve``: how evidence about hosts is weighed and bounded."""

    half_life_s: float = 7 * 86400.0
    """Seconds after which a host's evidence counts half (a repaired or replaced part fades)."""
    run_cap: float = 1.0
    """The most one run can add to a host's score: one run alone never makes a verdict."""
    run_floor: float = 0.3
    """A run counts as independent evidence against a host once its (decayed) share reaches this."""
    one_off_run: float = 0.5
    """What a run counts for when its evidence against a host is one step: a one-off upset strikes
    any host by chance (several, on one host of a large fleet, do); a defective part recurs."""
    suspect_score: float = 1.5
    """Score at which a host named by at least suspect_runs runs becomes suspect."""
    suspect_runs: int = 2
    """Independent runs needed for suspect."""
    quarantine_score: float = 3.0
    """Score at which a host named by at least quarantine_runs runs is quarantined (kept until cleared)."""
    quarantine_runs: int = 3
    """Independent runs needed for quarantine."""
    max_hosts: int = 10000
    """Hosts tracked; past it a new host takes the place of the clean host with the least evidence,
    never of a suspect or quarantined one (else it is refused and counted)."""
    max_label: int = 253
    """Longest host label kept (a DNS name's length); longer ones are refused and counted."""
    max_runs_per_host: int = 64
    """Runs whose evidence is kept per host (the weakest go first)."""

    def __post_init__(self) -> None:
        for f in fields(HostSettings):
            if f.type in ("int", int):
                check_int(f"hosts.{f.name}", getattr(self, f.name), lo=1)
            else:
                check_number(f"hosts.{f.name}", getattr(self, f.name), 0, lo_open=True)
        check_number("hosts.quarantine_score", self.quarantine_score, self.suspect_score)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HostSettings":
        """Settings of a ``[hosts]`` table; an unknown key is refused, naming the known ones."""
        return settings_from(cls, "hosts", d)


@dataclass(frozen=True)
class HostVerdict:
    """What the ledger says about one host, and on what evidence."""

    host: str
    verdict: str  # "clean" | "suspect" | "quarantine" | "cleared"
    score: float  # decayed, weighed evidence
    runs: tuple[str, ...]  # independent runs whose evidence counts
    kinds: tuple[str, ...]  # evidence kinds seen ("checksum", "nonfinite", "rank_outlier", "replica", ...)
    steps: int  # evidence events counted
    since: float  # wall time (epoch s) the current verdict began; 0.0 for clean
    gpus: tuple[str, ...]  # GPU ids/UUIDs credited on this host (may be empty)
    cleared_by: str = ""  # the operator's clear, when verdict is "cleared"
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}


@dataclass
class _Host:
    """One host's evidence (per run: its score, which decays from the wall time of its last credit)
    and its verdict."""

    runs: dict[str, tuple[float, ...]] = field(default_factory=dict)  # run -> (score, wall, first step, recurs: 0/1)
    kinds: set[str] = field(default_factory=set)
    gpus: set[str] = field(default_factory=set)
    steps: int = 0
    verdict: str = "clean"
    since: float = 0.0
    cleared_by: str = ""
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        runs = {r: list(e) for r, e in self.runs.items()}
        return {**asdict(self), "runs": runs, "kinds": sorted(self.kinds), "gpus": sorted(self.gpus)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "_Host":
        h = cls()
        # a run saved as (score, wall), before its steps were kept, counts as recurring
        runs = dict(d.get("runs", {}))
        h.runs = {str(r): tuple(map(float, e if len(e) == 4 else [*e[:2], -1.0, 1.0])) for r, e in runs.items()}
        h.kinds, h.gpus = {str(k) for k in d.get("kinds", ())}, {str(g) for g in d.get("gpus", ())}
        h.steps = int(d.get("steps", 0))
        verdict = d.get("verdict", "clean")
        h.verdict = verdict if verdict in VERDICTS else "clean"
        h.since = float(d.get("since", 0.0))
        h.cleared_by, h.reason = str(d.get("cleared_by", "")), str(d.get("reason", ""))
        return h


class HostLedger:
    """Evidence per host across runs, decayed over wall time, and a verdict per host.

    >>> ledger = HostLedger()
    >>> for run, step in [("a", 1), ("a", 9), ("b", 4), ("b", 5)]:
    ...     ledger.credit(run=run, step=step, host="node17", kind="checksum", weight=0.5, wall=0.0)
    >>> [(v.host, v.verdict, v.runs) for v in ledger.verdicts(wall=0.0)]
    [('node17', 'suspect', ('a', 'b'))]
    """

    def __init__(self, settings: HostSettings | None = None) -> None:
        self.settings = settings or HostSettings()
        self._hosts: dict[str, _Host] = {}
        self.refused: dict[str, int] = {"label": 0, "full": 0}
        """Credits refused: a label too long or empty ("label"), no room for a new host ("full")."""
        self.changed: set[str] = set()
        """Hosts whose state changed since :meth:`take_changed` (for the state topic)."""

    # -- evidence ---------------------------------------------------------------------------------

    def _decay(self, e: tuple[float, float], wall: float) -> float:
        return e[0] * 0.5 ** (max(wall - e[1], 0.0) / self.settings.half_life_s)

    def credit(self, *, run: str, step: int, host: str, kind: str, weight: float, wall: float, gpu: str = "") -> None:
        """Credit ``host`` with evidence of ``kind`` weighing ``weight`` from ``run`` at ``step``."""
        if not host or len(host) > self.settings.max_label or not (weight > 0 and math.isfinite(weight)):
            self.refused["label"] += bool(host == "" or len(host) > self.settings.max_label)
            return
        h = self._hosts.get(host)
        if h is None:
            if len(self._hosts) >= self.settings.max_hosts and not self._evict(wall):
                self.refused["full"] += 1
                return
            h = self._hosts[host] = _Host()
        if run not in h.runs and len(h.runs) >= self.settings.max_runs_per_host:
            del h.runs[min(h.runs, key=lambda r: self._decay(h.runs[r], wall))]
        e = h.runs.get(run, (0.0, wall, step, 0.0))
        recurs = float(e[3] or e[2] != step)  # a second step of evidence in this run
        h.runs[run] = (min(self._decay(e, wall) + weight, self.settings.run_cap), wall, e[2], recurs)
        h.steps += 1
        h.kinds.add(kind)
        if gpu and len(h.gpus) < 64:
            h.gpus.add(gpu[: self.settings.max_label])
        self._judge(host, h, wall)
        self.changed.add(host)

    def _evict(self, wall: float) -> bool:
        """Make room: forget the clean (or cleared) host with the least evidence; False if none."""
        calm = [(self._score(h, wall), name) for name, h in self._hosts.items() if h.verdict not in _FLAGGED]
        if not calm:
            return False
        name = min(calm)[1]
        del self._hosts[name]
        if len(self.changed) < 2 * self.settings.max_hosts:  # its tombstone (a flood's are not worth keeping)
            self.changed.add(name)
        return True

    def _score(self, h: _Host, wall: float) -> float:
        return sum(self._decay(e, wall) for e in h.runs.values())

    def _counted(self, h: _Host, wall: float) -> list[str]:
        return sorted(r for r, e in h.runs.items() if self._decay(e, wall) >= self.settings.run_floor)

    def _judge(self, host: str, h: _Host, wall: float) -> None:
        """Raise (or, for a suspect whose evidence faded, lower) the verdict; quarantine stays until cleared."""
        s = self.settings
        counted = self._counted(h, wall)
        score, runs = self._score(h, wall), sum(1.0 if h.runs[r][3] else s.one_off_run for r in counted)
        verdict = h.verdict
        if score >= s.quarantine_score and runs >= s.quarantine_runs:
            verdict = "quarantine"
        elif verdict != "quarantine" and score >= s.suspect_score and runs >= s.suspect_runs:
            verdict = "suspect"
        elif verdict == "suspect" and score < s.suspect_score / 2:
            verdict = "clean"
        if verdict != h.verdict:
            h.verdict, h.since = verdict, (wall if verdict != "clean" else 0.0)
            h.cleared_by = h.reason = ""
            if verdict in _FLAGGED:
                h.reason = f"score {score:.2f} from {len(counted)} runs ({', '.join(sorted(h.kinds))})"
            self.changed.add(host)

    # -- reading ----------------------------------------------------------------------------------

    def review(self, wall: float) -> None:
        """Judge every host again at ``wall`` (the service does, at each snapshot): a suspect whose
        evidence faded goes back to clean. Reading never judges: it says what was decided."""
        for host, h in self._hosts.items():
            self._judge(host, h, wall)

    def verdict(self, host: str, wall: float) -> HostVerdict | None:
        """The verdict on ``host`` as last judged, its evidence decayed to ``wall``; None when it is
        not tracked."""
        h = self._hosts.get(host)
        if h is None:
            return None
        return HostVerdict(
            host=host,
            verdict=h.verdict,
            score=round(self._score(h, wall), 6),
            runs=tuple(self._counted(h, wall)),
            kinds=tuple(sorted(h.kinds)),
            steps=h.steps,
            since=h.since,
            gpus=tuple(sorted(h.gpus)),
            cleared_by=h.cleared_by,
            reason=h.reason,
        )

    def verdicts(self, wall: float) -> list[HostVerdict]:
        """Every tracked host's verdict (:meth:`verdict`), worst first (then by score, then by name)."""
        out = [v for host in self._hosts if (v := self.verdict(host, wall)) is not None]
        out.sort(key=lambda v: (-VERDICTS.index(v.verdict), -v.score, v.host))
        return out

    def __len__(self) -> int:
        return len(self._hosts)

    # -- operator ---------------------------------------------------------------------------------

    def clear(self, host: str, *, by: str, reason: str, wall: float) -> bool:
        """An operator's clear (after a repair): the host's evidence so far is dropped and its verdict
        is ``cleared``, recorded with who and why; False when the host is not tracked."""
        h = self._hosts.get(host)
        if h is None:
            return False
        h.runs.clear()
        h.kinds.clear()
        h.steps = 0
        h.verdict, h.since, h.cleared_by, h.reason = "cleared", wall, by, reason
        self.changed.add(host)
        return True

    # -- state ------------------------------------------------------------------------------------

    def host_state(self, host: str) -> dict[str, Any] | None:
        """One host's state (the state topic's value for key ``host``); None once it is forgotten."""
        h = self._hosts.get(host)
        return None if h is None else h.to_dict()

    def adopt(self, host: str, d: dict[str, Any] | None) -> None:
        """Take one host's state (another instance's, from the state topic), merged with what this
        ledger holds: each run's newer evidence, the worse verdict, and the later operator clear
        (evidence from before a clear is dropped); None forgets the host."""
        if d is None:
            self._hosts.pop(host, None)
            return
        if not host or len(host) > self.settings.max_label:
            return
        try:
            theirs, mine = _Host.from_dict(d), self._hosts.get(host)
        except (TypeError, ValueError, AttributeError):  # a damaged record: this ledger goes on without it
            return
        if mine is None:
            if len(self._hosts) < self.settings.max_hosts:
                self._hosts[host] = theirs
            return
        for run, e in theirs.runs.items():
            if run not in mine.runs or e[1] > mine.runs[run][1]:
                mine.runs[run] = e
        mine.kinds |= theirs.kinds
        mine.gpus |= theirs.gpus
        mine.steps = max(mine.steps, theirs.steps)
        cleared = [h for h in (mine, theirs) if h.verdict == "cleared"]
        if cleared:
            last = max(cleared, key=lambda h: h.since)
            mine.runs = {r: e for r, e in mine.runs.items() if e[1] > last.since}
        else:
            last = max((mine, theirs), key=lambda h: VERDICTS.index(h.verdict))
        mine.verdict, mine.since, mine.cleared_by, mine.reason = last.verdict, last.since, last.cleared_by, last.reason
        self._judge(host, mine, max((e[1] for e in mine.runs.values()), default=mine.since))  # the runs merged

    def take_changed(self) -> set[str]:
        """The hosts changed since the last call (their state to publish)."""
        changed, self.changed = self.changed, set()
        return changed

    def snapshot(self) -> dict[str, Any]:
        """The whole ledger, JSON-safe."""
        return {"hosts": {name: h.to_dict() for name, h in self._hosts.items()}, "refused": dict(self.refused)}

    def restore(self, d: dict[str, Any]) -> None:
        """Take back a :meth:`snapshot`."""
        self._hosts = {}
        for name, hd in dict(d.get("hosts", {})).items():
            self.adopt(str(name), hd)
        refused = d.get("refused", {})
        self.refused = {k: int(refused.get(k, 0)) for k in ("label", "full")}


def credit_hosts(
    ledger: HostLedger,
    findings: Iterable[Any],
    hosts: Sequence[str],
    wall: float,
    gpus: Sequence[str] = (),
    *,
    deviations: Iterable[Any] = (),
) -> None:
    """Credit the hosts of the ranks each finding names (``hosts``/``gpus``: per rank of the step)
    with its :data:`EVIDENCE` weight, shared among the hosts it names; ``deviations``: the step's
    findings before attribution, whose hardware-like single-step rank deviations count too. A
    finding naming every host of the run (all ranks share it: the data, the optimisation) credits none."""
    run_hosts = {h for h in hosts if h}
    extreme = [d for d in deviations if d.kind == "rank_deviation" and hardware_like(d)]
    for f in [*findings, *extreme]:
        kind, weight = EVIDENCE.get(f.kind, ("", 0.0))
        named = {r: hosts[r] for r in f.ranks if 0 <= r < len(hosts) and hosts[r]}
        if not weight or not named or set(named.values()) == run_hosts and len(named) > 1:
            continue
        by_host: dict[str, str] = {}  # host -> a GPU of the ranks named on it
        for r, host in named.items():
            by_host[host] = by_host.get(host) or (gpus[r] if r < len(gpus) else "")
        for host, gpu in by_host.items():
            ledger.credit(
                run=f.run, step=f.step, host=host, kind=kind, weight=weight / len(by_host), wall=wall, gpu=gpu
            )
