"""What the demo injected and what sdcwatch made of it: the scoring of the incidents against the
faults (detected, when, which rank, false alarms), the JSON summary and the printed one."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from sdcwatch.core.kinds import LOCALISING_KINDS

__all__ = ["DemoResult", "summarize", "detection_latency", "format_summary"]


@dataclass(kw_only=True)
class DemoResult:
    """What the demo injected and what sdcwatch made of it; :meth:`to_dict` is ``--json``, in this order."""

    preset: str
    description: str
    injected: list[dict[str, Any]]
    steps: int
    ranks: int
    fault_step: int | None
    fault_rank: int | None
    detected: bool
    first_detection_step: int | None
    localized_rank: int | None
    detection_delay_steps: int | None
    latency_seconds: float | None
    false_alarms: int = 0
    incidents: list[dict[str, Any]]
    wall_seconds: float
    metrics_url: str = ""
    report: str | None = None
    records: str | None = None
    guard: bool = False
    guard_actions: list[dict[str, Any]] = field(default_factory=list)
    """With ``guard``: every step at which the guard acted, ``{step, action, ranks, reason}`` (and more)."""
    final_loss: float | str | None = None
    """Strict JSON: a non-finite loss as the string ``NaN`` or ``Infinity``."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"wall_seconds": round(self.wall_seconds, 2)}


def summarize(incidents: list[Any], fault_step: int | None) -> tuple[bool, int | None, int | None, int]:
    """(detected, first detection step, localized rank, false alarms) from the incidents: one that
    starts before the fault's first step (or any, without a fault) is a false alarm."""
    if fault_step is None:
        return False, None, None, len(incidents)
    after = [i for i in incidents if i.first_step >= fault_step]
    false_alarms = len(incidents) - len(after)
    if not after:
        return False, None, None, false_alarms
    first = min(i.first_step for i in after)
    ordered = sorted(after, key=lambda i: (i.first_step, -i.severity.rank))
    localized = next((int(i.ranks[0]) for i in ordered if i.kind in LOCALISING_KINDS and len(i.ranks) == 1), None)
    return True, first, localized, false_alarms


def detection_latency(
    incidents: list[Any], fault_step: int, opened_wall: dict[str, float], fault_wall: float
) -> float | None:
    """Seconds from the faulted step's start (wall clock) to the opening of the first incident at
    or after it; None when the service's sink did not see it open."""
    first_inc = min((i for i in incidents if i.first_step >= fault_step), key=lambda i: (i.first_step, i.opened_at))
    opened = opened_wall.get(first_inc.id)
    return None if opened is None else round(max(0.0, opened - fault_wall), 3)


def _detection_lines(r: DemoResult) -> list[str]:
    """Whether the fault was detected, when, and which rank was blamed."""
    if not r.detected:
        return ["detected:   NO"]
    lines = [
        f"detected:   yes, at step {r.first_detection_step} ({r.detection_delay_steps} steps after the fault"
        + (f", {r.latency_seconds:.2f} s after it was emitted)" if r.latency_seconds is not None else ")")
    ]
    if r.localized_rank is not None:
        verdict = "correct" if r.localized_rank == r.fault_rank else f"but the fault was on rank {r.fault_rank}"
        lines.append(f"localised:  rank {r.localized_rank} ({verdict})")
    else:
        lines.append(
            "localised:  no single rank blamed" + (" (correct: the cause is run-wide)" if r.fault_rank is None else "")
        )
    return lines


def _guard_lines(r: DemoResult) -> list[str]:
    """What the guard did, one line an action."""
    lines = [f"guard:      {len(r.guard_actions)} action(s)" + ("" if r.guard_actions else " (nothing to do)")]
    for a in r.guard_actions:
        ranks = f" ranks {a['ranks']}" if a["ranks"] else ""
        lines.append(
            f"  - step {a['step']}: {a['action']}{ranks} ({a['reason']}"
            + (f", rerun verdict {a['verdict']}" if a.get("verdict") else "")
            + ")"
        )
    return lines


def format_summary(r: DemoResult) -> str:
    """The human-readable end-of-demo summary."""
    lines = ["", "=" * 72, "sdcwatch demo summary", "=" * 72]
    if r.injected:
        where = f"rank {r.fault_rank}" if r.fault_rank is not None else "all ranks"
        lines.append(f"injected:   {r.description}")
        lines.append(f"            at step {r.fault_step} on {where}")
        lines += _detection_lines(r)
    else:
        lines.append("injected:   nothing (clean run)")
    lines.append(
        f"incidents:  {len(r.incidents)}"
        + (f" ({r.false_alarms} before the fault: false alarms)" if r.false_alarms else "")
    )
    for inc in r.incidents:
        ranks = f" ranks {inc['ranks']}" if inc["ranks"] else ""
        lines.append(
            f"  - [{inc['severity']}] {inc['kind']} steps {inc['first_step']}-{inc['last_step']}{ranks}: {inc['message']}"
        )
    if r.guard:
        lines += _guard_lines(r)
    lines.append(f"final loss: {r.final_loss}")
    if r.report:
        lines.append(f"report:     {r.report}")
    lines.append(f"records:    {r.records}")
    lines.append(f"took {r.wall_seconds:.1f} s")
    return "\n".join(lines)
