"""The detectors: what turns an aligned step of every rank into findings. One detector a file,
found by :mod:`~sdcwatch.detectors.registry`; their shared parts (the aligned step, peer groups,
cross-rank statistics, :class:`Attribution`) live here too. Each name is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from sdcwatch.core.lazy import by_module, lazy_attributes

_LAZY = by_module(
    {
        "sdcwatch.detectors.attribution": "Attribution",
        "sdcwatch.detectors.base": "Detector SplitDetector StepContext DetectorSettings",
        "sdcwatch.detectors.frame": "StepFrame",
        "sdcwatch.detectors.guard_actions": "GuardActionDetector",
        "sdcwatch.detectors.nonfinite": "NonFiniteDetector",
        "sdcwatch.detectors.checksum": "ChecksumDetector",
        "sdcwatch.detectors.lr_jump": "LearningRateJump",
        "sdcwatch.detectors.rank_outlier": "RankOutlierDetector",
        "sdcwatch.detectors.registry": "register default_classes default_detectors detector_classes "
        "detector_class baseline_classes",
        "sdcwatch.detectors.replica": "ReplicaDivergenceDetector",
        "sdcwatch.detectors.river_hst": "RiverHalfSpaceTrees",
        "sdcwatch.core.spike_baseline": "SeriesSettings",
        "sdcwatch.detectors.spike": "SpikeDetector",
        "sdcwatch.detectors.missing_rank": "MissingRankDetector",
        "sdcwatch.detectors.straggler": "StragglerDetector",
        "sdcwatch.core.incident": "Finding Severity",
    }
)

__all__ = ["DETECTORS", *sorted(_LAZY)]


_lazy = lazy_attributes(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    if name == "DETECTORS":  # every registered detector class of sdcwatch, in pipeline order
        value = importlib.import_module("sdcwatch.detectors.registry").detector_classes()
        globals()[name] = value
        return value
    return _lazy(name)
