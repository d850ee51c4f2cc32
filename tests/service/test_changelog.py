"""The state changelog on the real broker: snapshots in a compacted topic, chunked and whole or not
at all, damaged ones refused, and a takeover by an instance with an empty state folder (in process,
and as two `sdcwatch serve` processes with a SIGKILL between them)."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
from detector_synth import Fault, SyntheticRun
from polling import wait_for
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.vocabulary import ANOMALY_TOPIC, TELEMETRY_TOPIC
from memory_source import MemorySource
from sdcwatch.exporters.topics import AnomalyTopicSink
from sdcwatch.service.changelog import StateChangelog
from sdcwatch.service.loop import DetectorService
from sdcwatch.telemetry import MemoryBus, MemoryTransport

from sdcwatch.broker import free_port


def _changelog(bootstrap, topic, **kw) -> StateChangelog:
    return StateChangelog(bootstrap, topic, group=kw.pop("group", "g"), stage=kw.pop("stage", "both"), **kw)


def _state(n: int) -> dict:
    """A state of about ``n`` kB that zlib cannot shrink much (so it needs several chunks)."""
    return {"version": 1, "blob": os.urandom(n * 512).hex(), "n": n}


def _send_raw(bootstrap, topic, key: bytes, value: bytes | None) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=[bootstrap])
    producer.send(topic, key=key, value=value, partition=0).get(10)
    producer.close()


def test_a_snapshot_goes_to_the_topic_in_chunks_and_comes_back_whole(bootstrap, unique_topic):
    writer = _changelog(bootstrap, unique_topic, chunk_bytes=4096)
    assert _changelog(bootstrap, unique_topic).read() is None  # no topic yet: nothing to resume
    first, second = _state(40), _state(30)
    writer.write(first, ["schema-a"])
    writer.write(second)
    writer.close()
    snap = _changelog(bootstrap, unique_topic).read()  # another instance, another machine: only the topic
    assert snap.state == second and snap.schemas is None and snap.size > 4096
    assert abs(snap.written_at - time.time()) < 60
    # another group's (or stage's) snapshot under the same topic is its own
    assert _changelog(bootstrap, unique_topic, group="other").read() is None
    assert _changelog(bootstrap, unique_topic, stage="temporal").read() is None


def test_a_half_written_snapshot_is_never_taken_and_its_chunks_are_dropped_later(bootstrap, unique_topic):
    writer = _changelog(bootstrap, unique_topic, chunk_bytes=2048)
    whole = _state(10)
    writer.write(whole)
    # a writer killed between its chunks and its manifest: chunks of a newer snapshot, no manifest
    for i in range(3):
        _send_raw(bootstrap, unique_topic, f"c:both:ffff{i}:{i}:g".encode(), b"half")
    reader = _changelog(bootstrap, unique_topic, chunk_bytes=2048)
    assert reader.read().state == whole
    stale = set(reader._live)
    assert len(stale) > 3  # the current snapshot's chunks and the orphans
    reader.write(_state(5))  # the successor's first snapshot tombstones them
    keys = _latest_values(bootstrap, unique_topic)
    assert all(keys[k] is None for k in stale)


def _latest_values(bootstrap, topic) -> dict:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=[bootstrap], group_id=None, consumer_timeout_ms=1500)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    latest = {m.key: m.value for m in consumer}
    consumer.close()
    return latest


@pytest.mark.parametrize(
    "damage, fault",
    [
        ("chunk", "checksum"),
        ("manifest", "not a manifest"),
        ("missing", "missing"),
    ],
)
def test_a_damaged_snapshot_on_the_topic_is_refused_naming_the_topic_and_the_way_out(
    bootstrap, unique_topic, damage, fault
):
    writer = _changelog(bootstrap, unique_topic, chunk_bytes=1024)
    writer.write(_state(4))
    chunk = next(iter(writer._live))
    if damage == "chunk":
        _send_raw(bootstrap, unique_topic, chunk, b"x" * 1024)
    elif damage == "manifest":
        _send_raw(bootstrap, unique_topic, b"m:both:g", b'{"format": "something else"}')
    else:
        _send_raw(bootstrap, unique_topic, chunk, None)  # compaction took a chunk the manifest needs
    with pytest.raises(ConfigError) as err:
        _changelog(bootstrap, unique_topic).read()
    msg = str(err.value)
    assert err.value.key == "state.topic" and unique_topic in msg and "m:both:g" in msg
    assert fault in msg and "--state-reset" in msg


def emit(bus, synth, steps):
    tr = MemoryTransport(bus)
    for s in steps:
        tr.send(synth.records(s))


def drain(service):
    service.run_for(until=lambda: service.source.lag() == 0, max_iterations=10_000)


def test_an_instance_with_an_empty_state_folder_resumes_from_the_topic_without_a_new_warmup(
    bootstrap, unique_topic, tmp_path
):
    """A rank drifts from step 100 (an incident before the takeover); a loss spike at 152, right
    after it: the successor, on another machine (its own empty folder), catches it only with the
    spike detector's warm-up from the topic, and does not open the drift's incident again."""
    bus = MemoryBus()
    synth = SyntheticRun(seed=4, faults=[Fault("rank_shift", 100, rank=3, layer=1), Fault("loss_spike", 152)])
    emit(bus, synth, range(150))
    taken = bus.size(TELEMETRY_TOPIC)  # messages the first instance commits
    first = DetectorService(
        MemorySource(bus),
        sinks=[AnomalyTopicSink.to_bus(bus)],
        state_dir=tmp_path / "a",
        poll_timeout=0.01,
        changelog=_changelog(bootstrap, unique_topic),
    )
    drain(first)
    first.close()  # the final snapshot: to the file and the topic
    before = [json.loads(v) for _, v in bus.messages(ANOMALY_TOPIC)]
    assert [m["kind"] for m in before] == ["silent_drift"]

    emit(bus, synth, range(150, 200))
    source = MemorySource(bus)
    source._offset = source._committed = taken  # the group's committed offsets
    second = DetectorService(
        source,
        sinks=[AnomalyTopicSink.to_bus(bus)],
        state_dir=tmp_path / "b",
        poll_timeout=0.01,
        changelog=_changelog(bootstrap, unique_topic),
    )
    assert second.resumed and second.pipeline.records_total == 150 * synth.world
    drain(second)
    second.close()
    after = [json.loads(v) for _, v in bus.messages(ANOMALY_TOPIC)][len(before) :]
    kinds = [(m["change"], m["kind"]) for m in after]
    assert ("opened", "loss_spike") in kinds
    assert not any(m["change"] == "opened" and m["id"] == before[0]["id"] for m in after)

    # without the topic the same successor is cold: the spike falls in its warm-up
    cold_source = MemorySource(bus)
    cold_source._offset = taken
    cold = DetectorService(cold_source, state_dir=tmp_path / "c", poll_timeout=0.01)
    assert not cold.resumed
    drain(cold)
    assert not any(i.kind == "loss_spike" for i in cold.pipeline.incidents())
    cold.close()


def test_the_state_file_wins_when_newer_and_the_topic_when_the_file_is_older(bootstrap, unique_topic, tmp_path):
    bus = MemoryBus()
    synth = SyntheticRun(seed=1)
    emit(bus, synth, range(20))
    svc = DetectorService(
        MemorySource(bus), state_dir=tmp_path, poll_timeout=0.01, changelog=_changelog(bootstrap, unique_topic)
    )
    drain(svc)
    svc.close()
    # the same machine: its file is as new as the topic's snapshot; the file is taken
    again = DetectorService(
        MemorySource(bus), state_dir=tmp_path, poll_timeout=0.01, changelog=_changelog(bootstrap, unique_topic)
    )
    assert again.resumed and again.pipeline.records_total == 20 * synth.world
    again.source.close()
    # a file left from long ago on this machine: the topic's newer snapshot is taken
    old = tmp_path / "pipeline-state.json"
    state = json.loads(old.read_text())
    state["records_total"] = 7
    old.write_text(json.dumps(state))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    later = DetectorService(
        MemorySource(bus), state_dir=tmp_path, poll_timeout=0.01, changelog=_changelog(bootstrap, unique_topic)
    )
    assert later.resumed and later.pipeline.records_total == 20 * synth.world
    later.source.close()


def test_a_topic_that_cannot_be_written_is_counted_and_the_offsets_stay_uncommitted(tmp_path, caplog):
    """The state topic's broker gone: each snapshot is counted (state_write_errors) and logged
    naming the topic, the offsets are not committed, detection goes on."""
    now = [0.0]
    bus = MemoryBus()
    synth = SyntheticRun(seed=2, faults=[Fault("replica", 60, rank=6)])
    emit(bus, synth, range(100))
    dead = StateChangelog(f"127.0.0.1:{free_port()}", "sdcwatch.state", group="g", stage="both", timeout=1.0)
    svc = DetectorService(
        MemorySource(bus), state_dir=tmp_path, snapshot_every=5.0, clock=lambda: now[0], changelog=dead, resumed=False
    )
    for _ in range(2):
        drain(svc)
        now[0] += 6
        svc.step()
    assert svc.state_write_errors == 2 and svc.view().pipeline.state_write_errors_total == 2
    assert svc.source._committed == 0
    assert "state not written to topic sdcwatch.state" in caplog.text
    assert any(i.kind == "replica_divergence" for i in svc.pipeline.incidents())
    svc.source.close()


# ---------------------------------------------------------------------------------------------
# two `sdcwatch serve` processes: a SIGKILL and a successor with an empty state folder


@pytest.mark.integration
@pytest.mark.bench
def test_a_successor_with_an_empty_state_folder_takes_over_after_a_sigkill_and_finds_the_spike(bootstrap, tmp_path):
    from serve_process import ServeProcess, Topics, rank_emitters, train_ranks

    tag = uuid.uuid4().hex[:8]
    topics, group, state_topic = Topics.fresh(tag), f"takeover-{tag}", f"state.{tag}"
    flags = ("--state-topic", state_topic)
    first = ServeProcess(bootstrap, topics, tmp_path / "x", *flags, group=group, metrics_port=0, snapshot_interval_s=1)
    successor = None
    emitters = rank_emitters(bootstrap, topics.telemetry)
    try:
        first.wait_banner()
        train_ranks(emitters, range(70))  # past the spike detector's warm-up (59 steps)
        reader = _changelog(bootstrap, state_topic, group=group)
        wait_for(
            lambda: (snap := reader.read()) is not None and snap.state["records_total"] >= 70 * 4,
            60,
            "the first instance's snapshot of 70 steps on the state topic",
            interval=0.5,
        )
        first.proc.send_signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        successor = ServeProcess(
            bootstrap, topics, tmp_path / "y", *flags, group=group, metrics_port=0, snapshot_interval_s=1
        )
        successor.wait_banner()
        assert "resumed" in successor.banner and not (tmp_path / "y" / "pipeline-state.json").exists()
        assert any(f"resuming from state topic {state_topic}" in ln for ln in successor.lines)
        train_ranks(emitters, range(70, 100), lambda step, rank, loss: 3 * loss if step == 80 else loss)  # a spike
        spike = successor.wait_incident("loss_spike", 90)
        assert spike["first_step"] == 80, spike  # how soon the successor takes over: bench/bench_takeover.py
        assert not [e for e in successor.events() if e["change"] == "opened" and e["kind"] != "loss_spike"]
    finally:
        for em in emitters:
            em.close(5)
        first.close()
        if successor is not None:
            successor.close()


def test_a_successor_elsewhere_does_not_announce_again_what_the_killed_instance_announced(
    bootstrap, unique_topic, tmp_path
):
    """The journal of announced incidents travels on the state topic too: an incident opened after
    the last snapshot, then a SIGKILL, then an instance on another machine (an empty folder) that
    re-reads those records: the incident is not opened a second time."""
    bus = MemoryBus()
    synth = SyntheticRun(seed=3, faults=[Fault("nonfinite", 90, rank=2)])
    emit(bus, synth, range(60))
    first = DetectorService(
        MemorySource(bus),
        sinks=[AnomalyTopicSink.to_bus(bus)],
        state_dir=tmp_path / "a",
        snapshot_every=3600,
        poll_timeout=0.01,
        changelog=_changelog(bootstrap, unique_topic),
    )
    drain(first)
    first.snapshot()  # the last snapshot: steps 0-59, to the file and the topic
    committed = first.source._committed
    emit(bus, synth, range(60, 120))
    drain(first)
    opened = [json.loads(v)["id"] for _, v in bus.messages(ANOMALY_TOPIC) if json.loads(v)["change"] == "opened"]
    assert opened == ["synth:nonfinite:90"]
    # SIGKILL: no close, no snapshot; the successor has another machine's empty folder
    source = MemorySource(bus)
    source._offset = source._committed = committed
    second = DetectorService(
        source,
        sinks=[AnomalyTopicSink.to_bus(bus)],
        state_dir=tmp_path / "b",
        poll_timeout=0.01,
        changelog=_changelog(bootstrap, unique_topic),
    )
    assert second.resumed
    drain(second)
    second.close()
    opened = [json.loads(v)["id"] for _, v in bus.messages(ANOMALY_TOPIC) if json.loads(v)["change"] == "opened"]
    assert opened == ["synth:nonfinite:90"], "the successor announced the incident again"
    assert second.journal.suppressed >= 1
