"""The state changelog on the real broker: snapshots in a compacted topic, chunked and whole or not
at all, damaged ones refused, and a takeover by an instance with an empty state folder (in process,
and as two `sdcwatch serve` processes with a SIGKILL between them)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
import uuid
import zlib

import pytest
from detector_synth import Fault, SyntheticRun
from polling import step_until, wait_for
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.vocabulary import ANOMALY_TOPIC, TELEMETRY_TOPIC
from memory_source import MemorySource, bus_sink
from sdcwatch.exporters.topics import AnomalyTopicSink
from sdcwatch.core.signing import JobKey, Keyring, is_signed
from sdcwatch.service.changelog import FORMAT, FUTURE_SKEW_S, StateChangelog
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
    reader.write(_state(5))  # the successor's first snapshot tombstones them (sent after its manifest)

    def tombstoned() -> bool:
        keys = _latest_values(bootstrap, unique_topic)
        return all(keys[k] is None for k in stale)

    wait_for(tombstoned, 30, "the stale chunks tombstoned")


def _close_all(emitters, *services) -> None:
    """Teardown of a takeover test: the job's emitters, then each service started (None: not started)."""
    for em in emitters:
        em.close(5)
    for service in services:
        if service is not None:
            service.close()


def _latest_values(bootstrap, topic) -> dict:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=[bootstrap], group_id=None)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    end = consumer.end_offsets([tp])[tp]  # what the topic holds now: a running service writes on
    latest: dict = {}
    while True:  # to the end as the fetches saw it too (the embedded broker's ListOffsets can answer short)
        got = consumer.poll(timeout_ms=500).get(tp, ())
        latest.update((m.key, m.value) for m in got)
        if not got and consumer.position(tp) >= max(end, consumer.highwater(tp) or 0):
            break
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
    step_until(service.step, lambda: service.source.lag() == 0, 120, "the source drained")


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
        sinks=[bus_sink(AnomalyTopicSink, bus)],
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
        sinks=[bus_sink(AnomalyTopicSink, bus)],
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
        _close_all(emitters, first, successor)


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
        sinks=[bus_sink(AnomalyTopicSink, bus)],
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
        sinks=[bus_sink(AnomalyTopicSink, bus)],
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


# ---------------------------------------------------------------------------------------------
# the state topic is an input: forged snapshots and journals, and what a start falls back to

SECRET_A, SECRET_B = uuid.uuid4().hex, uuid.uuid4().hex
KEY_A, KEY_B = JobKey("job-a", SECRET_A.encode()), JobKey("job-b", SECRET_B.encode())
SERVICE_KEY = Keyring([KEY_A, KEY_B]).service_key("state")  # what a service holding both keys signs with


