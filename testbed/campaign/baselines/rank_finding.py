"""The finding a baseline's per-rank rule raises: the ranks whose own values tripped it and their
hosts, nothing more (no baseline attributes a problem to hardware or to the optimisation).
"""

from __future__ import annotations

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.detectors.frame import StepFrame

__all__ = ["rank_finding", "nonfinite_finding"]


def rank_finding(
    detector: str,
    kind: str,
    severity: Severity,
    frame: StepFrame,
    ranks: np.ndarray,
    metric: str,
    message: str,
    score: float,
) -> Finding:
    """The finding of a rule that tripped on ``ranks``' own values: it names them and their hosts."""
    ranks_t = tuple(int(r) for r in ranks)
    hosts = tuple(sorted({frame.hosts[r] for r in ranks_t} - {""}))
    return Finding(
        detector=detector,
        kind=kind,
        severity=severity,
        run=frame.run,
        step=frame.step,
        score=float(score),
        message=message,
        ranks=ranks_t,
        hosts=hosts,
        metric=metric,
    )


def nonfinite_finding(detector: str, frame: StepFrame, ranks: np.ndarray, metric: str, what: str) -> Finding:
    """A critical non-finite finding of ``metric`` on ``ranks`` (``what``: the values, "NaN/Inf")."""
    message = f"{metric} is {what} on {ranks.size} rank(s)"
    return rank_finding(
        detector, IncidentKind.NONFINITE.value, Severity.CRITICAL, frame, ranks, metric, message, float(ranks.size)
    )
