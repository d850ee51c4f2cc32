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
        "residual stream",  # the every-step scan: stream_max, gemm_out; the checksums: gemm_fwd...
        "product outputs",
        "checksums",
        "caught by the scan and checksums",
        "guard actions",
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


#: Rules about the scrape itself: the troubled service is scraped, and reads its state; they are
#: shown to fire against a service that is not (test_the_service_rules_fire_when_the_scrape_fails).
ABOUT_THE_SCRAPE = ("SdcwatchServiceDown", "SdcwatchStateUnreadable")


@pytest.mark.parametrize("alert,expr", [r for r in rule_expressions() if r[0] not in ABOUT_THE_SCRAPE])
def test_rule_expression_returns_data_on_a_troubled_service(troubled_prometheus, alert, expr):
    prometheus, _ = troubled_prometheus
    result = support.prom_query(prometheus.base_url, expr)
    assert result, f"rule {alert}: {expr!r} returned no data although its condition holds"


def test_prometheus_loads_the_rules_and_leaves_the_incidents_to_the_service(troubled_prometheus):
    """Every incident open, a loss spike, missing ranks: no rule alerts on them (the service pushes
    each itself, with its rank); the pipeline's own trouble still alerts. Before, the rules raised
    SdcwatchSdcSuspected, SdcwatchNonFiniteValues and SdcwatchLossSpikeScoreHigh here."""
    prometheus, _ = troubled_prometheus
    groups = support.http_json(f"{prometheus.base_url}/api/v1/rules")["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {r["name"] for r in rules} == {alert for alert, _ in rule_expressions()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

    def dead_letters_firing():
        alerts = support.http_json(f"{prometheus.base_url}/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "SdcwatchDeadLetters" and a["state"] == "firing"]

    support.wait_for(dead_letters_firing, timeout=15, what="SdcwatchDeadLetters firing")
    alerts = support.http_json(f"{prometheus.base_url}/api/v1/alerts")["data"]["alerts"]
    raised = {a["labels"]["alertname"] for a in alerts}
    assert raised <= {
        "SdcwatchDeadLetters",
        "SdcwatchPipelineStalled",
        "SdcwatchPipelineLagging",
        "SdcwatchConsumerUnassigned",
        "SdcwatchStateNotSaved",
        "SdcwatchHostSuspect",  # a host's verdict across runs: no incident says it
    }
    assert not [a for a in alerts if "rank" in a["labels"] or "kind" in a["labels"]]
    hosts = {
        (a["labels"]["host"], a["labels"]["verdict"])
        for a in alerts
        if a["labels"]["alertname"] == "SdcwatchHostSuspect"
    }
    assert hosts == {("h2", "quarantine"), ("h1", "suspect")}


def test_the_service_rules_fire_when_the_scrape_fails(start_prometheus):
    """A service that cannot read its state, then one that cannot be scraped: what only Prometheus sees."""
    from sdcwatch.exporters import MetricsServer

    def broken():
        raise RuntimeError("the state is gone")

    exporter = MetricsServer(broken, port=0).start()
    prometheus = start_prometheus(
        f"127.0.0.1:{exporter.port}", rule_files=[support.DASHBOARDS / "rules" / "sdcwatch.rules.yml"]
    )
    base = prometheus.base_url

    def state(alertname):
        alerts = support.http_json(f"{base}/api/v1/alerts")["data"]["alerts"]
        return {a["state"] for a in alerts if a["labels"]["alertname"] == alertname}

    try:
        support.wait_for(
            lambda: "firing" in state("SdcwatchStateUnreadable"), timeout=20, what="StateUnreadable firing"
        )
    finally:
        exporter.close()
    support.wait_for(lambda: support.prom_query(base, 'up{job="sdcwatch"} == 0'), timeout=20, what="a failed scrape")
    support.wait_for(
        lambda: state("SdcwatchServiceDown") == {"pending"}, timeout=20, what="ServiceDown pending (for 2m)"
    )


def _panel(title: str) -> str:
    (expr,) = [e for where, e in dashboard_expressions() if where.startswith(f"panel {title!r}")]
    return substitute(expr)


def test_the_scan_panels_plot_stream_max_gemm_out_and_the_checksums(troubled_prometheus):
    prometheus, service = troubled_prometheus
    base = prometheus.base_url
    for title, metrics in (
        ("Residual stream per block (max over ranks)", {"stream_max"}),
        ("Product outputs (max over ranks)", {"gemm_out"}),
        ("Checksums: residual over its rounding bound (max over ranks)", {"gemm_fwd", "gemm_bwd", "gemm_weight"}),
    ):
        found = support.prom_query(base, _panel(title))
        assert {s["metric"]["metric"] for s in found} == metrics, title
        assert len(found) == len(metrics) * service.layers and {s["metric"]["stat"] for s in found} == {"max"}
    (caught,) = support.prom_query(base, _panel("Caught by the scan and checksums"))
    labels = caught["metric"]
    assert (labels["kind"], labels["rank"], labels["metric"], labels["layer"], labels["layer_name"]) == (
        "nonfinite",
        "2",
        "stream_max",
        "1",
        "blocks.1",
    )
    assert caught["value"][1] == "110"  # its first step


def test_the_guard_panel_names_its_actions(troubled_prometheus):
    prometheus, _ = troubled_prometheus
    found = support.prom_query(prometheus.base_url, _panel("Guard actions"))
    assert {s["metric"]["action"] for s in found} == {"skip"}  # no "no actions" line beside an action


def test_the_guard_panel_says_no_actions_when_the_guard_never_acted(start_prometheus):
    """Before: an empty result, which Grafana shows as "No data"."""
    from sdcwatch.exporters import MetricsServer

    view = support.small_view()
    view.findings_total = {("rank_outlier", "rank_outlier"): 7}  # no guard in this job
    exporter = MetricsServer(lambda: view, port=0).start()
    try:
        prometheus = start_prometheus(f"127.0.0.1:{exporter.port}")
        support.wait_for(
            lambda: support.prom_query(prometheus.base_url, "sdcwatch_pipeline_records_total"),
            timeout=40,
            what="a scrape",
        )
        found = support.prom_query(prometheus.base_url, _panel("Guard actions"))
        assert [(s["metric"], s["value"][1]) for s in found] == [({"action": "no actions"}, "0")]
        model = support.json.loads((support.DASHBOARDS / "sdcwatch.json").read_text())
        (panel,) = [p for p in model["panels"] if p["title"] == "Guard actions"]
        assert panel["fieldConfig"]["defaults"]["noValue"] == "no actions"  # and if Prometheus is away
    finally:
        exporter.close()