def test_an_older_snapshot_of_the_service_published_again_never_beats_a_newer_state_file(
    bootstrap, unique_topic, tmp_path, caplog
):
    """A writer of the topic re-publishes the service's own older snapshot (signed: it verifies): it
    is refused in a log line naming it, the newer one still on the topic is the topic's, and the
    newer of that and the state file wins: the file, in a line naming the snapshot and how much
    older it is. A tombstone of the manifest (the service writes none) is ignored, logged."""
    bus = MemoryBus()
    synth = SyntheticRun(seed=3)
    emit(bus, synth, range(20))

    def start() -> DetectorService:
        caplog.clear()
        changelog = _changelog(bootstrap, unique_topic, key=SERVICE_KEY)
        return DetectorService(MemorySource(bus), state_dir=tmp_path, poll_timeout=0.01, changelog=changelog)

    svc = start()
    drain(svc)
    svc.snapshot()  # the service's snapshot of 20 steps, as a writer of the topic captured it
    captured = {k: v for k, v in _latest_values(bootstrap, unique_topic).items() if k.startswith((b"c:", b"m:"))}
    emit(bus, synth, range(20, 40))
    drain(svc)
    svc.close()  # 40 steps: the file and the topic (the 20 steps' chunks tombstoned)
    for key, value in captured.items():  # chunks before their manifest, as the service wrote them
        _send_raw(bootstrap, unique_topic, key, value)
    with caplog.at_level(logging.INFO, "sdcwatch.service.changelog"):
        again = start()
    again.source.close()
    assert again.resumed and again.pipeline.records_total == 40 * synth.world
    refused = [r.getMessage() for r in caplog.records if "older than one the service wrote" in r.getMessage()]
    said = [r.getMessage() for r in caplog.records if "the newer" in r.getMessage()]
    copy = json.loads(SERVICE_KEY.open(captured[b"m:both:g"]))["snapshot"]
    newest = _changelog(bootstrap, unique_topic, key=SERVICE_KEY).read()
    assert newest.snapshot != copy and newest.state["records_total"] == 40 * synth.world
    assert len(refused) == 1 and copy in refused[0] and newest.snapshot in refused[0], refused
    assert len(said) == 1 and newest.snapshot in said[0] and "pipeline-state.json" in said[0], said
    assert again.view().pipeline.state_topic_refused == {"older": 1}
    _send_raw(bootstrap, unique_topic, b"m:both:g", None)  # the manifest deleted
    reader = _changelog(bootstrap, unique_topic, key=SERVICE_KEY)
    assert reader.read().snapshot == newest.snapshot and reader.refused == {"older": 1, "deleted": 1}
    later = start()
    later.source.close()
    assert later.resumed and later.pipeline.records_total == 40 * synth.world
    assert any("a tombstone deleted the snapshot" in r.getMessage() for r in caplog.records)


