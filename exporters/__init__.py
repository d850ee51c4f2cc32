"""Prometheus collector and incident sinks (Alertmanager, webhook, log).

- :class:`SdcwatchCollector` / :class:`MetricsServer`: ``/metrics`` read from the detector
  service's :class:`~sdcwatch.core.incident.ServiceView` at scrape time (catalogue in
  :data:`METRICS`).
- :class:`AlertmanagerSink`, :class:`WebhookSink`, :class:`LogSink`: implementations of
  :class:`~sdcwatch.core.incident.IncidentSink`.

Importing this package is cheap: each name is imported on first use (PEP 562), so the settings'
bounds (:mod:`~sdcwatch.exporters.bounds`) are read without prometheus_client.
"""

from __future__ import annotations

from sdcwatch.core.lazy import lazy_attributes

_LAZY = {
    "SdcwatchCollector": "sdcwatch.exporters.collector",
    "MetricsServer": "sdcwatch.exporters.server",
    "METRICS": "sdcwatch.exporters.catalog",
    "STATS": "sdcwatch.exporters.catalog",
    "MetricSpec": "sdcwatch.exporters.catalog",
    "metric": "sdcwatch.exporters.catalog",
    "DEFAULT_TOP_K": "sdcwatch.exporters.bounds",
    "DEFAULT_LAYER_STATS": "sdcwatch.exporters.bounds",
    "DEFAULT_MAX_LAYERS": "sdcwatch.exporters.bounds",
    "DEFAULT_MAX_PIECES": "sdcwatch.exporters.bounds",
    "check_cardinality": "sdcwatch.exporters.bounds",
    "DEFAULT_METRICS_ADDRESS": "sdcwatch.exporters.bounds",
    "DEFAULT_METRICS_PORT": "sdcwatch.exporters.bounds",
    "check_address": "sdcwatch.exporters.bounds",
    "check_port": "sdcwatch.exporters.bounds",
    "AlertmanagerSink": "sdcwatch.exporters.alertmanager",
    "alert_for": "sdcwatch.exporters.alertmanager",
    "alertname_for": "sdcwatch.exporters.alertmanager",
    "WebhookSink": "sdcwatch.exporters.webhook",
    "webhook_payload": "sdcwatch.exporters.webhook",
    "LogSink": "sdcwatch.exporters.logsink",
    "Backoff": "sdcwatch.exporters.delivery",
    "DeliveryError": "sdcwatch.core.errors",
    "post_json": "sdcwatch.exporters.delivery",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
