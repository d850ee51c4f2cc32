"""Prometheus collector and incident sinks (Alertmanager, webhook, log).

- :class:`SdcwatchCollector` / :class:`MetricsServer`: ``/metrics`` read from the detector
  service's :class:`~sdcwatch.core.incident.ServiceView` at scrape time (catalogue in
  :data:`METRICS`).
- :class:`AlertmanagerSink`, :class:`WebhookSink`, :class:`LogSink`: implementations of
  :class:`~sdcwatch.core.incident.IncidentSink`.
"""

from .alertmanager import AlertmanagerSink, alert_for, alertname_for
from .catalog import METRICS, STATS, MetricSpec, metric
from .collector import DEFAULT_LAYER_STATS, DEFAULT_TOP_K, SdcwatchCollector
from .delivery import Backoff, DeliveryError, post_json
from .logsink import LogSink
from .server import DEFAULT_METRICS_ADDRESS, DEFAULT_METRICS_PORT, MetricsServer
from .webhook import WebhookSink, webhook_payload

__all__ = [
    "SdcwatchCollector",
    "MetricsServer",
    "METRICS",
    "STATS",
    "MetricSpec",
    "metric",
    "DEFAULT_TOP_K",
    "DEFAULT_LAYER_STATS",
    "DEFAULT_METRICS_ADDRESS",
    "DEFAULT_METRICS_PORT",
    "AlertmanagerSink",
    "alert_for",
    "alertname_for",
    "WebhookSink",
    "webhook_payload",
    "LogSink",
    "Backoff",
    "DeliveryError",
    "post_json",
]
