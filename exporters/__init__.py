"""Prometheus collector and incident sinks (Alertmanager, webhook, log).

- :class:`SdcwatchCollector` / :class:`MetricsServer`: ``/metrics`` read from the detector
  service's :class:`~sdcwatch.core.incident.ServiceView` at scrape time (catalogue in
  :data:`METRICS`).
- :class:`AlertmanagerSink`, :class:`WebhookSink`, :class:`LogSink`: implementations of
  :class:`~sdcwatch.core.incident.IncidentSink`.
"""

from .alertmanager import AlertmanagerSink, alert_for, alertname_for
from .catalog import METRICS, STATS, MetricSpec, metric
from .collector import DEFAULT_LAYER_STATS, DEFAULT_MAX_LAYERS, DEFAULT_TOP_K, SdcwatchCollector, check_cardinality
from .delivery import Backoff, DeliveryError, post_json
from .logsink import LogSink
from .pieces import DEFAULT_MAX_PIECES
from .server import DEFAULT_METRICS_ADDRESS, DEFAULT_METRICS_PORT, MetricsServer, check_address, check_port
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
    "DEFAULT_MAX_LAYERS",
    "DEFAULT_MAX_PIECES",
    "check_cardinality",
    "DEFAULT_METRICS_ADDRESS",
    "DEFAULT_METRICS_PORT",
    "check_address",
    "check_port",
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
