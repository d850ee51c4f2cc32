"""Where sdcwatch's results go: ``/metrics`` (:class:`SdcwatchCollector`, :class:`MetricsServer`)
and the incident sinks (Alertmanager, webhook, log, the bus's topics). Each name is imported on
first use, so the [metrics] settings are read without prometheus_client.
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
