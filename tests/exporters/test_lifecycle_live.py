"""The run lifecycle end to end: emitters on the real broker, `sdcwatch serve`, a real Alertmanager
(the alerts the service pushes: the only incident alerts) and a real Prometheus evaluating the
shipped rules (the service's own health: here its stall)."""

from __future__ import annotations

import urllib.parse
import uuid

import numpy as np
import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py
from serve_process import ServeProcess, Topics, scrape_text

pytestmark = pytest.mark.integration

STALL_AFTER = 6  # seconds, in place of the rule's 600 so the test need not wait ten minutes
# the finished run is dropped END_EXPIRY after its end: time enough (over 10 s) for Prometheus to see
# the silent run stall and the finished one as old first; the silent run is dropped IDLE_EXPIRY after
# its last step, over 10 s after the finished one
END_EXPIRY = 18.0
IDLE_EXPIRY = 36.0


def stall_rules(tmp_path):
    """The shipped rules with the stall threshold and its `for` shortened; nothing else changed."""
    text = (support.DASHBOARDS / "rules" / "sdcwatch.rules.yml").read_text()
    head, stall = text.split("- alert: SdcwatchPipelineStalled", 1)
    assert "sdcwatch_pipeline_last_step_age_seconds) > 600" in stall and "for: 1m" in stall
    stall = stall.replace(
        "sdcwatch_pipeline_last_step_age_seconds) > 600", f"sdcwatch_pipeline_last_step_age_seconds) > {STALL_AFTER}", 1
    )
    stall = stall.replace("for: 1m", "for: 0s", 1)
    path = tmp_path / "sdcwatch.rules.yml"
    path.write_text(head + "- alert: SdcwatchPipelineStalled" + stall)
    return path


def am_alerts(base: str, **filters: str) -> list[dict]:
    query = urllib.parse.urlencode([("filter", f'{k}="{v}"') for k, v in filters.items()])
    return support.http_json(f"{base}/api/v2/alerts?{query}")


