"""Prometheus collector and incident sinks (Alertmanager, webhook, log)."""
