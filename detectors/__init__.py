"""Online detectors, step alignment, incidents, the detection service and offline replay.

Records flow ``StepAligner`` -> :class:`StepFrame` -> detectors -> :class:`Attribution` ->
:class:`IncidentBook`; :class:`DetectionPipeline` holds all of it, :class:`DetectorService` runs it
on a stream, :func:`replay` on a file. Every detector but the river baseline comes in two halves
(``observe`` across ranks, ``judge`` over time), so the service can also run split: spatial
instances send a :class:`StepSummary` per step to one temporal instance.
"""

from sdcwatch.detectors.aligner import StepAligner
from sdcwatch.detectors.attribution import Attribution
from sdcwatch.detectors.base import DETECTORS, Detector, SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.incidents import IncidentBook, incident_from_dict
from sdcwatch.detectors.nonfinite import NonFiniteDetector
from sdcwatch.detectors.pipeline import DetectionPipeline, PipelineSettings, default_detectors
from sdcwatch.detectors.rank_outlier import RankOutlierDetector
from sdcwatch.detectors.replay import format_table, replay, replay_main
from sdcwatch.detectors.replica import ReplicaDivergenceDetector
from sdcwatch.detectors.river_hst import RiverHalfSpaceTrees
from sdcwatch.core.names import ANOMALY_TOPIC, SUMMARY_TOPIC
from sdcwatch.detectors.service import AnomalyTopicSink, DetectorService, SummaryTopicSink
from sdcwatch.detectors.spike import SeriesSettings, SpikeDetector
from sdcwatch.detectors.straggler import MissingRankDetector, StragglerDetector
from sdcwatch.detectors.summary import StepSummary, SummaryOrder, decode_summary, encode_summary
from sdcwatch.detectors.types import (
    Finding,
    Incident,
    IncidentEvent,
    IncidentSink,
    PipelineView,
    RunView,
    ServiceView,
    Severity,
)

__all__ = [
    "ANOMALY_TOPIC",
    "SUMMARY_TOPIC",
    "AnomalyTopicSink",
    "Attribution",
    "DETECTORS",
    "DetectionPipeline",
    "Detector",
    "DetectorService",
    "Finding",
    "Incident",
    "IncidentBook",
    "IncidentEvent",
    "IncidentSink",
    "MissingRankDetector",
    "NonFiniteDetector",
    "PipelineSettings",
    "PipelineView",
    "RankOutlierDetector",
    "ReplicaDivergenceDetector",
    "RiverHalfSpaceTrees",
    "RunView",
    "SeriesSettings",
    "ServiceView",
    "Severity",
    "SpikeDetector",
    "SplitDetector",
    "StepAligner",
    "StepContext",
    "StepFrame",
    "StepSummary",
    "StragglerDetector",
    "SummaryOrder",
    "SummaryTopicSink",
    "decode_summary",
    "encode_summary",
    "default_detectors",
    "format_table",
    "incident_from_dict",
    "replay",
    "replay_main",
]
