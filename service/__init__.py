"""The detector service: records in, incidents out, for any number of runs, live or from a file.

Records flow one way: source (:mod:`~sdcwatch.service.kafka_source`) -> :mod:`~sdcwatch.service.ingest`
-> :class:`StepAligner` -> the detectors (:mod:`sdcwatch.detectors`) -> :class:`IncidentBook` -> the
sinks the service is given (:mod:`sdcwatch.exporters`). :class:`DetectionPipeline` holds one
service's whole detection state, :class:`DetectorService` runs it on a stream with periodic snapshots
(:mod:`~sdcwatch.service.statefile`), :func:`replay` on a file. Split in stages, spatial instances
send a :class:`StepSummary` per step to one temporal instance.

This package sits above :mod:`sdcwatch.detectors` (it imports the detectors, never the reverse).
Importing it is cheap: each name is imported on first use (PEP 562).
"""

from __future__ import annotations

from sdcwatch.core.lazy import by_module, lazy_attributes

_LAZY = by_module(
    {
        "sdcwatch.service.aligner": "StepAligner",
        "sdcwatch.service.incidents": "IncidentBook",
        "sdcwatch.service.run_lifecycle": "RunLifecycle",
        "sdcwatch.service.pipeline": "DetectionPipeline PipelineSettings",
        "sdcwatch.service.offline": "format_table replay replay_main",
        "sdcwatch.service.loop": "DetectorService",
        "sdcwatch.service.summary": "StepSummary SummaryOrder decode_summary encode_summary",
        "sdcwatch.core.incident": "Finding Incident IncidentEvent IncidentSink ServiceView PipelineView RunView",
        "sdcwatch.core.vocabulary": "ANOMALY_TOPIC SUMMARY_TOPIC",
    }
)

__all__ = sorted(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
