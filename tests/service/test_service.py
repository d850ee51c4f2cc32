"""The detection service: source -> pipeline -> sinks, the anomalies topic, restarts."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.vocabulary import ANOMALY_TOPIC
from memory_source import MemorySource, bus_sink
from polling import step_until, wait_for
from stand_ins import ListSink
from sdcwatch.exporters.topics import AnomalyTopicSink
from sdcwatch.service.loop import DetectorService
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.telemetry import MemoryBus, MemoryTransport


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
    step_until(service.step, lambda: service.source.lag() == 0, 120, "the source drained")


def anomalies(bus):
    return [json.loads(v) for _, v in bus.messages(ANOMALY_TOPIC)]


def test_service_publishes_incidents_to_the_anomalies_topic_and_sinks():
    bus = MemoryBus()
    emit(bus, SyntheticRun(seed=2, faults=[Fault("replica", 60, rank=6)]), range(100))
    sink = ListSink()
    svc = DetectorService(
        MemorySource(bus), sinks=[bus_sink(AnomalyTopicSink, bus), BrokenSink(), sink], poll_timeout=0.01
    )
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
    first = DetectorService(
        MemorySource(bus), sinks=[bus_sink(AnomalyTopicSink, bus)], state_dir=tmp_path, poll_timeout=0.01
    )
    assert not first.resumed
    drain(first, bus)
    first.close()  # snapshots
    before = anomalies(bus)
    assert [m["kind"] for m in before] == ["silent_drift"]

    emit(bus, synth, range(150, 200))
    # the new instance re-reads the topic from the start (worst-case redelivery)
    second = DetectorService(
        MemorySource(bus), sinks=[bus_sink(AnomalyTopicSink, bus)], state_dir=tmp_path, poll_timeout=0.01
    )
    assert second.resumed
    drain(second, bus)
    second.close()
    after = anomalies(bus)[len(before) :]
    assert [m["id"] for m in after if m["change"] == "opened"] and all(
        m["id"] != before[0]["id"] or m["change"] != "opened" for m in after
    )
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
    wait_for(lambda: svc.pipeline.records_total >= 160, 30, "the service to take the 160 records", interval=0.01)
    stop.set()
    t.join(10)
    assert not t.is_alive()
    assert (tmp_path / "pipeline-state.json").is_file()


def test_bad_service_settings_are_named():
    with pytest.raises(ConfigError, match="service.snapshot_every"):
        DetectorService(MemorySource(MemoryBus()), snapshot_every=0)


@pytest.mark.integration
def test_reference_run_fault_on_one_rank_through_the_real_broker_names_that_rank(bootstrap, unique_topic):
    """The probes' records of a real (simulated data-parallel) training run, through Kafka."""
    torch = pytest.importorskip("torch")
    from kafka import KafkaConsumer
    from sdcwatch.service.kafka_source import KafkaSource
    from sdcwatch.telemetry import Emitter, KafkaTransport
    from sdcwatch.testbed.faultspec import FaultSpec
    from sdcwatch.testbed.model import GPTConfig
    from sdcwatch.testbed.simulated import SimulatedRun, shared_corpus

    torch.set_num_threads(1)
    world, steps = 4, 30
    fault = FaultSpec.from_dict({"kind": "near_inf", "step": 20, "rank": 2, "target": "blocks.0.attn.scores"})
    run = SimulatedRun(
        world=world,
        seed=0,
        faults=[fault],
        model=GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4),
        batch_size=4,
        corpus=shared_corpus(1 << 18),
        ranks_per_host=2,
        emitter_factory=lambda r, host: Emitter(
            KafkaTransport(bootstrap, unique_topic), run="ref", rank=r, world=world, host=host
        ),
    )
    run.train(steps)
    run.close()  # emits each rank's last record, then flushes and closes the emitters
    assert [w.errors for w in run.watches] == [0] * world  # the probes dropped nothing
    assert [(em.emitted, em.sent, em.dropped, em.invalid) for em in run.emitters] == [(steps, steps, 0, 0)] * world

    anomalies_topic = f"{unique_topic}.anomalies"
    source = KafkaSource(
        bootstrap, unique_topic, group=f"g-{uuid.uuid4().hex[:8]}", deadletter_topic=f"{unique_topic}.dead"
    )
    svc = DetectorService(source, sinks=[AnomalyTopicSink.to_kafka(bootstrap, topic=anomalies_topic)], poll_timeout=0.5)
    step_until(svc.step, lambda: svc.pipeline.records_total >= world * steps, 60, "every record on the broker")
    svc.close()
    assert (svc.pipeline.records_total, source.dead_letters) == (world * steps, 0), "the broker confirmed every record"
    consumer = KafkaConsumer(
        anomalies_topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        consumer_timeout_ms=10_000,
        group_id=None,
    )
    msgs = [json.loads(m.value) for m in consumer]
    consumer.close()
    opened = [m for m in msgs if m["change"] == "opened"]
    nonfinite = [m for m in opened if m["kind"] == "nonfinite"]
    assert nonfinite, f"no non-finite incident in {opened}"
    inc = nonfinite[0]
    assert (inc["step"], inc["ranks"][0], inc["hosts"][0], inc["metric"], inc["layer"]) == (
        20,
        2,
        run.host_of(2),
        "attn_logit_max",
        0,
    )


