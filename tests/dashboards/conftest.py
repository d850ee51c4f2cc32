"""Fixtures for the dashboard tests: the exporter serving a troubled service, scraped by a real
Prometheus that also evaluates the alert rules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_support():
    name = "sdcwatch_exporter_test_support"
    if name not in sys.modules:
        path = REPO / "tests" / "exporters" / "_support.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


support = _load_support()


@pytest.fixture(scope="session")
def troubled_prometheus(tmp_path_factory):
    """(prometheus server, service view) once Prometheus has scraped the exporter a few times.

    The view is :class:`TroubledService`: every alert condition holds, every panel has data.
    """
    from sdcwatch.exporters import MetricsServer

    service = support.TroubledService()
    exporter = MetricsServer(service, port=0).start()
    prometheus = support.start_prometheus(
        tmp_path_factory.mktemp("prometheus"),
        f"127.0.0.1:{exporter.port}",
        rule_files=[support.DASHBOARDS / "rules" / "sdcwatch.rules.yml"],
    )
    try:
        # enough samples for rate()/increase() over short windows
        support.wait_for(
            lambda: support.prom_query(
                prometheus.base_url, "count_over_time(sdcwatch_pipeline_records_total[1m]) >= 4"
            ),
            timeout=40,
            what="four scrapes of the exporter",
        )
        yield prometheus, service
    finally:
        prometheus.stop()
        exporter.close()


@pytest.fixture
def start_prometheus(tmp_path):
    """Factory: ``start_prometheus("127.0.0.1:PORT", rule_files=[...], alertmanager=URL)`` -> a
    running Prometheus (scrape and evaluation every second, own storage in tmp_path, its alerts
    sent to ``alertmanager`` when given), stopped after the test. For end-to-end tests that serve
    their own exporter."""
    started = []

    def start(scrape_target: str, rule_files=(), alertmanager=None):
        workdir = tmp_path / f"prometheus-{len(started)}"
        server = support.start_prometheus(workdir, scrape_target, list(rule_files), alertmanager)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
