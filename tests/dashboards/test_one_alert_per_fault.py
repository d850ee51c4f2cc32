"""One fault, one notification: the shipped alert rules and Alertmanager config, with a real
Prometheus scraping the real exporter and a real Alertmanager fed by the service's own sink.

Before, each incident the service pushed (with its rank) came again 16-20 s later as a rule-based
alert without a rank (SdcwatchNonFiniteValues, SdcwatchSdcSuspected, SdcwatchLossSpikeScoreHigh,
SdcwatchRanksMissing), to another receiver."""

from __future__ import annotations

import threading
import time

import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py
import yaml

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")

RUN = "one-fault"


def _longest_group_wait(config: dict) -> float:
    """Seconds: the longest group_wait of the shipped route tree (what a second alert would wait)."""
    waits = []

    def visit(route: dict, inherited: str) -> None:
        wait = route.get("group_wait", inherited)  # a child route takes its parent's
        waits.append(float(wait.rstrip("s")))
        for child in route.get("routes", ()):
            visit(child, wait)

    visit(config["route"], "30s")  # Alertmanager's default
    return max(waits)


def _firing(receiver: support.Receiver) -> list[tuple[str, dict]]:
    """(receiver path, notification) of every firing notification about the run."""
    return [
        (path, body)
        for path, body in receiver.received()
        if body["status"] == "firing" and any(a["labels"].get("run") == RUN for a in body["alerts"])
    ]


@pytest.mark.slow
def test_one_fault_is_one_notification_with_its_rank(start_prometheus, tmp_path):
    from sdcwatch.exporters import AlertmanagerSink, Backoff, MetricsServer
    from memory_source import MemorySource
    from sdcwatch.service.loop import DetectorService
    from sdcwatch.service.pipeline import DetectionPipeline
    from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport
    from sdcwatch.testbed.faultspec import FaultSpec
    from sdcwatch.testbed.model import GPTConfig
    from sdcwatch.testbed.simulated import SimulatedRun, shared_corpus

    torch.set_num_threads(1)
    receiver = support.Receiver()
    config = support.shipped_alertmanager_config(receiver.url)
    alertmanager = support.start_alertmanager_with(tmp_path / "alertmanager", config)
    bus = MemoryBus()
    sink = AlertmanagerSink(alertmanager.base_url, backoff=Backoff(initial=0.1, maximum=0.5))
    service = DetectorService(MemorySource(bus), DetectionPipeline(), sinks=[sink], poll_timeout=0.05)
    stop = threading.Event()
    thread = threading.Thread(target=service.run_forever, args=(stop,), daemon=True)
    exporter = MetricsServer(service.view, port=0).start()
    rules = support.DASHBOARDS / "rules" / "sdcwatch.rules.yml"
    prometheus = start_prometheus(f"127.0.0.1:{exporter.port}", [rules], alertmanager=alertmanager.base_url)
    thread.start()
    try:
        # a NaN in block 1's MLP on rank 1 at step 30; the update is skipped, so it stays one fault
        fault = FaultSpec.from_dict({"kind": "nan", "rank": 1, "step": 30, "target": "blocks.1.mlp.fc", "seed": 0})
        run = SimulatedRun(
            world=4,
            seed=1,
            model=GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4),
            batch_size=2,
            corpus=shared_corpus(1 << 18),
            faults=[fault],
            skip_nonfinite=True,
            # a live run: no end-of-run markers, so its incident stays open (and its alert firing)
            emitter_factory=lambda rank: Emitter(MemoryTransport(bus), run=RUN, rank=rank, world=4, end_marker=False),
        )
        run.train(40)
        run.close()
        for em in run.emitters:
            em.close()

        seen = f'sdcwatch_incident_info{{run="{RUN}"}}'
        support.wait_for(
            lambda: support.prom_query(prometheus.base_url, seen), timeout=30, what="the incident in Prometheus"
        )
        # a rule alerting on it would fire at the next evaluation (1 s) and be notified within the
        # longest group_wait of the shipped routes: wait that long, and a few evaluations more
        quiet_until = time.monotonic() + 1.0 + _longest_group_wait(config) + 4.0
        support.wait_for(lambda: _firing(receiver), timeout=15, what="the pushed alert's notification")
        while time.monotonic() < quiet_until:
            time.sleep(0.25)

        incidents = [inc for inc in service.view().incidents if inc.run == RUN]
        assert [(inc.kind, inc.ranks, inc.metric, inc.layer) for inc in incidents] == [
            ("nonfinite", (1,), "stream_max", 1)
        ]
        notified = _firing(receiver)
        assert len(notified) == 1, [(path, [a["labels"] for a in body["alerts"]]) for path, body in notified]
        path, body = notified[0]
        (alert,) = body["alerts"]
        assert path == "/infra-oncall"  # critical, non-finite: the on-call who can drain the host
        labels = alert["labels"]
        assert labels["alertname"] == "SdcwatchNonfinite" and labels["source"] == "sdcwatch"
        assert (labels["run"], labels["rank"], labels["kind"], labels["incident"]) == (
            RUN,
            "1",
            "nonfinite",
            incidents[0].id,
        )
        # and Prometheus itself holds no alert about the run: the rules watch the service, not its incidents
        alerts = support.http_json(f"{prometheus.base_url}/api/v1/alerts")["data"]["alerts"]
        assert not [a for a in alerts if a["labels"].get("run") == RUN]
        groups = support.http_json(f"{prometheus.base_url}/api/v1/rules")["data"]["groups"]
        assert all(r["health"] == "ok" for g in groups for r in g["rules"])
        assert {r["name"] for g in groups for r in g["rules"]} == {a for a, _ in support.rule_expressions()}
        assert yaml.safe_load(rules.read_text())["groups"]  # the shipped file was loaded, not an empty one
    finally:
        stop.set()
        thread.join(10)
        sink.close()
        exporter.close()
        alertmanager.stop()
        receiver.close()
