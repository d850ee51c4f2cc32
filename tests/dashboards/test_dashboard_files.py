"""The committed dashboard, rules and configs: in sync with the generator, valid for the real
tools (promtool, amtool), and consistent with the exporter's metric catalogue."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py
import yaml
from sdcwatch.detectors.registry import detector_metrics
from sdcwatch.exporters import catalogue

DASHBOARDS = support.DASHBOARDS
CATALOGUE = {spec.name for spec in catalogue(detector_metrics())}
METRIC_NAME = re.compile(r"\bsdcwatch_[a-z_]+\b")


def run_tool(*args: str) -> subprocess.CompletedProcess:
    if shutil.which(args[0]) is None:
        pytest.skip(f"{args[0]} not installed (Debian packages prometheus, prometheus-alertmanager)")
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=DASHBOARDS)


def test_committed_dashboard_matches_the_generator():
    generator = support.load_generator()
    committed = (DASHBOARDS / "sdcwatch.json").read_text()
    assert committed == generator.render(), "dashboards/sdcwatch.json is stale: run python dashboards/generate.py"


def test_committed_readme_lists_the_catalogue_as_the_generator_does():
    generator = support.load_generator()
    readme = (DASHBOARDS / "README.md").read_text()
    assert readme == generator.render_readme(readme), "dashboards/README.md is stale: run python dashboards/generate.py"


@pytest.mark.parametrize("which", ["json", "readme"])
def test_generator_check_mode_flags_a_stale_file(tmp_path, which):
    generator = support.load_generator()
    stale, readme = tmp_path / "sdcwatch.json", tmp_path / "README.md"
    stale.write_text(generator.render())
    readme.write_text((DASHBOARDS / "README.md").read_text())
    if which == "json":
        stale.write_text(generator.render().replace("Global loss", "Global lost"))
    else:
        readme.write_text(readme.read_text().replace("| `sdcwatch_training_loss` |", "| `sdcwatch_training_lost` |"))
    paths = ["--output", str(stale), "--readme", str(readme)]
    assert generator.main(["--check", *paths]) == 1
    assert generator.main(paths) == 0
    assert generator.main(["--check", *paths]) == 0


def test_dashboard_model_has_variables_datasource_and_unique_panel_ids():
    model = json.loads((DASHBOARDS / "sdcwatch.json").read_text())
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["multi"] and variables["run"]["includeAll"]
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    for panel in model["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            if "run" in target["expr"] and 'run=~"$run"' not in target["expr"]:
                pytest.fail(f"panel {panel['title']!r} filters run without $run: {target['expr']}")


def test_dashboard_and_rules_use_only_catalogued_metrics():
    text = (DASHBOARDS / "sdcwatch.json").read_text() + (DASHBOARDS / "rules" / "sdcwatch.rules.yml").read_text()
    used = set(METRIC_NAME.findall(text)) - {"sdcwatch_incidents", "sdcwatch_overview"}
    unknown = {name for name in used if name not in CATALOGUE}
    assert not unknown, f"queries use metrics the exporter does not expose: {sorted(unknown)}"


def test_readme_documents_every_metric_and_alert():
    readme = (DASHBOARDS / "README.md").read_text()
    missing = [name for name in CATALOGUE if f"`{name}`" not in readme]
    assert not missing, f"dashboards/README.md does not document {missing}"
    rules = yaml.safe_load((DASHBOARDS / "rules" / "sdcwatch.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert f"`{rule['alert']}`" in readme, f"README does not document alert {rule['alert']}"


def test_promtool_check_rules():
    result = run_tool("promtool", "check", "rules", "rules/sdcwatch.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_promtool_rule_unit_tests_pass():
    result = run_tool("promtool", "test", "rules", "rules/sdcwatch.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_rule_has_a_unit_test_that_fires_it():
    rules = yaml.safe_load((DASHBOARDS / "rules" / "sdcwatch.rules.yml").read_text())
    tests = yaml.safe_load((DASHBOARDS / "rules" / "sdcwatch.rules.test.yml").read_text())
    fired = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if not case["exp_alerts"]}
    names = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    assert names <= fired, f"alerts never shown to fire: {sorted(names - fired)}"
    assert names <= quiet, f"alerts never shown quiet: {sorted(names - quiet)}"


def test_promtool_rule_tests_catch_a_broken_threshold(tmp_path):
    """The unit tests can fail: raise the lag threshold tenfold and they must."""
    rules = (DASHBOARDS / "rules" / "sdcwatch.rules.yml").read_text()
    broken = rules.replace(
        "clamp_min(sdcwatch_pipeline_records_per_second, 1) > 120",
        "clamp_min(sdcwatch_pipeline_records_per_second, 1) > 1200",
    )
    assert broken != rules
    (tmp_path / "sdcwatch.rules.yml").write_text(broken)
    shutil.copy(DASHBOARDS / "rules" / "sdcwatch.rules.test.yml", tmp_path)
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed")
    result = subprocess.run(
        ["promtool", "test", "rules", "sdcwatch.rules.test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "SdcwatchPipelineLagging" in result.stdout + result.stderr


def test_prometheus_example_config_is_valid_and_scrapes_the_default_port():
    result = run_tool("promtool", "check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    from sdcwatch.exporters import DEFAULT_METRICS_PORT

    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert f"127.0.0.1:{DEFAULT_METRICS_PORT}" in targets


def test_alertmanager_example_config_is_valid():
    result = run_tool("amtool", "check-config", "alertmanager.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard_folder():
    datasources = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources" / "datasource.yml").read_text())
    (ds,) = datasources["datasources"]
    assert datasources["apiVersion"] == 1 and ds["type"] == "prometheus" and ds["url"].startswith("http")
    providers = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards" / "dashboards.yml").read_text())
    (provider,) = providers["providers"]
    assert providers["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]


def test_no_rule_alerts_on_what_the_service_pushes():
    """One fault, one alert: the service pushes every incident (with its rank) to Alertmanager, so
    no rule reads the incident series or the signals a detector turns into an incident."""
    pushed = ("sdcwatch_incident", "sdcwatch_incidents_open", "sdcwatch_detector_spike_score", "missing_ranks")
    for alert, expr in support.rule_expressions():
        assert not any(name in expr for name in pushed), f"{alert} doubles a pushed incident: {expr}"
    config = yaml.safe_load((DASHBOARDS / "alertmanager.yml").read_text())
    routed = [m for route in config["route"].get("routes", ()) for m in route.get("matchers", ())]
    assert not [m for m in routed if "alertname=" in m], "a route for a rule alert that no longer exists"
