"""The detector service: records in, incidents out, for any number of runs, live or from a file.

Records flow source (:mod:`~sdcwatch.service.bus`, :mod:`~sdcwatch.service.kafka_source`) ->
:mod:`~sdcwatch.service.ingest` -> :class:`StepAligner` -> the detectors
(:mod:`sdcwatch.detectors`) -> :class:`IncidentBook` -> sinks. :class:`DetectionPipeline` holds
one service's whole detection state, :class:`DetectorService` runs it on a stream with periodic
snapshots (:mod:`~sdcwatch.service.statefile`), :func:`replay` on a file. Split in stages, spatial
instances send a :class:`StepSummary` per step to one temporal instance.

This package sits above :mod:`sdcwatch.detectors` (it imports the detectors, never the reverse).
Importing it is cheap: each name is imported on first use (PEP 562).
"""

from __future__ import annotations

from sdcwatch.core.lazy import lazy_attributes

_LAZY = {
    "StepAligner": "sdcwatch.service.aligner",
    "IncidentBook": "sdcwatch.service.incidents",
    "incident_from_dict": "sdcwatch.service.incidents",
    "RunLifecycle": "sdcwatch.service.run_lifecycle",
    "DetectionPipeline": "sdcwatch.service.pipeline",
    "PipelineSettings": "sdcwatch.service.pipeline",
    "format_table": "sdcwatch.service.offline",
    "replay": "sdcwatch.service.offline",
    "replay_main": "sdcwatch.service.offline",
    "AnomalyTopicSink": "sdcwatch.service.bus",
    "DetectorService": "sdcwatch.service.loop",
    "SummaryTopicSink": "sdcwatch.service.bus",
    "StepSummary": "sdcwatch.service.summary",
    "SummaryOrder": "sdcwatch.service.summary",
    "decode_summary": "sdcwatch.service.summary",
    "encode_summary": "sdcwatch.service.summary",
    "Finding": "sdcwatch.core.incident",
    "Incident": "sdcwatch.core.incident",
    "IncidentEvent": "sdcwatch.core.incident",
    "IncidentSink": "sdcwatch.core.incident",
    "ServiceView": "sdcwatch.core.incident",
    "PipelineView": "sdcwatch.core.incident",
    "RunView": "sdcwatch.core.incident",
    "ANOMALY_TOPIC": "sdcwatch.core.vocabulary",
    "SUMMARY_TOPIC": "sdcwatch.core.vocabulary",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_attributes(__name__, _LAZY)
