"""The demo's /metrics endpoint when two demos start at once: each binds its own port (the default,
9400, goes to at most one; the other takes a free one), where choosing a port before binding it
let both choose 9400 and the second fail with "Address already in use"."""

from __future__ import annotations

import io
import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from sdcwatch.demo.service import DemoService, EventLog  # noqa: E402


def test_two_demos_started_together_each_serve_metrics_on_their_own_port(bootstrap, tmp_path):
    services = [
        DemoService(
            bootstrap,
            state_dir=tmp_path / name,
            records_path=tmp_path / f"{name}.jsonl",
            metrics_port=0,
            guard=False,
            events=EventLog(io.StringIO(), quiet=True),
        )
        for name in ("first", "second")
    ]
    started = []
    try:
        for service in services:  # both built before either binds: the two demos' race
            service.start_metrics()
            service.start()
            started.append(service)
        ports = [service.metrics.port for service in services]
        assert ports[0] != ports[1] and 0 not in ports
        for service in services:
            with urllib.request.urlopen(service.metrics.url, timeout=30) as response:
                assert response.status == 200
                assert b"sdcwatch_" in response.read()
    finally:
        for service in started:
            service.stop()