def test_two_instances_creating_their_topics_at_the_same_instant_one_creates_each_and_neither_fails(bootstrap):
    """Issue 36 item 7's remaining race, two instances started at the same instant before their topics
    exist: the broker creates a topic once, so exactly one instance is told it created the telemetry
    topic (the one that stays), the other that it exists (the newcomer, which leaves as documented);
    both find the compacted state topic and write to it."""
    import threading

    from sdcwatch.config import load_config
    from sdcwatch.serve import _created_telemetry_topic

    for _ in range(3):
        telemetry, state = f"t.{uuid.uuid4().hex[:10]}", f"s.{uuid.uuid4().hex[:10]}"
        cfg = load_config(overrides={"bus.bootstrap": bootstrap, "bus.telemetry_topic": telemetry}, env={})
        together, created, written = threading.Barrier(2), [], []

        def start(n: int) -> None:
            together.wait()
            created.append(_created_telemetry_topic(cfg))
            changelog = _changelog(bootstrap, state, key=SERVICE_KEY)
            changelog.write({"n": n})
            changelog.close()
            written.append(n)

        threads = [threading.Thread(target=start, args=(n,)) for n in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(created) == [False, True] and sorted(written) == [1, 2]
        assert _changelog(bootstrap, state, key=SERVICE_KEY).read().state["n"] in (1, 2)


IN_2036 = 2_085_000_000.0


@pytest.mark.integration
def test_an_older_snapshot_re_published_before_a_takeover_leaves_the_successor_warm_and_finds_the_spike(
    bootstrap, tmp_path
):
    """Keys on. A writer of the state topic captured the service's snapshot of 30 steps (signed by the
    service) and re-publishes it after the service's last one (70 steps). Before, the successor on an
    empty folder took the copy: 30 steps of warm-up and the 10 it reads, short of the spike
    detector's 59: the spike at step 80 was missed. Now the copy is refused (logged, counted) and
    the successor resumes from the newest snapshot, still on the topic: the spike is found at 80."""
    from serve_process import ServeProcess, Topics, metric, train_ranks
    from sdcwatch.telemetry import Emitter

    keys = tmp_path / "keys"
    keys.write_text(f"job-a:{SECRET_A}\njob-b:{SECRET_B}\n")
    tag = uuid.uuid4().hex[:8]
    topics, group, state_topic = Topics.fresh(tag), f"replay-{tag}", f"state.{tag}"
    flags = ("--auth-key-file", str(keys), "--state-topic", state_topic)
    emitters = [
        Emitter(bootstrap=bootstrap, topic=topics.telemetry, key=KEY_A, run="r", rank=r, world=4) for r in range(4)
    ]
    reader = _changelog(bootstrap, state_topic, group=group, key=SERVICE_KEY)

    def snapshot_of(steps: int) -> None:
        wait_for(
            lambda: (snap := reader.read()) is not None and snap.state["records_total"] >= steps * 4,
            60,
            f"a snapshot of {steps} steps on the state topic",
            interval=0.5,
        )

    first = ServeProcess(bootstrap, topics, tmp_path / "x", *flags, group=group, snapshot_interval_s=1)
    successor = None
    try:
        first.wait_banner()
        train_ranks(emitters, range(30))
        snapshot_of(30)
        captured = {k: v for k, v in _latest_values(bootstrap, state_topic).items() if k.startswith((b"c:", b"m:"))}
        train_ranks(emitters, range(30, 70))
        snapshot_of(70)
        first.stop()  # its final snapshot, then the group's commit
        for key, value in captured.items():  # chunks before their manifest, as the service wrote them
            _send_raw(bootstrap, state_topic, key, value)
        successor = ServeProcess(bootstrap, topics, tmp_path / "y", *flags, group=group, snapshot_interval_s=1)
        successor.wait_banner()
        copy = json.loads(SERVICE_KEY.open(captured[f"m:both:{group}".encode()]))["snapshot"]
        assert any(copy in ln and "older than one the service wrote" in ln for ln in successor.lines), successor.lines
        assert metric(successor.scrape(), "sdcwatch_state_topic_refused_total", reason="older") == 1
        train_ranks(emitters, range(70, 100), lambda step, rank, loss: 3 * loss if step == 80 else loss)  # a spike
        try:
            spike = successor.wait_incident("loss_spike", 90)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the successor said: {successor.stderr()[-3000:]}") from None
        assert spike["first_step"] == 80, spike
    finally:
        _close_all(emitters, first, successor)


def _forge(bootstrap, topic, state: dict, written_at: float, key: JobKey | None = None, group: str = "g") -> None:
    """A snapshot written by another writer of the topic: its chunk and its manifest (signed with ``key``)."""
    blob = zlib.compress(json.dumps({"state": state, "schemas": None}).encode())
    snapshot = f"forged{uuid.uuid4().hex[:6]}"
    _send_raw(bootstrap, topic, f"c:both:{snapshot}:0:{group}".encode(), blob)
    manifest = {
        **{"format": FORMAT, "snapshot": snapshot, "chunks": 1, "bytes": len(blob)},
        **{"sha256": hashlib.sha256(blob).hexdigest(), "written_at": written_at, "group": group, "stage": "both"},
    }
    value = json.dumps(manifest).encode()
    _send_raw(bootstrap, topic, f"m:both:{group}".encode(), value if key is None else key.sign(value))


def test_with_keys_only_the_services_own_snapshots_and_journal_are_taken(bootstrap, unique_topic):
    """Another writer of the topic, without a key or with a job's key (which cannot make the
    service's), forges a snapshot or a journal: each is refused, naming why; the service's own
    snapshot and journal, signed with the key made from all of its keys, come back whole."""
    writer = _changelog(bootstrap, unique_topic, key=SERVICE_KEY)
    writer.write(_state(2))
    writer.write_journal({"opened|victim:nonfinite:35": time.time()})
    snap = _changelog(bootstrap, unique_topic, key=SERVICE_KEY).read()
    assert snap.state["n"] == 2 and list(snap.journal) == ["opened|victim:nonfinite:35"]
    for forger in (None, KEY_B, Keyring([KEY_B]).service_key("state")):
        _forge(bootstrap, unique_topic, _state(1), time.time(), key=forger)
        with pytest.raises(ConfigError) as err:
            _changelog(bootstrap, unique_topic, key=SERVICE_KEY).read()
        assert "not signed with this service's key" in str(err.value) and "m:both:g" in str(err.value)
    writer.write(_state(3))  # the service's next snapshot replaces the forged one
    forged_journal = json.dumps({"entries": {"opened|victim:nonfinite:35": time.time()}}).encode()
    for forger in (None, KEY_B):
        _send_raw(
            bootstrap, unique_topic, b"j:both:g", forged_journal if forger is None else forger.sign(forged_journal)
        )
        snap = _changelog(bootstrap, unique_topic, key=SERVICE_KEY).read()
        assert snap.state["n"] == 3 and snap.journal is None  # refused: the NaN's `opened` is not suppressed
    writer.close()


def test_a_snapshot_stamped_in_the_future_is_refused_with_keys_or_without(bootstrap, unique_topic):
    _forge(bootstrap, unique_topic, _state(1), IN_2036)
    with pytest.raises(ConfigError, match="in the future"):
        _changelog(bootstrap, unique_topic).read()
    _forge(bootstrap, unique_topic, _state(1), IN_2036, key=SERVICE_KEY)  # even the service's own
    with pytest.raises(ConfigError, match="in the future"):
        _changelog(bootstrap, unique_topic, key=SERVICE_KEY).read()
    _forge(bootstrap, unique_topic, _state(1), time.time() + FUTURE_SKEW_S / 2, key=SERVICE_KEY)  # a clock a bit ahead
    assert _changelog(bootstrap, unique_topic, key=SERVICE_KEY).read().state["n"] == 1


def test_a_refused_topic_snapshot_gives_way_to_the_state_file_and_a_damaged_file_to_the_topic(
    bootstrap, unique_topic, tmp_path, caplog
):
    """A garbage manifest, or another writer's snapshot stamped 2036, used to stop every start (or win
    over a newer state file): the good state file is taken instead, in one line saying why and that
    nothing is to be done. The reverse: a damaged file, a good older snapshot on the topic."""
    bus = MemoryBus()
    synth = SyntheticRun(seed=5)
    emit(bus, synth, range(20))
    first = DetectorService(
        MemorySource(bus), state_dir=tmp_path, poll_timeout=0.01, changelog=_changelog(bootstrap, unique_topic)
    )
    drain(first)
    first.close()  # the file and the topic: 20 steps
    state = json.loads((tmp_path / "pipeline-state.json").read_text())

    def start() -> DetectorService:
        caplog.clear()
        svc = DetectorService(
            MemorySource(bus), state_dir=tmp_path, poll_timeout=0.01, changelog=_changelog(bootstrap, unique_topic)
        )
        svc.source.close()
        return svc

    for forge in (
        lambda: _send_raw(bootstrap, unique_topic, b"m:both:g", b"garbage"),
        lambda: _forge(bootstrap, unique_topic, {**state, "records_total": 7}, IN_2036),
    ):
        forge()
        svc = start()
        assert svc.resumed and svc.pipeline.records_total == 20 * synth.world
        said = [r.getMessage() for r in caplog.records if "resuming from the state file" in r.getMessage()]
        assert len(said) == 1 and unique_topic in said[0] and "nothing to do" in said[0], said
        assert "--state-reset" not in said[0]

    _changelog(bootstrap, unique_topic).write({**state, "records_total": 9})  # a good snapshot ...
    (tmp_path / "pipeline-state.json").write_text('{"version": ')  # ... and then a damaged file
    svc = start()
    assert svc.resumed and svc.pipeline.records_total == 9
    said = [r.getMessage() for r in caplog.records if "resuming from the state topic" in r.getMessage()]
    assert len(said) == 1 and "pipeline-state.json" in said[0] and "not valid JSON" in said[0], said

    # neither good: the start stops, naming the file and the way out
    _send_raw(bootstrap, unique_topic, b"m:both:g", b"garbage")
    with pytest.raises(ConfigError, match="--state-reset"):
        start()


def _commit(bootstrap, group: str, topic: str, offset: int) -> None:
    """The group's offset on ``topic`` (partition 0), as the service commits it after a snapshot."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    consumer = KafkaConsumer(bootstrap_servers=[bootstrap], group_id=group, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.commit({tp: OffsetAndMetadata(offset, "", -1)})
    consumer.close()


def test_once_compacted_a_snapshot_behind_the_groups_offsets_or_deleted_is_refused_and_the_start_is_cold(
    bootstrap, unique_topic, tmp_path, caplog
):
    """Compaction keeps one value a key: the copy of an older snapshot re-published, or a tombstone,
    is then all the topic holds of the manifest. The manifest records where the snapshot's reading
    stood; the group commits only after a snapshot, so one behind the group's committed offsets is
    older than one the service wrote: refused, counted, and a start without a state file is cold,
    saying so. A snapshot as far as the committed offsets is taken."""
    telemetry, group = f"{unique_topic}.telemetry", f"g-{uuid.uuid4().hex[:8]}"
    _send_raw(bootstrap, telemetry, b"r", b"x")  # the topic the group reads
    writer = _changelog(bootstrap, unique_topic, key=SERVICE_KEY, group=group, source_topic=telemetry)
    writer.write(_state(1), None, {0: 5})
    _commit(bootstrap, group, telemetry, 5)
    captured = _latest_values(bootstrap, unique_topic)
    writer.write(_state(2), None, {0: 9})
    _commit(bootstrap, group, telemetry, 9)
    writer.close()

    def compacted(values: dict) -> StateChangelog:  # a topic that holds only ``values``
        topic = f"{unique_topic}.{uuid.uuid4().hex[:6]}"
        for key, value in values.items():
            _send_raw(bootstrap, topic, key, value)
        return _changelog(bootstrap, topic, key=SERVICE_KEY, group=group, source_topic=telemetry)

    copy = compacted(captured)
    with caplog.at_level(logging.INFO, "sdcwatch.service.changelog"):
        svc = DetectorService(MemorySource(MemoryBus()), state_dir=tmp_path, poll_timeout=0.01, changelog=copy)
    svc.source.close()
    assert not svc.resumed and svc.view().pipeline.state_topic_refused == {"older": 1}
    said = [r.getMessage() for r in caplog.records]
    snapshot = json.loads(SERVICE_KEY.open(captured[f"m:both:{group}".encode()]))["snapshot"]
    refused = [m for m in said if "older than one the service wrote" in m]
    assert len(refused) == 1 and snapshot in refused[0] and "partition 0 at 9, the snapshot's 5" in refused[0], said
    assert any("starting cold" in m for m in said), said

    deleted = compacted({f"m:both:{group}".encode(): None})
    caplog.clear()
    assert deleted.read() is None and deleted.refused == {"deleted": 1}
    said = [r.getMessage() for r in caplog.records]
    assert any("tombstone deleted the snapshot" in m for m in said), said
    assert any(f"no snapshot, though group {group} read {telemetry} to {{0: 9}}" in m for m in said), said

    # a successor's snapshot before it reads a partition keeps where the group stood there
    successor = _changelog(bootstrap, unique_topic, key=SERVICE_KEY, group=group, source_topic=telemetry)
    assert successor.read().state["n"] == 2
    successor.write(_state(3), None, {})
    successor.close()
    assert (
        _changelog(bootstrap, unique_topic, key=SERVICE_KEY, group=group, source_topic=telemetry).read().state["n"] == 3
    )

    _commit(bootstrap, group, telemetry, 5)  # the copy is as far as the group read: taken
    again = compacted(captured)
    assert again.read().state["n"] == 1 and not again.refused


@pytest.mark.integration
def test_a_forged_state_topic_neither_rebinds_a_signed_run_nor_silences_its_nan(bootstrap, tmp_path):
    """Before, with keys on: a snapshot written to the state topic by another writer, stamped 2036,
    beat the newer state file and bound the victim's run to another key (its records refused, its
    NaN missed); a forged journal suppressed a NaN's `opened`. Now both are refused: the restart
    keeps its state file, the successor elsewhere takes the service's own snapshot without the
    forged journal, and each NaN is found at its step and rank."""
    from serve_process import ServeProcess, Topics, metric, peek_topic, wait_metric
    from sdcwatch.telemetry import Emitter

    keys = tmp_path / "keys"
    keys.write_text(f"job-a:{SECRET_A}\njob-b:{SECRET_B}\n")
    tag = uuid.uuid4().hex[:8]
    topics, group, state_topic = Topics.fresh(tag), f"forged-{tag}", f"state.{tag}"
    flags = ("--auth-key-file", str(keys), "--state-topic", state_topic, "--detectors-align-timeout-s", "2")
    emitters = [  # two runs of job-a: the first for the forged snapshot, the second for the forged journal
        Emitter(bootstrap=bootstrap, topic=topics.telemetry, key=KEY_A, run=run, rank=r, world=4)
        for run in ("victim", "second")
        for r in range(4)
    ]
    sent = [0]  # the runs' next step

    def events() -> list[dict]:  # the service signs them with a key of its own when it has keys
        opened = Keyring([Keyring([KEY_A, KEY_B]).service_key("anomalies")])
        values = [m.value for m in peek_topic(bootstrap, topics.anomalies, 2.0)]
        return [json.loads(opened.verify(v)[1] if is_signed(v) else v) for v in values]

    def serve_until(state_dir, last_step: int, nan: tuple[str, int] | None = None) -> ServeProcess:
        """A service on ``state_dir``; both runs' steps up to ``last_step``; a NaN on rank 2 of (run, step)."""
        serve = ServeProcess(bootstrap, topics, state_dir, *flags, group=group, snapshot_interval_s=1)
        serve.wait_banner()
        for step in range(sent[0], last_step + 1):
            for em in emitters:
                bad = (em.run, step) == nan and em.rank == 2
                em.emit(
                    step, loss=float("nan") if bad else 2.0 + 0.01 * ((step * 7 + em.rank) % 5), grad_norm_local=1.0
                )
            time.sleep(0.005)  # a training loop's pace: the workload, not a wait
        for em in emitters:
            assert em.flush(60)
        sent[0] = last_step + 1
        wait_metric(
            serve.metrics_url,
            lambda s: metric(s, "sdcwatch_training_last_step", run=emitters[-1].run) >= last_step,
            90,
            f"the service to read step {last_step}",
        )
        if nan is not None:
            opened = lambda: [e for e in events() if e["change"] == "opened" and e["run"] == nan[0]]  # noqa: E731
            try:
                inc = wait_for(
                    lambda: next((e for e in opened() if e["first_step"] == nan[1]), None), 90, f"the NaN {nan}"
                )
            except AssertionError as exc:
                raise AssertionError(f"{exc}; serve said: {serve.stderr()[-3000:]}") from None
            assert inc["kind"] == "nonfinite" and inc["ranks"] == [2], inc
        return serve

    serve = None
    try:
        serve = serve_until(tmp_path / "a", 19)
        serve.stop()  # its final snapshot: the file and the topic
        state = json.loads((tmp_path / "a" / "pipeline-state.json").read_text())
        assert state["carried"]["auth_bindings"]["victim"] == "job-a"  # no guard: no start announced
        state["carried"]["auth_bindings"]["victim"] = "job-b"  # the run bound to another key
        _forge(bootstrap, state_topic, state, IN_2036, group=group)

        serve = serve_until(tmp_path / "a", 39, nan=("victim", 30))  # the same machine: its file
        said = [ln for ln in serve.lines if "resuming from the state file" in ln]
        assert len(said) == 1 and "not signed with this service's key" in said[0], serve.stderr()[-3000:]
        serve.stop()

        journal = json.dumps({"entries": {"opened|second:nonfinite:50": time.time()}}).encode()
        _send_raw(bootstrap, state_topic, f"j:both:{group}".encode(), journal)  # "announced already"
        serve = serve_until(tmp_path / "b", 59, nan=("second", 50))  # another machine: the topic's snapshot
        assert any(f"resuming from state topic {state_topic}" in ln for ln in serve.lines)
        assert any("journal of announced incidents is refused" in ln for ln in serve.lines)
        serve.stop()
    finally:
        for em in emitters:
            em.close(5)
        if serve is not None:
            serve.close()
