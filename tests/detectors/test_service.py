"""The detection service: source -> pipeline -> sinks, the anomalies topic, restarts."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from detector_synth import Fault, SyntheticRun
from sdcwatch.detectors import ANOMALY_TOPIC, AnomalyTopicSink, DetectionPipeline, DetectorService
from sdcwatch.detectors.source import MemorySource
from sdcwatch.errors import ConfigError
from sdcwatch.telemetry import MemoryBus, MemoryTransport


class ListSink:
    def __init__(self) -> None:
        self.events = []
        self.closed = False

    def publish(self, event) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed = True


class BrokenSink:
    def publish(self, event) -> None:
        raise RuntimeError("receiver down")

    def close(self) -> None:
        raise RuntimeError("still down")


def emit(bus, synth, steps):
    tr = MemoryTransport(bus)
    for s in steps:
        tr.send(synth.records(s))


def drain(service, bus):
    service.run_for(until=lambda: service.source.lag() == 0, max_iterations=10_000)


def anomalies(bus):
    return [json.loads(v) for _, v in bus.messages(ANOMALY_TOPIC)]


def test_service_publishes_incidents_to_the_anomalies_topic_and_sinks():
    bus = MemoryBus()
    emit(bus, SyntheticRun(seed=2, faults=[Fault("replica", 60, rank=6)]), range(100))
    sink = ListSink()
    svc = DetectorService(MemorySource(bus), sinks=[AnomalyTopicSink.to_bus(bus), BrokenSink(), sink],
                          poll_timeout=0.01)
    drain(svc, bus)
    (msg,) = anomalies(bus)
    assert msg["change"] == "opened" and msg["kind"] == "replica_divergence"
    assert msg["ranks"] == [6] and msg["hosts"] == ["node1"] and msg["step"] == 60
    assert [e.incident.kind for e in sink.events] == ["replica_divergence"]
    view = svc.view()
    assert view.pipeline.records_total == 800 and view.runs[0].last_step == 99
    svc.close()
    assert sink.closed


def test_restart_resumes_without_warmup_and_without_repeating_alerts(tmp_path):
    bus = MemoryBus()
    # a rank drifts from step 100 (incident before the restart); a loss spike right after the
    # restart at step 152: a fresh spike detector would still be warming up (59 steps) and miss it
    synth = SyntheticRun(seed=4, faults=[Fault("rank_shift", 100, rank=3, layer=1), Fault("loss_spike", 152)])
    emit(bus, synth, range(150))
    first = DetectorService(MemorySource(bus), sinks=[AnomalyTopicSink.to_bus(bus)], state_dir=tmp_path,
                            poll_timeout=0.01)
    assert not first.resumed
    drain(first, bus)
    first.close()  # snapshots
    before = anomalies(bus)
    assert [m["kind"] for m in before] == ["silent_drift"]

    emit(bus, synth, range(150, 200))
    # the new instance re-reads the topic from the start (worst-case redelivery)
    second = DetectorService(MemorySource(bus), sinks=[AnomalyTopicSink.to_bus(bus)], state_dir=tmp_path,
                             poll_timeout=0.01)
    assert second.resumed
    drain(second, bus)
    second.close()
    after = anomalies(bus)[len(before):]
    assert [m["id"] for m in after if m["change"] == "opened"] and all(
        m["id"] != before[0]["id"] or m["change"] != "opened" for m in after)
    kinds = [(m["change"], m["kind"]) for m in after]
    assert ("opened", "loss_spike") in kinds  # no new warm-up: the spike at 152 is caught
    assert ("updated", "sdc_suspected") in kinds  # and joined with the drift seen before the restart

    fresh = DetectionPipeline()
    for s in range(150, 200):
        fresh.process(synth.records(s))
    assert not any(i.kind == "loss_spike" for i in fresh.incidents())  # the warm-up it avoided


def test_run_forever_stops_and_snapshots(tmp_path):
    bus = MemoryBus()
    emit(bus, SyntheticRun(seed=1), range(20))
    svc = DetectorService(MemorySource(bus), state_dir=tmp_path, poll_timeout=0.01)
    stop = threading.Event()
    t = threading.Thread(target=svc.run_forever, args=(stop,))
    t.start()
    deadline = time.monotonic() + 10
    while svc.pipeline.records_total < 160 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join(10)
    assert not t.is_alive()
    assert (tmp_path / "pipeline-state.json").is_file()


def test_bad_service_settings_are_named():
    with pytest.raises(ConfigError, match="service.snapshot_every"):
        DetectorService(MemorySource(MemoryBus()), snapshot_every=0)


@pytest.mark.integration
def test_fault_on_one_rank_through_the_real_broker_names_that_rank(bootstrap, unique_topic):
    from kafka import KafkaConsumer

    from sdcwatch.detectors.source import KafkaSource
    from sdcwatch.telemetry import KafkaTransport

    anomalies_topic = f"{unique_topic}.anomalies"
    synth = SyntheticRun(seed=5, faults=[Fault("nonfinite", 30, rank=5, layer=2)])
    tr = KafkaTransport(bootstrap, unique_topic)
    for s in range(60):
        tr.send(synth.records(s))
    tr.close()
    source = KafkaSource(bootstrap, unique_topic, group=f"g-{uuid.uuid4().hex[:8]}",
                         deadletter_topic=f"{unique_topic}.dead")
    sink = AnomalyTopicSink.to_kafka(bootstrap, topic=anomalies_topic)
    svc = DetectorService(source, sinks=[sink], poll_timeout=0.5)
    deadline = time.monotonic() + 60
    svc.run_for(until=lambda: svc.pipeline.records_total >= 480 or time.monotonic() > deadline)
    svc.close()
    assert svc.pipeline.records_total == 480
    consumer = KafkaConsumer(anomalies_topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=10_000, group_id=None)
    msgs = [json.loads(m.value) for m in consumer]
    consumer.close()
    (inc,) = [m for m in msgs if m["change"] == "opened"]
    assert (inc["kind"], inc["ranks"], inc["hosts"], inc["layer"], inc["step"]) == (
        "nonfinite", [5], ["node1"], 2, 30)
