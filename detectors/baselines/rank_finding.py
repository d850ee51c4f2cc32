"""The finding a baseline's per-rank rule raises: the ranks whose own values tripped it and their
hosts, nothing more (no baseline attributes a problem to hardware or to the optimisation).
"""

from __future__ import annotations

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.detectors.frame import StepFrame

__all__ = ["rank_finding"]


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
