"""Prometheus collector and incident sinks (Alertmanager, webhook, log).

- :class:`SdcwatchCollector` / :class:`MetricsServer`: ``/metrics`` read from the detector
  service's :class:`~sdcwatch.core.incident.ServiceView` at scrape time (every family in
  :func:`catalogue`: the service's own and those the detectors declare).
- :class:`AlertmanagerSink`, :class:`WebhookSink`, :class:`LogSink`, and the bus's
  :class:`AnomalyTopicSink` and :class:`ControlTopicSink`: implementations of
  :class:`~sdcwatch.core.incident.IncidentSink`; :class:`SummaryTopicSink`: a spatial stage's output.

Importing this package is cheap: each name is imported on first use (PEP 562), so the [metrics]
settings (:mod:`~sdcwatch.exporters.metrics_settings`) are read without prometheus_client.
"""

from __future__ import annotations

from sdcwatch.core.lazy import by_module, lazy_attributes

_LAZY = by_module(
    {
        "sdcwatch.exporters.collector": "SdcwatchCollector",
        "sdcwatch.exporters.server": "MetricsServer",
        "sdcwatch.exporters.catalog": "catalogue STATS metric",
        "sdcwatch.core.metric_spec": "MetricSpec",
        "sdcwatch.exporters.metrics_settings": "DEFAULT_TOP_K DEFAULT_LAYER_STATS DEFAULT_MAX_LAYERS DEFAULT_MAX_PIECES "
        "check_cardinality DEFAULT_METRICS_ADDRESS DEFAULT_METRICS_PORT check_address check_port",
        "sdcwatch.exporters.alertmanager": "AlertmanagerSink alert_for alertname_for",
        "sdcwatch.exporters.webhook": "WebhookSink webhook_payload",
        "sdcwatch.exporters.logsink": "LogSink",
        "sdcwatch.exporters.topics": "AnomalyTopicSink ControlTopicSink SummaryTopicSink",
        "sdcwatch.exporters.delivery": "Backoff post_json",
        "sdcwatch.core.errors": "DeliveryError",
    }
)

__all__ = sorted(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
