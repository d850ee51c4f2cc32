"""Every PromQL expression of the dashboard and of the alert rules, evaluated by a real Prometheus
that scrapes the real exporter: each must evaluate without error and return data."""

from __future__ import annotations

import pytest

import sdcwatch_exporter_test_support as support  # registered by conftest.py

pytestmark = pytest.mark.integration

substitute = support.substitute
dashboard_expressions = support.dashboard_expressions
variable_queries = support.variable_queries
rule_expressions = support.rule_expressions


def test_the_dashboard_has_the_panels_the_issue_asks_for():
    titles = " | ".join(where for where, _ in dashboard_expressions()).lower()
    for needed in (
        "loss",
        "gradient norm",
        "spike",
        "rank-outlier",
        "attention entropy",
        "q/k norms",
        "open incidents",
        "records per second",
        "consumer lag",
        "annotation",
    ):
        assert needed in titles, f"no panel or annotation about {needed!r}"
    assert len(dashboard_expressions()) >= 15


def test_prometheus_scrapes_the_exporter_and_sees_the_incident_rank(troubled_prometheus):
    prometheus, _ = troubled_prometheus
    up = support.prom_query(prometheus.base_url, 'up{job="sdcwatch"}')
    assert [s["value"][1] for s in up] == ["1"]
    ranks = support.prom_query(prometheus.base_url, 'topk(1, sdcwatch_rank_outlier_score{run="r1"})')
    assert ranks[0]["metric"]["rank"] == "5" and ranks[0]["metric"]["host"] == "h2"
    info = support.prom_query(prometheus.base_url, 'sdcwatch_incident_info{state="open"}')
    assert {(s["metric"]["kind"], s["metric"]["rank"]) for s in info} == {("sdc_suspected", "5"), ("nonfinite", "2")}


@pytest.mark.parametrize("where,expr", dashboard_expressions())
def test_dashboard_query_returns_data(troubled_prometheus, where, expr):
    prometheus, _ = troubled_prometheus
    result = support.prom_query(prometheus.base_url, substitute(expr))
    assert result, f"{where}: {expr!r} returned no data"


@pytest.mark.parametrize("name,series,label", [v for v in variable_queries() if v[0] != "piece"])
def test_template_variable_finds_the_run(troubled_prometheus, name, series, label):
    prometheus, _ = troubled_prometheus
    values = {s["metric"].get(label) for s in support.prom_query(prometheus.base_url, substitute(series))}
    assert "r1" in values, f"variable ${name}: {series} has no {label} label values"


def test_a_plain_data_parallel_run_has_one_piece_without_a_label(troubled_prometheus):
    """The $piece variable lists nothing for it, and its statistics keep their series (no piece
    label); the panels' All value (.*) still shows them. Pieces of a 3D run: tests/exporters/test_pieces.py."""
    prometheus, _ = troubled_prometheus
    ((name, series, label),) = [v for v in variable_queries() if v[0] == "piece"]
    found = support.prom_query(prometheus.base_url, substitute(series))
    assert found and {s["metric"].get(label) for s in found} == {None}
    shown = support.prom_query(prometheus.base_url, 'sdcwatch_rank_metric{run="r1", piece=~".*"}')
    assert len(shown) == len(found)


@pytest.mark.parametrize("alert,expr", rule_expressions())
def test_rule_expression_returns_data_on_a_troubled_service(troubled_prometheus, alert, expr):
    prometheus, _ = troubled_prometheus
    result = support.prom_query(prometheus.base_url, expr)
    assert result, f"rule {alert}: {expr!r} returned no data although its condition holds"


def test_prometheus_loads_the_rules_and_fires_the_sdc_alert_for_rank_5(troubled_prometheus):
    prometheus, _ = troubled_prometheus
    groups = support.http_json(f"{prometheus.base_url}/api/v1/rules")["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {r["name"] for r in rules} == {alert for alert, _ in rule_expressions()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

    def sdc_alerts():
        alerts = support.http_json(f"{prometheus.base_url}/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "SdcwatchSdcSuspected" and a["state"] == "firing"]

    firing = support.wait_for(sdc_alerts, timeout=15, what="SdcwatchSdcSuspected firing")
    assert [(a["labels"]["rank"], a["labels"]["host"]) for a in firing] == [("5", "h2")]