@pytest.mark.integration
def test_summary_the_broker_refuses_is_reported_and_blocks_the_commit(bootstrap, unique_topic):
    """A summary larger than the broker takes is not taken for delivered: flush says so."""
    from sdcwatch.exporters.topics import SummaryTopicSink
    from sdcwatch.service.summary import StepSummary, encode_summary

    sink = SummaryTopicSink.to_kafka(
        bootstrap, topic=f"{unique_topic}.sum", encode=encode_summary, max_request_size=2048
    )
    sink.publish([StepSummary("r", 1, 4, 4)])
    assert sink.flush()
    big = StepSummary("r", 2, 4, 4, observations={"x": __import__("numpy").random.default_rng(0).random(4096)})
    sink.publish([big])  # ~32 kB of incompressible floats: over the producer's 2 kB limit
    assert not sink.flush()
    assert sink.flush()  # the failure is reported once
    sink.close()


def test_a_state_that_cannot_be_written_is_counted_and_retried_while_detection_goes_on(tmp_path, caplog):
    """A state folder that cannot be written (here: replaced by a file, a real OSError from the file
    system; a full or read-only disk alike) does not stop the service: each failed snapshot is
    counted and logged, the offsets stay uncommitted, detection goes on, and once the folder is
    back the next snapshot writes the state."""
    now = [0.0]
    bus = MemoryBus()
    synth = SyntheticRun(seed=2, faults=[Fault("replica", 60, rank=6)])
    emit(bus, synth, range(30))
    state = tmp_path / "state"
    svc = DetectorService(MemorySource(bus), state_dir=state, snapshot_every=5.0, clock=lambda: now[0])
    drain(svc, bus)
    now[0] += 6
    svc.step()
    assert (state / "pipeline-state.json").is_file() and svc.state_write_errors == 0
    committed = svc.source._committed

    for f in state.iterdir():  # the folder becomes unwritable: a file where the folder was
        f.unlink()
    state.rmdir()
    state.write_text("not a folder")
    emit(bus, synth, range(30, 100))  # the fault at step 60 comes while the state cannot be saved
    for _ in range(3):
        drain(svc, bus)
        now[0] += 6
        svc.step()
    assert svc.state_write_errors == 3
    assert svc.view().pipeline.state_write_errors_total == 3
    assert svc.source._committed == committed  # nothing committed past the last state written
    assert any(i.kind == "replica_divergence" for i in svc.pipeline.incidents())  # detection went on
    assert "state not written" in caplog.text
    assert not list(tmp_path.glob("state*.tmp"))

    state.unlink()  # the disk is back
    now[0] += 6
    svc.step()
    assert (state / "pipeline-state.json").is_file()
    assert svc.state_write_errors == 3 and svc.source._committed > committed


def test_a_large_poll_is_fed_in_slices_so_a_scrape_never_waits_for_all_of_it():
    """The service holds its lock (which /metrics takes too) for one slice of a poll at a time: under
    a flood a scrape waits for ~2,048 records, not for a poll of 20,000 (a second of CPU)."""
    from sdcwatch.service.loop import SLICE_RECORDS

    bus = MemoryBus()
    synth = SyntheticRun(seed=5, world=8, faults=[Fault("nonfinite", 700, rank=2)])
    emit(bus, synth, range(800))  # 6,400 records, one poll
    svc = DetectorService(MemorySource(bus), poll_timeout=0.01)
    fed, process = [], svc.pipeline.process

    def counting(items):
        assert not svc._lock.acquire(blocking=False)  # fed under the lock
        fed.append(len(items))
        return process(items)

    svc.pipeline.process = counting
    svc.step()
    assert sum(fed) == 800 * 8 and len(fed) >= 3 and max(fed) <= SLICE_RECORDS
    drain(svc, bus)
    assert [i.first_step for i in svc.pipeline.incidents() if i.kind == "nonfinite"] == [700]
