"""The monitoring stack's files, shipped in the wheel as ``sdcwatch.dashboards``: the Grafana dashboard
and provisioning, the Prometheus config, alert rules and their promtool tests, the Alertmanager
routing. ``sdcwatch stack export DIR`` writes them out; ``generate.py`` is the dashboard's source."""
