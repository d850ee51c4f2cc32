"""The detector service: records in, incidents out, for any number of runs, live or from a file.
Records flow one way: source -> ingest -> :class:`StepAligner` -> the detectors -> :class:`IncidentBook`
-> the sinks (docs/architecture.md); each name is imported on first use (PEP 562)."""

from __future__ import annotations

from sdcwatch.core.lazy import by_module, lazy_attributes

_LAZY = by_module(
    {
        "sdcwatch.service.aligner": "StepAligner",
        "sdcwatch.service.incidents": "IncidentBook",
        "sdcwatch.service.run_lifecycle": "RunLifecycle",
        "sdcwatch.service.pipeline": "DetectionPipeline PipelineSettings",
        "sdcwatch.service.hosts": "HostLedger HostSettings HostVerdict",
        "sdcwatch.service.offline": "format_table replay replay_main",
        "sdcwatch.service.loop": "DetectorService",
        "sdcwatch.service.summary": "StepSummary SummaryOrder decode_summary encode_summary",
        "sdcwatch.core.incident": "Finding Incident IncidentEvent IncidentSink ServiceView PipelineView RunView",
        "sdcwatch.core.vocabulary": "ANOMALY_TOPIC SUMMARY_TOPIC",
    }
)

__all__ = sorted(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
