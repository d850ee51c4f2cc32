"""/metrics shows a series per suspect or quarantined host only, at most metrics.max_hosts worst
first (the rest counted as omitted), and the counts of hosts tracked and flagged."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import PipelineView, ServiceView
from sdcwatch.exporters import SdcwatchCollector
from sdcwatch.service.hosts import HostVerdict


def _verdict(host: str, verdict: str, score: float) -> HostVerdict:
    runs = ("a", "b", "c") if verdict != "clean" else ()
    return HostVerdict(host, verdict, score, runs, ("checksum",), 4, 100.0 if runs else 0.0, ())


def _scrape(hosts: list[HostVerdict], **options) -> dict:
    view = ServiceView(runs=[], pipeline=PipelineView(), incidents=[], incidents_total={}, findings_total={})
    view.hosts = hosts
    registry = CollectorRegistry()
    registry.register(SdcwatchCollector(lambda: view, **options))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


FLEET = [  # worst first, as the ledger lists them
    _verdict("node17", "quarantine", 3.4),
    _verdict("node09", "suspect", 1.8),
    _verdict("node04", "suspect", 1.6),
    _verdict("node11", "cleared", 0.0),
    *(_verdict(f"node{i:02d}", "clean", 0.1) for i in range(20, 60)),
]


def test_only_flagged_hosts_get_a_series_and_the_counts_cover_every_host():
    fam = _scrape(FLEET)
    series = {(s.labels["host"], s.labels["verdict"]): s.value for s in fam["sdcwatch_host_verdict"].samples}
    assert series == {("node17", "quarantine"): 1.0, ("node09", "suspect"): 1.0, ("node04", "suspect"): 1.0}
    assert [s.value for s in fam["sdcwatch_hosts_tracked"].samples] == [44.0]
    assert [s.value for s in fam["sdcwatch_hosts_suspect"].samples] == [3.0]
    omitted = {s.labels["what"]: s.value for s in fam["sdcwatch_exporter_omitted"].samples}
    assert omitted["hosts"] == 0.0


def test_flagged_hosts_past_the_bound_are_counted_not_exported():
    fam = _scrape(FLEET, max_hosts=2)
    assert [s.labels["host"] for s in fam["sdcwatch_host_verdict"].samples] == ["node17", "node09"]
    assert [s.value for s in fam["sdcwatch_hosts_suspect"].samples] == [3.0]
    omitted = {s.labels["what"]: s.value for s in fam["sdcwatch_exporter_omitted"].samples}
    assert omitted["hosts"] == 1.0
    none = _scrape(FLEET, max_hosts=0)
    assert "sdcwatch_host_verdict" not in none
    assert [s.value for s in none["sdcwatch_hosts_suspect"].samples] == [3.0]


def test_a_negative_bound_is_refused_naming_the_setting():
    with pytest.raises(ConfigError, match="metrics.max_hosts"):
        SdcwatchCollector(lambda: None, max_hosts=-1)
