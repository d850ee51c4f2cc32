"""Decisions bound to one start of the job (issue 36, item 1): the guard announces a nonce, signed,
the service copies it into each decision it signs for the run, and the guard takes only a decision
carrying its own, fresh and numbered once; in process, then a real `sdcwatch serve` deciding for a
real guarded gloo job that is restarted under the same run name while a captured decision is replayed."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import pytest
from sdcwatch.core.control import ACTIONS, Decision, JobStart, decode_decision
from sdcwatch.core.signing import JobKey, Keyring
from sdcwatch.core.vocabulary import CONTROL_TOPIC
from sdcwatch.exporters.topics import ControlTopicSink
from memory_source import bus_sink
from sdcwatch.service.auth import Authenticator
from sdcwatch.service.control_policy import ControlPolicy
from sdcwatch.telemetry import MemoryBus
from sdcwatch.telemetry.guard.control_topic import DecisionCheck

KEY_A = JobKey.parse(f"job-a:a-secret-{uuid.uuid4().hex}")
KEY_B = JobKey.parse(f"job-b:b-secret-{uuid.uuid4().hex}")
DAY = 86_400.0


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _event(run: str, rank: int):
    from sdcwatch.core.incident import Incident, IncidentEvent, Severity

    name = f"{run}:silent_drift:50:r{rank}"
    return IncidentEvent("opened", Incident(name, run, "silent_drift", Severity.CRITICAL, 50, 50, "d", ranks=(rank,)))


def test_a_decision_for_an_earlier_start_stale_or_from_the_future_is_refused_counted_and_logged_once(caplog):
    clock = _Clock(1_800_000_000.0)
    first = DecisionCheck("r", KEY_A, clock=clock)
    restarted = DecisionCheck("r", KEY_A, clock=clock)  # the same run name after a torchrun restart
    assert first.start.nonce != restarted.start.nonce and len(first.start.nonce) == 32

    def signed(nonce: str, issued_at: float, seq: int) -> bytes:
        return Decision("r", "evict", "x", ranks=(1,), issued_at=issued_at, seq=seq, nonce=nonce).sign(KEY_A)

    captured = signed(first.start.nonce, clock.now, 7)
    assert first.take(captured) is not None  # the decision for the start it was made for
    with caplog.at_level(logging.WARNING, "sdcwatch.telemetry.guard.control_topic"):
        assert restarted.take(captured) is None  # replayed after the restart
        assert restarted.take(captured) is None
        assert restarted.take(signed("", clock.now, 8)) is None  # no nonce: an earlier service's
        assert restarted.take(signed(restarted.start.nonce, clock.now - 30 * DAY, 9)) is None
        assert restarted.take(signed(restarted.start.nonce, clock.now + DAY, 10)) is None
        assert restarted.take(b"{not json") is None
        assert restarted.take(Decision("r", "skip", "x", nonce=restarted.start.nonce).encode()) is None
    assert restarted.refused_by == {"malformed": 0, "signature": 2, "start": 3, "stale": 1, "future": 1, "replayed": 0}
    assert restarted.refused == 7
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and "another start" in lines[0] and "30 days" not in lines[0]
    assert "issued 2592000 s ago" in lines[1] and "ahead of this clock" in lines[2]
    # fresh, its own nonce, within the skew: taken once, in order
    ok = signed(restarted.start.nonce, clock.now + 20, 11)
    assert restarted.take(ok) is not None and restarted.take(ok) is None and restarted.replayed == 1
    # a guard without a key reads what an earlier release read
    assert DecisionCheck("r", None).take(Decision("r", "skip", "x").encode()) is not None


def test_the_service_copies_the_newest_announced_start_into_each_decision_it_signs_and_only_then():
    from sdcwatch.service.ingest import IngestDecoder, SchemaRegistry

    bus = MemoryBus()
    auth = Authenticator(Keyring([KEY_A, KEY_B]))
    dec = IngestDecoder(SchemaRegistry(), auth=auth)
    sink = bus_sink(ControlTopicSink, bus, policy=ControlPolicy(actions=True), keys=auth.key_of, nonces=auth.nonce_of)
    auth.bind(["legacy"], "job-a")  # a signed run whose guard announces nothing (an earlier release)
    sink.publish(_event("legacy", 1))
    start = JobStart("victim", started_at=time.time())
    dec.decode([("t", b"victim", KEY_A.sign(start.encode()))])
    sink.publish(_event("victim", 1))
    (_, legacy), (_, victim) = bus.messages(CONTROL_TOPIC)
    assert "nonce" not in json.loads(KEY_A.open(legacy))  # what an earlier guard reads, as before
    assert decode_decision(KEY_A.open(victim)).nonce == start.nonce


@pytest.mark.slow
def test_a_guard_with_a_key_and_no_bus_never_blocks_and_says_it_could_not_announce_its_start(caplog):
    from polling import wait_for
    from sdcwatch.telemetry.guard.control_topic import KafkaControl

    with caplog.at_level(logging.WARNING, "sdcwatch.telemetry.guard.control_topic"):
        reader = KafkaControl("127.0.0.1:1", run="r", key=KEY_A, telemetry_topic="t")
        assert reader.poll() == [] and not reader.announced  # the loop is not held up
        wait_for(lambda: "could not announce this start on t" in caplog.text, 120, "the warning")
        reader.close()
    assert not reader.announced and KEY_A._secret.decode() not in caplog.text


# -- a real service, a real guarded gloo job, a restart ------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
def test_a_captured_eviction_replayed_after_a_restart_does_not_stop_the_job_and_the_new_fault_is_found(
    bootstrap, tmp_path, monkeypatch
):
    """Before: the guard kept the last sequence number in memory from -1 and checked no time, so one
    captured ``evict`` re-published after a torchrun restart (same run name) stopped the job again,
    and a 30-day-old decision was taken. Now a real service evicts the first start for its NaN; the
    restarted job refuses the captured decision, a 30-day-old one and one from the future, trains
    on, and the service's own decision for the restart's NaN (found at its step and rank) evicts it."""
    pytest.importorskip("torch")
    from kafka import KafkaConsumer, KafkaProducer
    from polling import wait_for
    from serve_process import ServeProcess, Topics
    from test_hostile_trust import KEY_A as JOB_KEY
    from test_hostile_trust import _guarded_job, _opened
    from sdcwatch.telemetry.wire.transports import ensure_topic
    from sdcwatch.testbed.ddp import DDPSettings
    from sdcwatch.testbed.faultspec import FaultSpec

    secret = JOB_KEY._secret.decode()
    monkeypatch.setenv("SDCWATCH_KEY", f"job-a:{secret}")  # every rank (spawned) holds it
    keys = tmp_path / "keys"
    keys.write_text(f"job-a:{secret} runs=guarded-*\njob-b:{KEY_B._secret.decode()} runs=b-*\n")
    tag = uuid.uuid4().hex[:8]
    topics, control, run = Topics.fresh(tag), f"ctl.{tag}", f"guarded-{tag}"
    for topic in (control, topics.telemetry):
        ensure_topic(bootstrap, topic, 1)
    flags = ("--auth-key-file", str(keys), "--bus-control-topic", control, "--guard-actions")
    serve = ServeProcess(bootstrap, topics, tmp_path / "state", *flags, "--guard-on-nonfinite", "evict")
    serve.wait_banner()
    seen: list[bytes] = []  # the control topic as an attacker reads it
    stop = threading.Event()

    def watch_control() -> None:
        reader = KafkaConsumer(control, bootstrap_servers=[bootstrap], auto_offset_reset="earliest")
        while not stop.is_set():
            for msgs in reader.poll(timeout_ms=200).values():
                seen.extend(m.value for m in msgs)
        reader.close()

    watcher = threading.Thread(target=watch_control, daemon=True)
    watcher.start()
    producer = KafkaProducer(bootstrap_servers=[bootstrap], linger_ms=0)

    def job(nan_at: int) -> DDPSettings:
        nan = FaultSpec("nan", nan_at, rank=1, target="blocks.0.attn*")
        return DDPSettings(
            world=2,
            steps=400,
            run=run,
            bootstrap=bootstrap,
            topic=topics.telemetry,
            control_topic=control,
            guard={"mode": "act", "on_nonfinite": "none"},  # the NaN goes on to the service
            faults=(nan,),
            corpus_bytes=1 << 16,
            batch_size=2,
        )

    try:
        exit_code, _ = _guarded_job(bootstrap, job(10), lambda steps: None)
        assert exit_code == 16, "the service's decision did not evict the first start"
        captured = wait_for(lambda: seen[:1] or None, 30, "the service's decision on the control topic")[0]
        assert decode_decision(JOB_KEY.open(captured)).action == "evict"
        restarted_at = time.time()

        def replay(steps) -> None:
            def reached(step: int) -> bool:
                return any(r.time > restarted_at and r.step >= step for r in steps.records)

            wait_for(lambda: reached(5), 120, "step 5 of the restart")
            send = lambda v: producer.send(control, key=run.encode(), value=v).get(30)  # noqa: E731
            send(captured)  # the captured eviction, as it was
            now = time.time()
            for at in (now - 30 * DAY, now + DAY):  # signed with the job's key, for no start of it
                send(Decision(run, "evict", "old", ranks=(1,), issued_at=at, seq=int(now * 1e6)).sign(JOB_KEY))
            wait_for(lambda: reached(60), 240, "step 60 of the restart")  # it trains on, past the replays

        exit_code, records = _guarded_job(bootstrap, job(150), replay)
        second = [r for r in records if r.time > restarted_at]
        assert exit_code == 16, "the service's decision for the restart did not evict it"
        evicted = [r.step for r in second if r.scalars.get("guard_action") == ACTIONS.index("evict")]
        assert evicted and min(evicted) > 150, f"the restart was evicted at step {min(evicted)}, before its NaN"
        for rank in (0, 1):
            got = sorted({r.step for r in second if r.rank == rank})
            assert got[:151] == list(range(151)), f"records of rank {rank} of the restart were lost"
        nan = wait_for(
            lambda: next((e for e in _opened(serve, run) if e["first_step"] == 150), None), 90, "the NaN at 150"
        )
        assert nan["kind"] == "nonfinite" and nan["ranks"] == [1], nan
        decided = [d for d in (decode_decision(JOB_KEY.open(v)) for v in seen) if d.reason != "old"]
        assert len({d.nonce for d in decided}) == 2 and all(d.nonce for d in decided)  # one per start
    finally:
        stop.set()
        watcher.join(10)
        producer.close()
        serve.close()