def prom_alerts(base: str, alertname: str, run: str) -> list[dict]:
    alerts = support.http_json(f"{base}/api/v1/alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == alertname and a["labels"].get("run") == run]


def emit_run(bootstrap, topic, run, *, world=2, steps=30, nan_step=20, nan_rank=1):
    from sdcwatch.telemetry import Emitter, KafkaTransport

    rng = np.random.default_rng(len(run))
    emitters = [
        Emitter(KafkaTransport(bootstrap, topic), run=run, rank=r, world=world, host=f"h{r}") for r in range(world)
    ]
    for step in range(steps):
        for r, em in enumerate(emitters):
            loss = float("nan") if (step, r) == (nan_step, nan_rank) else 2.0 + 0.01 * rng.normal()
            em.emit(step, loss=loss, grad_norm_global=1.0, step_time=0.1)
    for em in emitters:
        assert em.flush(30)
    return emitters


@pytest.mark.slow
def test_finished_run_resolves_in_alertmanager_and_never_stalls_while_a_silent_run_stalls_and_ages_out(
    bootstrap, alertmanager, tmp_path
):
    tag = uuid.uuid4().hex[:8]
    ended, silent = f"ended-{tag}", f"silent-{tag}"
    topics = Topics.fresh(tag)
    topic = topics.telemetry
    serve = ServeProcess(
        bootstrap,
        topics,
        tmp_path / "state",
        "--alerts-alertmanager-url",
        alertmanager.base_url,
        "--detectors-run-end-expiry-s",
        str(END_EXPIRY),
        "--detectors-run-idle-expiry-s",
        str(IDLE_EXPIRY),
        group=f"g-{tag}",
    )
    prometheus = None
    try:
        metrics = serve.wait_banner()
        target = urllib.parse.urlsplit(metrics).netloc
        prometheus = support.start_prometheus(tmp_path / "prometheus", target, [stall_rules(tmp_path)])
        ended_emitters = emit_run(bootstrap, topic, ended)
        silent_emitters = emit_run(bootstrap, topic, silent)
        for run in (ended, silent):  # the service pushes each run's non-finite incident
            support.wait_for(
                lambda run=run: am_alerts(alertmanager.base_url, alertname="SdcwatchNonfinite", run=run),
                timeout=60,
                what=f"the non-finite alert of {run} in Alertmanager",
            )

        for em in ended_emitters:  # a normal end: every rank sends its end-of-run marker
            em.close()
            assert em.ended
        for em in silent_emitters:  # the other run's ranks just go away
            em.close(end_run=False)
            assert not em.ended

        # the finished run's incident is resolved in Alertmanager; the silent run's stays open
        support.wait_for(
            lambda: not am_alerts(alertmanager.base_url, alertname="SdcwatchNonfinite", run=ended),
            timeout=30,
            what="the finished run's alert to be resolved",
        )

        def notified(status, run):
            return [
                a
                for body in alertmanager.notifications.snapshot()
                if body["status"] == status
                for a in body["alerts"]
                if a["labels"].get("run") == run
            ]

        support.wait_for(lambda: notified("resolved", ended), timeout=30, what="a resolved notification")
        assert am_alerts(alertmanager.base_url, alertname="SdcwatchNonfinite", run=silent)
        assert f'sdcwatch_training_run_finished{{run="{ended}"}} 1.0' in scrape_text(metrics)
        assert f'sdcwatch_training_run_finished{{run="{silent}"}} 0.0' in scrape_text(metrics)

        # the silent run stalls; the finished one, whose last step is just as old, does not
        support.wait_for(
            lambda: [
                a for a in prom_alerts(prometheus.base_url, "SdcwatchPipelineStalled", silent) if a["state"] == "firing"
            ],
            timeout=40,
            what="the silent run's stall alert",
        )
        support.wait_for(  # Prometheus's last scrape may be older than the alert's evaluation
            lambda: support.prom_query(
                prometheus.base_url, f'sdcwatch_pipeline_last_step_age_seconds{{run="{ended}"}} > {STALL_AFTER}'
            ),
            timeout=20,
            what="the finished run's last step as old as the silent one's",
        )
        assert prom_alerts(prometheus.base_url, "SdcwatchPipelineStalled", ended) == []
        # the incidents follow sdcwatch's lifecycle (the finished run's resolved, the silent run's
        # open) and only the service alerts on them (above, in Alertmanager): Prometheus raises the
        # silent run's stall and nothing about either incident (it used to raise each again)
        assert support.prom_query(
            prometheus.base_url, f'sdcwatch_incidents_open{{run="{silent}", kind="nonfinite"}} == 1'
        )
        assert not support.prom_query(prometheus.base_url, f'sdcwatch_incidents_open{{run="{ended}"}} > 0')
        alerts = support.http_json(f"{prometheus.base_url}/api/v1/alerts")["data"]["alerts"]
        about = {
            (a["labels"]["alertname"], a["labels"]["run"]) for a in alerts if a["labels"].get("run") in (ended, silent)
        }
        assert about == {("SdcwatchPipelineStalled", silent)}

        # the end expiry drops the finished run's series; the silent one is still shown
        support.wait_for(
            lambda: f'run="{ended}"' not in scrape_text(metrics),
            timeout=END_EXPIRY + 20,
            what="the finished run's series to go",
        )
        text = scrape_text(metrics)
        assert f'run="{silent}"' in text
        assert 'sdcwatch_pipeline_runs_evicted_total{reason="finished"} 1.0' in text

        # the idle expiry evicts the silent run and resolves its incident in Alertmanager
        support.wait_for(
            lambda: f'run="{silent}"' not in scrape_text(metrics),
            timeout=IDLE_EXPIRY + 20,
            what="the idle run's series to go",
        )
        assert 'sdcwatch_pipeline_runs_evicted_total{reason="idle"} 1.0' in scrape_text(metrics)
        support.wait_for(
            lambda: not am_alerts(alertmanager.base_url, alertname="SdcwatchNonfinite", run=silent),
            timeout=30,
            what="the idle run's alert to be resolved",
        )
        assert serve.running()  # the service is still up
    finally:
        if prometheus is not None:
            prometheus.stop()
        serve.close()
