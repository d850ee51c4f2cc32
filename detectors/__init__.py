"""The detectors: what turns an aligned step of every rank into findings.

A detector is one class in one file (:class:`Detector` or, split in a cross-rank and a temporal
half, :class:`SplitDetector`) with its own ``Config``, registered with ``@register`` (discovered
by :mod:`~sdcwatch.detectors.registry`). What they share lives here too: the aligned step
(:class:`StepFrame`), the peer groups of a parallel job, the cross-rank statistics, and
:class:`Attribution`, which joins findings into what a person decides on. The streaming service
that feeds them (alignment, pipeline, incidents, bus, replay) is :mod:`sdcwatch.service`.

Importing this package is cheap: each name is imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any

from sdcwatch.core.lazy import lazy_attributes

_LAZY = {
    "Attribution": "sdcwatch.detectors.attribution",
    "Detector": "sdcwatch.detectors.base",
    "SplitDetector": "sdcwatch.detectors.base",
    "StepContext": "sdcwatch.detectors.base",
    "StepFrame": "sdcwatch.detectors.frame",
    "DetectorSettings": "sdcwatch.detectors.settings",
    "GuardActionDetector": "sdcwatch.detectors.guard_actions",
    "NonFiniteDetector": "sdcwatch.detectors.nonfinite",
    "ChecksumDetector": "sdcwatch.detectors.checksum",
    "LearningRateJump": "sdcwatch.detectors.lr_jump",
    "RankOutlierDetector": "sdcwatch.detectors.rank_outlier",
    "register": "sdcwatch.detectors.registry",
    "default_classes": "sdcwatch.detectors.registry",
    "default_detectors": "sdcwatch.detectors.registry",
    "detector_classes": "sdcwatch.detectors.registry",
    "detector_class": "sdcwatch.detectors.registry",
    "baseline_classes": "sdcwatch.detectors.registry",
    "ReplicaDivergenceDetector": "sdcwatch.detectors.replica",
    "RiverHalfSpaceTrees": "sdcwatch.detectors.river_hst",
    "SeriesSettings": "sdcwatch.core.spike_baseline",
    "SpikeDetector": "sdcwatch.detectors.spike",
    "MissingRankDetector": "sdcwatch.detectors.missing_rank",
    "StragglerDetector": "sdcwatch.detectors.straggler",
    "Finding": "sdcwatch.core.incident",
    "Incident": "sdcwatch.core.incident",
    "IncidentEvent": "sdcwatch.core.incident",
    "IncidentSink": "sdcwatch.core.incident",
    "PipelineView": "sdcwatch.core.incident",
    "RunView": "sdcwatch.core.incident",
    "ServiceView": "sdcwatch.core.incident",
    "Severity": "sdcwatch.core.incident",
}

__all__ = ["DETECTORS", *sorted(_LAZY)]


_lazy = lazy_attributes(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    if name == "DETECTORS":  # every registered detector class of sdcwatch, in pipeline order
        value = importlib.import_module("sdcwatch.detectors.registry").detector_classes()
        globals()[name] = value
        return value
    return _lazy(name)
