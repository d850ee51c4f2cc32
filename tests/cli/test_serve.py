"""`sdcwatch serve` as a subprocess against the real broker: detects, stops on SIGTERM, resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")


def start_serve(bootstrap, topics, state_dir, group, extra=()):
    cmd = [sys.executable, "-m", "sdcwatch.cli", "serve", "--bus-bootstrap", bootstrap,
           "--bus-telemetry-topic", topics["telemetry"], "--bus-anomalies-topic", topics["anomalies"],
           "--bus-deadletter-topic", topics["dead"], "--bus-group", group, "--metrics-port", "0",
           "--state-dir", str(state_dir), "--state-snapshot-interval-s", "1", "--no-alerts-log", *extra]
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


def read_anomalies(bootstrap, topic, timeout=8.0):
    from kafka import KafkaConsumer

    from sdcwatch.detectors.source import FAST_JOIN

    consumer = KafkaConsumer(topic, bootstrap_servers=[bootstrap], auto_offset_reset="earliest",
                             group_id=f"read-{uuid.uuid4().hex[:6]}", consumer_timeout_ms=int(timeout * 1000),
                             **FAST_JOIN)
    out = [json.loads(m.value) for m in consumer]
    consumer.close()
    return out


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    err = proc.stderr.read()
    assert code == 0, err[-3000:]
    return err


def test_serve_detects_stops_on_sigterm_and_resumes_without_repeating_alerts(bootstrap, tmp_path):
    from sdcwatch.telemetry import Emitter, KafkaTransport
    from sdcwatch.telemetry.faults import FaultSpec
    from sdcwatch.telemetry.reference.simulated import SimulatedRun

    torch.set_num_threads(1)
    tag = uuid.uuid4().hex[:8]
    topics = {"telemetry": f"tel.{tag}", "anomalies": f"anom.{tag}", "dead": f"dead.{tag}"}
    group = f"serve-{tag}"
    state = tmp_path / "state"
    world = 4
    nan_step = 40
    fault = FaultSpec.from_dict({"kind": "nan", "rank": 2, "step": nan_step, "duration": 1,
                                 "target": "blocks.0.attn.scores", "where": "output", "seed": 1})
    emitters = []

    def factory(rank, host=""):
        em = Emitter(KafkaTransport(bootstrap, topics["telemetry"]), run=f"serve-{tag}", rank=rank, world=world,
                     host=host or "h")
        emitters.append(em)
        return em

    proc = start_serve(bootstrap, topics, state, group)
    wait_banner(proc)
    run = SimulatedRun(world=world, seed=3, faults=[fault], emitter_factory=factory, batch_size=4)
    run.train(nan_step + 5)
    for em in emitters:
        assert em.flush(30)
    time.sleep(4)  # let the service consume, detect and snapshot
    err = stop(proc)
    assert "stopped" in err
    assert (state / "pipeline-state.json").exists()
    first = read_anomalies(bootstrap, topics["anomalies"])
    opened = [e for e in first if e["change"] == "opened"]
    nonfinite = [e for e in opened if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0]["first_step"] == nan_step
    assert nonfinite[0]["ranks"] == [2]  # the other ranks only saw the all-reduced NaN

    # restart: the same group and state; the ranks go on training (NaN persists in the model)
    proc = start_serve(bootstrap, topics, state, group)
    banner = wait_banner(proc)
    assert "resumed" in banner
    run.train(10)
    run.close()
    for em in emitters:
        em.close(30)
    time.sleep(4)
    stop(proc)
    after = read_anomalies(bootstrap, topics["anomalies"])
    opened_ids = [e["id"] for e in after if e["change"] == "opened"]
    assert len(opened_ids) == len(set(opened_ids)), "an incident was opened twice"
    assert [e["id"] for e in after if e["change"] == "opened" and e["kind"] == "nonfinite"] == [nonfinite[0]["id"]]


def test_serve_config_error_names_the_key(tmp_path):
    bad = tmp_path / "serve.toml"
    bad.write_text('[alerts]\nalertmanger_url = "http://am:9093"\n')
    out = subprocess.run([sys.executable, "-m", "sdcwatch.cli", "serve", "--config", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "alerts.alertmanger_url" in out.stderr and "alertmanager_url" in out.stderr
    out = subprocess.run([sys.executable, "-m", "sdcwatch.cli", "serve", "--metrics-port", "http"],
                         capture_output=True, text=True, timeout=60, env={**os.environ})
    assert out.returncode == 2 and "metrics.port" in out.stderr
