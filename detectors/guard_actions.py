"""The guard's actions, made visible: each step whose records say the job's guard acted
(``guard_action``, ``guard_reason``, ``guard_verdict``, ``guard_rank`` codes) becomes a finding
``guard_<action>``, reaching alerts and ``/metrics`` like every detection: no silent skips.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sdcwatch.core.control import ACTIONS, REASONS, VERDICTS
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.detectors.base import SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.registry import register

__all__ = ["GuardActionDetector"]

_SEVERE = ("rollback", "evict")
_REASON_TEXT = {
    "nonfinite": "a non-finite loss or gradient",
    "spike": "a loss or gradient spike",
    "checksum": "a matrix product's checksum above its rounding bound",
    "control": "a decision of the detector service",
    "": "an unstated reason",
}


def _largest(col: np.ndarray | None, default: int) -> int:
    """The largest finite value the ranks sent in ``col``, or ``default``."""
    vals = np.zeros(0) if col is None else col[np.isfinite(col)]
    return int(vals.max()) if vals.size else default


def _code(col: np.ndarray | None, table: tuple[str, ...]) -> int:
    """The code the ranks sent (0: none), -1 for one past ``table`` (a newer guard's)."""
    v = _largest(col, 0)
    return v if 0 <= v < len(table) else -1


@register(default=True, order=90)
class GuardActionDetector(SplitDetector):
    """A finding for every step at which the guard skipped, reran, rolled back or evicted."""

    name = "guard"
    fault = "guard_action"

    def observe(self, frame: StepFrame) -> dict[str, Any] | None:
        """The action the ranks report for this step (None when there was none)."""
        action = _code(frame.scalar("guard_action"), ACTIONS)
        if action == 0:
            return None
        return {
            "action": action,
            "reason": _code(frame.scalar("guard_reason"), REASONS),
            "verdict": _code(frame.scalar("guard_verdict"), VERDICTS),
            "rank": _largest(frame.scalar("guard_rank"), -1),
        }

    def judge(self, at: StepContext, seen: dict[str, Any] | None) -> list[Finding]:
        if seen is None:
            return []
        code = int(seen["action"])
        if code < 0:  # a code from a newer guard: still an action, and still shown
            action, severity = "unknown", Severity.WARNING
        else:
            action = ACTIONS[code]
            severity = Severity.CRITICAL if action in _SEVERE else Severity.WARNING
        reason = REASONS[seen["reason"]] if 0 <= seen["reason"] < len(REASONS) else ""
        verdict = VERDICTS[seen["verdict"]] if 0 <= seen["verdict"] < len(VERDICTS) else ""
        rank = int(seen["rank"])
        ranks = (rank,) if 0 <= rank < at.world else ()
        host = at.hosts[rank] if ranks and rank < len(at.hosts) and at.hosts[rank] else ""
        on = f" rank {rank}" + (f" (host {host})" if host else "") if ranks else ""
        done = {
            "skip": "skipped the update of",
            "rerun": "reran",
            "rollback": "rolled back at",
            "evict": f"evicted{on} at",
            "leave": "let a replica group leave the quorum (the others go on) at",
            "unknown": "acted at",
        }[action]
        msg = f"guard {done} step {at.step} on every rank, for {_REASON_TEXT.get(reason, reason)}"
        if ranks and action != "evict":
            msg += f" on{on}"
        if verdict:
            msg += f"; rerun verdict: {verdict}"
        return [
            Finding.at(
                at,
                self.name,
                f"guard_{action}",
                severity,
                float(max(code, 0)),
                msg,
                ranks=ranks,
                metric="guard_action",
                # every action is its own event: "onset" lets the incident book announce each one
                evidence={"action": action, "reason": reason, "verdict": verdict, "phase": "onset"},
            )
        ]
