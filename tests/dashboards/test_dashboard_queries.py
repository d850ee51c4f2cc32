"""Every PromQL expression of the dashboard and of the alert rules, evaluated by a real Prometheus
that scrapes the real exporter: each must evaluate without error and return data."""

from __future__ import annotations

import json
import re

import pytest
import yaml

import sdcwatch_exporter_test_support as support  # registered by conftest.py

DASHBOARDS = support.DASHBOARDS

pytestmark = pytest.mark.integration

#: What Grafana would put in place of the template and built-in variables.
SUBSTITUTIONS = {
    "${datasource}": "prometheus",
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1m",
    "${run}": "r1",
    "$run": "r1",
}


def substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, expr) for every query in the committed dashboard: panel targets and annotations."""
    model = json.loads((DASHBOARDS / "sdcwatch.json").read_text())
    found = []
    for panel in model["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for annotation in model["annotations"]["list"]:
        if "expr" in annotation:
            found.append((f"annotation {annotation['name']!r}", annotation["expr"]))
    return found


def variable_queries() -> list[tuple[str, str, str]]:
    """(name, series expr, label) of every ``label_values(expr, label)`` template variable."""
    model = json.loads((DASHBOARDS / "sdcwatch.json").read_text())
    out = []
    for var in model["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
            assert m, f"variable {var['name']}: unsupported query {var['query']!r}"
            out.append((var["name"], m.group(1), m.group(2)))
    return out


def rule_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load((DASHBOARDS / "rules" / "sdcwatch.rules.yml").read_text())
    return [(rule["alert"], rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


def test_the_dashboard_has_the_panels_the_issue_asks_for():
    titles = " | ".join(where for where, _ in dashboard_expressions()).lower()
    for needed in ("loss", "gradient norm", "spike", "rank-outlier", "attention entropy", "q/k norms",
                   "open incidents", "records per second", "consumer lag", "annotation"):
        assert needed in titles, f"no panel or annotation about {needed!r}"
    assert len(dashboard_expressions()) >= 15


def test_prometheus_scrapes_the_exporter_and_sees_the_incident_rank(troubled_prometheus):
    prometheus, _ = troubled_prometheus
    up = support.prom_query(prometheus.base_url, 'up{job="sdcwatch"}')
    assert [s["value"][1] for s in up] == ["1"]
    ranks = support.prom_query(prometheus.base_url, 'topk(1, sdcwatch_rank_outlier_score{run="r1"})')
    assert ranks[0]["metric"]["rank"] == "5" and ranks[0]["metric"]["host"] == "h2"
    info = support.prom_query(prometheus.base_url, 'sdcwatch_incident_info{state="open"}')
    assert {(s["metric"]["kind"], s["metric"]["rank"]) for s in info} == {("sdc_suspected", "5")}


@pytest.mark.parametrize("where,expr", dashboard_expressions())
def test_dashboard_query_returns_data(troubled_prometheus, where, expr):
    prometheus, _ = troubled_prometheus
    result = support.prom_query(prometheus.base_url, substitute(expr))
    assert result, f"{where}: {expr!r} returned no data"


@pytest.mark.parametrize("name,series,label", variable_queries())
def test_template_variable_finds_the_run(troubled_prometheus, name, series, label):
    prometheus, _ = troubled_prometheus
    values = {s["metric"].get(label) for s in support.prom_query(prometheus.base_url, substitute(series))}
    assert "r1" in values, f"variable ${name}: {series} has no {label} label values"


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
