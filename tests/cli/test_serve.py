"""`sdcwatch serve` as a subprocess against the real broker: detects, stops on SIGTERM, resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from sdcwatch.broker import free_port

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")


def start_serve(bootstrap, topics, state_dir, group, extra=()):
    cmd = [
        sys.executable,
        "-m",
        "sdcwatch.cli",
        "serve",
        "--bus-bootstrap",
        bootstrap,
        "--bus-telemetry-topic",
        topics["telemetry"],
        "--bus-anomalies-topic",
        topics["anomalies"],
        "--bus-deadletter-topic",
        topics["dead"],
        "--bus-group",
        group,
        "--metrics-port",
        "0",
        "--state-dir",
        str(state_dir),
        "--state-snapshot-interval-s",
        "1",
        "--no-alerts-log",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc


def wait_banner(proc, timeout=30):
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if line.startswith("sdcwatch serve: consuming"):
            return line
        if proc.poll() is not None:
            break
    raise AssertionError(f"serve did not start: {line!r} {proc.stderr.read()[-2000:]}")


def peek_anomalies(bootstrap, topic, timeout=2.0):
    """What the anomalies topic holds now (no consumer group, so no join to wait for)."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=[bootstrap],
        auto_offset_reset="earliest",
        group_id=None,
        consumer_timeout_ms=int(timeout * 1000),
    )
    out = [json.loads(m.value) for m in consumer]
    consumer.close()
    return out


def scrape(metrics_url) -> dict[str, float]:
    """The service's unlabelled /metrics samples by name ({} while it is not serving yet)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return {}
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def wait_until(pred, timeout, what):
    """Poll ``pred`` until it is true; slow machines take longer, so the bound is generous."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_for_nonfinite_incident(bootstrap, topic, timeout):
    wait_until(
        lambda: any(e["kind"] == "nonfinite" for e in peek_anomalies(bootstrap, topic)),
        timeout,
        f"a non-finite incident on {topic}",
    )


def wait_taken(metrics_url, records, timeout=90.0):
    """Wait until the service has taken ``records`` distinct records (duplicates do not count)."""

    def taken():
        m = scrape(metrics_url)
        return m.get("sdcwatch_pipeline_records_total", 0) - m.get("sdcwatch_pipeline_duplicates_total", 0)

    wait_until(lambda: taken() >= records, timeout, f"the service to take {records} records")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    err = proc.stderr.read()
    assert code == 0, err[-3000:]
    return err


def test_serve_detects_stops_on_sigterm_and_resumes_without_repeating_alerts(bootstrap, tmp_path):
    from sdcwatch.telemetry import Emitter, KafkaTransport
    from sdcwatch.telemetry.faults import FaultSpec
    from sdcwatch.testbed.simulated import SimulatedRun

    torch.set_num_threads(1)
    tag = uuid.uuid4().hex[:8]
    topics = {"telemetry": f"tel.{tag}", "anomalies": f"anom.{tag}", "dead": f"dead.{tag}"}
    group = f"serve-{tag}"
    state = tmp_path / "state"
    world = 4
    nan_step = 40
    fault = FaultSpec.from_dict(
        {
            "kind": "nan",
            "rank": 2,
            "step": nan_step,
            "duration": 1,
            "target": "blocks.0.attn.scores",
            "where": "output",
            "seed": 1,
        }
    )
    emitters = []

    def factory(rank, host=""):
        em = Emitter(
            KafkaTransport(bootstrap, topics["telemetry"]), run=f"serve-{tag}", rank=rank, world=world, host=host or "h"
        )
        emitters.append(em)
        return em

    metrics = ["--metrics-port", str(free_port())]
    proc = start_serve(bootstrap, topics, state, group, metrics)
    metrics_url = re.search(r"metrics (http://\S+);", wait_banner(proc)).group(1)
    run = SimulatedRun(world=world, seed=3, faults=[fault], emitter_factory=factory, batch_size=4)
    run.train(nan_step + 5)
    for em in emitters:
        assert em.flush(30)
    # the service has read every record sent, and the incident is on the anomalies topic
    wait_taken(metrics_url, sum(em.sent for em in emitters))
    wait_for_nonfinite_incident(bootstrap, topics["anomalies"], 60)
    err = stop(proc)
    assert "stopped" in err
    assert (state / "pipeline-state.json").exists()
    first = peek_anomalies(bootstrap, topics["anomalies"])
    opened = [e for e in first if e["change"] == "opened"]
    nonfinite = [e for e in opened if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0]["first_step"] == nan_step
    assert nonfinite[0]["ranks"] == [2]  # the other ranks only saw the all-reduced NaN

    # restart: the same group and state; the ranks go on training (NaN persists in the model)
    metrics = ["--metrics-port", str(free_port())]
    proc = start_serve(bootstrap, topics, state, group, metrics)
    banner = wait_banner(proc)
    assert "resumed" in banner
    metrics_url = re.search(r"metrics (http://\S+);", banner).group(1)
    run.train(10)
    run.close()
    for em in emitters:
        em.close(30)
    # records_total is restored from the state, so this counts both lives of the service
    wait_taken(metrics_url, sum(em.sent for em in emitters))
    stop(proc)
    after = peek_anomalies(bootstrap, topics["anomalies"])
    opened_ids = [e["id"] for e in after if e["change"] == "opened"]
    assert len(opened_ids) == len(set(opened_ids)), "an incident was opened twice"
    assert [e["id"] for e in after if e["change"] == "opened" and e["kind"] == "nonfinite"] == [nonfinite[0]["id"]]


