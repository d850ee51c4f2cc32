"""Online detectors, step alignment, incidents, the detection service and offline replay.

Records flow ``StepAligner`` -> :class:`StepFrame` -> detectors -> :class:`Attribution` ->
:class:`IncidentBook`; :class:`DetectionPipeline` holds all of it, :class:`DetectorService` runs it
on a stream, :func:`replay` on a file. A detector is one class in one file (:class:`Detector` or,
split in a cross-rank and a temporal half, :class:`SplitDetector`) with its own ``Config``,
registered in :mod:`~sdcwatch.detectors.registry`; the split lets the service run scaled out:
spatial instances send a :class:`StepSummary` per step to one temporal instance.

Importing this package is cheap: each name is imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "StepAligner": "sdcwatch.detectors.aligner",
    "Attribution": "sdcwatch.detectors.attribution",
    "Detector": "sdcwatch.detectors.base",
    "SplitDetector": "sdcwatch.detectors.base",
    "StepContext": "sdcwatch.detectors.base",
    "StepFrame": "sdcwatch.detectors.frame",
    "IncidentBook": "sdcwatch.detectors.incidents",
    "incident_from_dict": "sdcwatch.detectors.incidents",
    "RunLifecycle": "sdcwatch.detectors.lifecycle",
    "NonFiniteDetector": "sdcwatch.detectors.nonfinite",
    "ChecksumDetector": "sdcwatch.detectors.checksum",
    "LearningRateJump": "sdcwatch.detectors.lr_jump",
    "DetectionPipeline": "sdcwatch.detectors.pipeline",
    "PipelineSettings": "sdcwatch.detectors.pipeline",
    "RankOutlierDetector": "sdcwatch.detectors.rank_outlier",
    "register": "sdcwatch.detectors.registry",
    "default_detectors": "sdcwatch.detectors.registry",
    "detector_classes": "sdcwatch.detectors.registry",
    "baseline_classes": "sdcwatch.detectors.registry",
    "format_table": "sdcwatch.detectors.offline",
    "replay": "sdcwatch.detectors.offline",
    "replay_main": "sdcwatch.detectors.offline",
    "ReplicaDivergenceDetector": "sdcwatch.detectors.replica",
    "RiverHalfSpaceTrees": "sdcwatch.detectors.baselines.river_hst",
    "AnomalyTopicSink": "sdcwatch.detectors.bus",
    "DetectorService": "sdcwatch.detectors.service",
    "SummaryTopicSink": "sdcwatch.detectors.bus",
    "SeriesSettings": "sdcwatch.detectors.spike",
    "SpikeDetector": "sdcwatch.detectors.spike",
    "MissingRankDetector": "sdcwatch.detectors.straggler",
    "StragglerDetector": "sdcwatch.detectors.straggler",
    "StepSummary": "sdcwatch.detectors.summary",
    "SummaryOrder": "sdcwatch.detectors.summary",
    "decode_summary": "sdcwatch.detectors.summary",
    "encode_summary": "sdcwatch.detectors.summary",
    "Finding": "sdcwatch.core.incident",
    "Incident": "sdcwatch.core.incident",
    "IncidentEvent": "sdcwatch.core.incident",
    "IncidentSink": "sdcwatch.core.incident",
    "PipelineView": "sdcwatch.core.incident",
    "RunView": "sdcwatch.core.incident",
    "ServiceView": "sdcwatch.core.incident",
    "Severity": "sdcwatch.core.incident",
    "ANOMALY_TOPIC": "sdcwatch.core.names",
    "SUMMARY_TOPIC": "sdcwatch.core.names",
}

__all__ = ["DETECTORS", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name == "DETECTORS":  # every registered detector class of sdcwatch, in pipeline order
        value: Any = importlib.import_module("sdcwatch.detectors.registry").detector_classes()
    else:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'sdcwatch.detectors' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