def test_serve_config_error_names_the_key(tmp_path):
    bad = tmp_path / "serve.toml"
    bad.write_text('[alerts]\nalertmanger_url = "http://am:9093"\n')
    out = subprocess.run(
        [sys.executable, "-m", "sdcwatch.cli", "serve", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "alerts.alertmanger_url" in out.stderr and "alertmanager_url" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "sdcwatch.cli", "serve", "--metrics-port", "http"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert out.returncode == 2 and "metrics.port" in out.stderr


class StderrLines:
    """Collects a process's stderr lines in the background (to wait for a line without blocking)."""

    def __init__(self, proc) -> None:
        import threading

        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stderr.readline, "")), daemon=True)
        self._thread.start()

    def wait_for(self, pred, timeout=60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if pred(line):
                    return line
            time.sleep(0.1)
        raise AssertionError(f"no such line in {self.lines[-20:]}")

    def joined(self) -> str:
        self._thread.join(10)
        return "".join(self.lines)


def test_split_service_spatial_instances_share_the_steps_and_the_temporal_stage_names_the_rank(bootstrap, tmp_path):
    """Two spatial instances in one consumer group, one temporal instance, all as `sdcwatch serve`."""
    from sdcwatch.telemetry import Emitter, KafkaTransport
    from sdcwatch.telemetry.faults import FaultSpec
    from sdcwatch.testbed.simulated import SimulatedRun
    from sdcwatch.telemetry.transports import ensure_topic

    torch.set_num_threads(1)
    tag = uuid.uuid4().hex[:8]
    topics = {"telemetry": f"tel.{tag}", "anomalies": f"anom.{tag}", "dead": f"dead.{tag}"}
    summaries = ["--bus-summaries-topic", f"sum.{tag}"]
    group = f"split-{tag}"
    world, steps, nan_step = 4, 64, 50
    # four partitions; the run's step windows (key run/step//16) of "split" fall in partitions 2, 0, 2, 1,
    # so either assignment of two partitions each gives both spatial instances whole steps to do
    assert ensure_topic(bootstrap, topics["telemetry"], 4)
    spatial = [
        start_serve(bootstrap, topics, tmp_path / f"spatial{i}", group, ["--stage", "spatial", *summaries])
        for i in range(2)
    ]
    temporal = start_serve(
        bootstrap,
        topics,
        tmp_path / "temporal",
        group,
        ["--stage", "temporal", *summaries, "--metrics-port", str(free_port())],
    )
    logs = [StderrLines(p) for p in (*spatial, temporal)]
    banners = [lg.wait_for(lambda line: line.startswith("sdcwatch serve: consuming")) for lg in logs]
    temporal_metrics = re.search(r"metrics (http://\S+);", banners[2]).group(1)
    for lg in logs[:2]:  # after the rebalance each spatial instance owns two partitions
        lg.wait_for(lambda line: re.search(r"assigned partitions \[\d+, \d+\] ", line) is not None)

    fault = FaultSpec.from_dict(
        {
            "kind": "nan",
            "rank": 2,
            "step": nan_step,
            "duration": 1,
            "target": "blocks.0.attn.scores",
            "where": "output",
            "seed": 1,
        }
    )
    run = SimulatedRun(
        world=world,
        seed=3,
        faults=[fault],
        batch_size=4,
        ranks_per_host=2,
        emitter_factory=lambda r, host: Emitter(
            KafkaTransport(bootstrap, topics["telemetry"]), run="split", rank=r, world=world, host=host
        ),
    )
    run.train(steps)
    run.close()
    assert [em.sent for em in run.emitters] == [steps] * world
    # consume, summarise, judge (slow machines take longer)
    wait_for_nonfinite_incident(bootstrap, topics["anomalies"], 90)
    for p in spatial:  # the spatial stage publishes what it holds on the way out
        p.send_signal(signal.SIGTERM)
    for p in spatial:
        assert p.wait(60) == 0
    outs = [lg.joined() for lg in logs[:2]]
    published = []
    for out in outs:
        line = next(ln for ln in out.splitlines() if ln.startswith("sdcwatch serve: stopped"))
        published.append(int(line.split("; ")[1].split()[0]))
    assert min(published) > 0, f"one spatial instance did no steps: {published}"
    assert sum(published) >= steps  # a rebalance may redeliver a window; the temporal stage drops repeats

    wait_until(
        lambda: scrape(temporal_metrics).get("sdcwatch_pipeline_summaries_total", 0) >= sum(published),
        60,
        f"the temporal stage to take the {sum(published)} published summaries",
    )
    temporal.send_signal(signal.SIGTERM)
    assert temporal.wait(60) == 0
    outs.append(logs[2].joined())
    assert f"after {sum(published)} step summaries" in outs[2]

    events = peek_anomalies(bootstrap, topics["anomalies"])
    opened = [e for e in events if e["change"] == "opened"]
    nonfinite = [e for e in opened if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1, opened
    assert (nonfinite[0]["first_step"], nonfinite[0]["ranks"], nonfinite[0]["hosts"]) == (
        nan_step,
        [2],
        [run.host_of(2)],
    )


def test_serve_with_guard_actions_publishes_decisions_to_the_control_topic(bootstrap, tmp_path):
    """[guard] actions = true wires the policy's sink; an incident becomes one decision that the
    training side's reader (KafkaControl) decodes; with the default config there is no such sink."""
    from sdcwatch.config import load_config
    from sdcwatch.detectors.control import ControlTopicSink
    from sdcwatch.core.incident import Incident, IncidentEvent, Severity
    from sdcwatch.serve import build_service
    from sdcwatch.telemetry.control import KafkaControl

    topic = f"control.{uuid.uuid4().hex[:8]}"
    base = {
        "bus.bootstrap": bootstrap,
        "metrics.port": 0,
        "state.dir": str(tmp_path / "s"),
        "alerts.log": False,
        "bus.telemetry_topic": f"t.{uuid.uuid4().hex[:8]}",
        "bus.control_topic": topic,
    }
    plain, _ = build_service(load_config(overrides=base, env={}))
    assert not any(isinstance(s, ControlTopicSink) for s in plain.sinks)
    plain.close()
    service, _ = build_service(
        load_config(overrides={**base, "guard.actions": True, "guard.on_silent_drift": "evict"}, env={})
    )
    (sink,) = [s for s in service.sinks if isinstance(s, ControlTopicSink)]
    assert sink.policy.actions and sink.policy.on_silent_drift == "evict"
    reader = KafkaControl(bootstrap, "r1", topic)
    try:
        assert reader.wait_ready(20)
        inc = Incident(
            id="r1:silent_drift:40:r5",
            run="r1",
            kind="silent_drift",
            severity=Severity.WARNING,
            first_step=40,
            last_step=45,
            message="drift",
            ranks=(5,),
            hosts=("h2",),
        )
        service._publish([IncidentEvent("opened", inc), IncidentEvent("updated", inc)])
        for s in service.sinks:
            s._flush()
        got = []
        wait_until(lambda: got.extend(reader.poll()) or got, 30, "the decision on the control topic")
        assert [(d.action, d.ranks, d.hosts, d.since_step) for d in got] == [("evict", (5,), ("h2",), 40)]
    finally:
        reader.close()
        service.close()
