"""Signed telemetry and control: what a forger on the bus can no longer do (in process; the live
attacks on a real `sdcwatch serve` are in test_hostile.py)."""

from __future__ import annotations

import json
import logging

import pytest
from detector_synth import Fault, SyntheticRun
from polling import step_until
from sdcwatch.core.control import Decision, open_decision
from sdcwatch.core.errors import ConfigError, ControlError
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.signing import SERVICE_KID, AuthError, JobKey, Keyring, job_key_from_env
from sdcwatch.core.vocabulary import CONTROL_TOPIC, TELEMETRY_TOPIC
from sdcwatch.service.auth import Authenticator
from memory_source import MemorySource, bus_sink
from sdcwatch.exporters.topics import ControlTopicSink
from sdcwatch.service.control_policy import ControlPolicy
from sdcwatch.service.ingest import IngestDecoder, SchemaRegistry
from sdcwatch.service.loop import DetectorService
from sdcwatch.telemetry import MemoryBus, MemoryTransport
from sdcwatch.telemetry.guard.control_topic import DecisionCheck
from stand_ins import ListSink

SECRET_A = "a-secret-of-job-a-0123456789"
SECRET_B = "b-secret-of-job-b-9876543210"
KEY_A = JobKey.parse(f"job-a:{SECRET_A}")
KEY_B = JobKey.parse(f"job-b:{SECRET_B}")


def _messages(synth: SyntheticRun, steps, wire: str = "v2") -> list[tuple[bytes | None, bytes]]:
    """The bus messages a real transport sends for ``steps`` of ``synth`` (unsigned)."""
    staging = MemoryBus()
    tr = MemoryTransport(staging)
    for s in steps:
        recs = synth.records(s)
        if wire == "v2":
            recs = [
                PackedRecord.pack(
                    r.run, r.host, r.step, r.rank, r.world, r.local_rank, r.time, r.scalars, r.fingerprints, r.layers
                )
                for r in recs
            ]
        tr.send(recs)
    return staging.messages(TELEMETRY_TOPIC)


def _put(bus: MemoryBus, messages, key: JobKey | None) -> None:
    for k, v in messages:
        bus.append(TELEMETRY_TOPIC, k, v if key is None else key.sign(v))


def _service(bus: MemoryBus, auth: Authenticator, sinks=()) -> DetectorService:
    source = MemorySource(bus, ingest=IngestDecoder(SchemaRegistry(), auth=auth))
    return DetectorService(source, sinks=list(sinks), poll_timeout=0.01)


def _drain(svc: DetectorService) -> None:
    step_until(svc.step, lambda: svc.source.lag() == 0, 120, "the source drained")
    for _ in range(3):
        svc.step()


def test_a_signed_run_is_watched_and_forged_unsigned_or_foreign_records_reach_no_detector():
    bus = MemoryBus()
    real = SyntheticRun(seed=1, run="victim", faults=[Fault("nonfinite", 70, rank=2)])
    forged = SyntheticRun(seed=9, run="victim", faults=[Fault("nonfinite", 40, rank=3)])
    # the run's first messages bind it to job-a's key
    _put(bus, _messages(real, range(0, 30)), KEY_A)
    # a forger without the key: unsigned records "from rank 3" with a NaN, and a tampered message
    _put(bus, _messages(forged, range(40, 41)), None)
    k, v = _messages(forged, range(41, 42))[0]
    signed = bytearray(KEY_A.sign(v))
    signed[-3] ^= 0x40
    bus.append(TELEMETRY_TOPIC, k, bytes(signed))
    # another job's key (held by the service) may not speak for this run
    _put(bus, _messages(forged, range(42, 43)), KEY_B)
    _put(bus, _messages(real, range(30, 100)), KEY_A)
    sink = ListSink()
    svc = _service(bus, Authenticator(Keyring([KEY_A, KEY_B])), [sink])
    _drain(svc)
    opened = sink.opened
    assert [(i.kind, i.first_step, i.ranks) for i in opened] == [("nonfinite", 70, (2,))]
    per_step = len(_messages(forged, range(40, 41)))  # one message per host
    assert svc.source.dead_letter_reasons == {"auth": 2 * per_step + 1}
    reasons = [d.reason for d in svc.source.dead_letter_log]
    assert any("not signed" in r for r in reasons)
    assert any("forged or altered" in r for r in reasons)
    assert any("bound to key 'job-a'" in r for r in reasons)
    assert svc.source.ingest.auth.key_of("victim") is KEY_A
    assert all(SECRET_A not in r and SECRET_B not in r for r in reasons)


def test_unsigned_accept_mode_reads_unsigned_runs_but_never_for_a_run_bound_to_a_key():
    bus = MemoryBus()
    _put(bus, _messages(SyntheticRun(seed=2, run="signed"), range(0, 5)), KEY_A)
    _put(bus, _messages(SyntheticRun(seed=3, run="legacy"), range(0, 5), wire="v1"), None)
    _put(bus, _messages(SyntheticRun(seed=4, run="signed"), range(5, 6)), None)
    svc = _service(bus, Authenticator(Keyring([KEY_A]), unsigned="accept"))
    _drain(svc)
    refused = len(_messages(SyntheticRun(seed=4, run="signed"), range(5, 6)))
    assert svc.source.dead_letter_reasons == {"auth": refused}
    assert "signs with key 'job-a'; this message is unsigned" in svc.source.dead_letter_log[0].reason
    assert svc.pipeline.records_total == 5 * 8 * 2  # both runs' first five steps, nothing of the forgery


def test_a_message_signed_with_a_key_the_service_does_not_hold_is_refused_naming_the_key_id_only():
    bus = MemoryBus()
    stranger = JobKey.parse("stranger:another-secret-0123456789")
    msgs = _messages(SyntheticRun(run="x"), range(0, 2))
    _put(bus, msgs, stranger)
    svc = _service(bus, Authenticator(Keyring([KEY_A])))
    _drain(svc)
    assert svc.pipeline.records_total == 0
    assert svc.source.dead_letter_reasons == {"auth": len(msgs)}
    assert "'stranger', which this service does not hold" in svc.source.dead_letter_log[0].reason


def test_keys_are_checked_and_no_error_or_repr_shows_a_secret(tmp_path):
    with pytest.raises(ConfigError) as e:
        JobKey.parse("job:short")
    assert "short" not in str(e.value).replace("at least", "")
    with pytest.raises(ConfigError, match="kid:secret"):
        JobKey.parse("no-colon-here-0123456789")
    assert SECRET_A not in repr(KEY_A) and SECRET_A not in str(Keyring([KEY_A]))
    f = tmp_path / "keys"
    f.write_text(f"# the service's keys\njob-a:{SECRET_A}\n\njob-b:{SECRET_B}\n")
    assert Keyring.from_file(f).kids == ("job-a", "job-b")
    with pytest.raises(ConfigError, match="exactly one key"):
        job_key_from_env({"SDCWATCH_KEY_FILE": str(f)})
    assert job_key_from_env({"SDCWATCH_KEY": f"job-a:{SECRET_A}"}).kid == "job-a"
    assert job_key_from_env({}) is None
    f.write_text(f"job-a:{SECRET_A}\njob-a:{SECRET_B}\n")
    with pytest.raises(ConfigError, match="given twice") as e:
        Keyring.from_file(f)
    assert SECRET_A not in str(e.value) and SECRET_B not in str(e.value)
    with pytest.raises(AuthError, match="not signed"):
        Keyring([KEY_A]).verify(b"SDC2 unsigned")


def test_a_service_key_line_is_the_only_source_of_the_services_key_and_verifies_no_telemetry(tmp_path, caplog):
    """Before: the service's key was made from every job key of the file, so with a one-key file that
    job could make it (and sign the state and anomalies topics). A ``sdcwatch.service`` line is now
    its only source; a file without one keeps the derivation from the job keys."""
    service_line = f"{SERVICE_KID}:the-services-own-secret-0123456789"
    ring = Keyring.from_text(f"job-a:{SECRET_A}\n{service_line}\n")
    assert ring.kids == ("job-a",) and SERVICE_KID not in ring and "services-own" not in repr(ring)
    for purpose in ("state", "anomalies"):
        assert ring.service_key(purpose).tag(b"m") != Keyring([KEY_A]).service_key(purpose).tag(b"m")
    rotated = Keyring.from_text(f"job-b:{SECRET_B}\n{service_line}\n")  # job keys change, the service's does not
    assert rotated.service_key("state").tag(b"m") == ring.service_key("state").tag(b"m")
    without = Keyring.from_text(f"job-a:{SECRET_A}\njob-b:{SECRET_B}\n")  # as before: from every job key
    assert without.service is None
    assert without.service_key("state").tag(b"m") == Keyring([KEY_A, KEY_B]).service_key("state").tag(b"m")
    forged = JobKey.parse(service_line).sign(b"a record")  # the service's key speaks for no run
    with pytest.raises(AuthError, match="does not hold"):
        Authenticator(ring).open(forged)
    for bad in (f"{service_line} runs=job-*", f"{service_line}\n{service_line}"):
        with pytest.raises(ConfigError, match=SERVICE_KID) as e:
            Keyring.from_text(bad)
        assert "services-own" not in str(e.value)
    f = tmp_path / "reader-keys"  # a reader of the anomalies topic needs the service's line alone
    f.write_text(service_line + "\n")
    reader = Keyring.from_file(f)
    assert reader.service_key("anomalies").tag(b"m") == ring.service_key("anomalies").tag(b"m")
    with pytest.raises(ConfigError, match="holds no key"):
        Authenticator(reader)
    with caplog.at_level(logging.WARNING, "sdcwatch.service.auth"):  # the caveat, said at start
        Authenticator(Keyring([KEY_A])).warn_unrestricted()
        said = caplog.text
        caplog.clear()
        Authenticator(ring).warn_unrestricted()
    assert f"no {SERVICE_KID} line" in said and "'job-a' alone" in said and f"no {SERVICE_KID} line" not in caplog.text


# -- control ------------------------------------------------------------------------------------


def _incident_event(run: str, rank: int = 1):
    from sdcwatch.core.incident import Incident, IncidentEvent, Severity

    name = f"{run}:silent_drift:50:r{rank}"
    inc = Incident(name, run, "silent_drift", Severity.CRITICAL, 50, 50, "drift", ranks=(rank,), hosts=("node0",))
    return IncidentEvent("opened", inc)


def test_the_service_signs_each_runs_decisions_with_its_key_and_the_guard_refuses_forgeries_and_replays():
    bus = MemoryBus()
    auth = Authenticator(Keyring([KEY_A, KEY_B]))
    guard = DecisionCheck("victim", KEY_A)
    announced = [("t", b"victim", KEY_A.sign(guard.start.encode()))]  # as KafkaControl sends it
    assert IngestDecoder(SchemaRegistry(), auth=auth).decode(announced) == ([], [])
    assert auth.key_of("victim") is KEY_A and auth.nonce_of("victim") == guard.start.nonce
    sink = bus_sink(ControlTopicSink, bus, policy=ControlPolicy(actions=True), keys=auth.key_of, nonces=auth.nonce_of)
    sink.publish(_incident_event("victim", 1))
    sink.publish(_incident_event("victim", 2))
    (_, first), (_, second) = bus.messages(CONTROL_TOPIC)
    d1 = guard.take(first)
    assert d1 is not None and d1.action == "evict" and d1.ranks == (1,) and d1.seq > 0
    assert guard.take(first) is None  # replayed
    d2 = guard.take(second)
    assert d2 is not None and d2.ranks == (2,) and d2.seq > d1.seq
    assert guard.take(first) is None  # an older decision after a newer one
    forged = Decision("victim", "evict", "forged", ranks=(1,), seq=d2.seq + 10**9)
    assert guard.take(forged.encode()) is None  # unsigned
    assert guard.take(forged.sign(KEY_B)) is None  # another job's key
    tampered = bytearray(second)
    tampered[-5] ^= 1
    assert guard.take(bytes(tampered)) is None
    assert guard.refused == 5 and guard.replayed == 2
    # a guard without a key reads unsigned decisions as before, and refuses signed ones it cannot check
    legacy = DecisionCheck("victim", None)
    assert legacy.take(forged.encode()) is not None
    assert legacy.take(second) is None
    with pytest.raises(ControlError, match="signature"):
        open_decision(forged.encode(), KEY_A)


def test_an_unbound_runs_decisions_go_unsigned_in_the_earlier_releases_form():
    """A run that signs nothing gets its decisions as before: unsigned, and without the fields an
    earlier guard would refuse as unknown (``seq``, ``checkpoint``)."""
    bus = MemoryBus()
    sink = bus_sink(ControlTopicSink, bus, policy=ControlPolicy(actions=True), keys=lambda run: None)
    sink.publish(_incident_event("open-run"))
    ((_, value),) = bus.messages(CONTROL_TOPIC)
    body = json.loads(value)
    assert body["run"] == "open-run" and body["action"] == "evict"
    earlier = {"run", "action", "reason", "ranks", "hosts", "since_step", "incident", "lr_factor", "issued_at"}
    assert set(body) == earlier


def test_the_runs_bindings_survive_a_restart_so_no_other_key_takes_a_run_over_after_it(tmp_path):
    bus = MemoryBus()
    _put(bus, _messages(SyntheticRun(seed=1, run="victim"), range(0, 5)), KEY_A)
    first = DetectorService(
        MemorySource(bus, ingest=IngestDecoder(SchemaRegistry(), auth=Authenticator(Keyring([KEY_A, KEY_B])))),
        state_dir=tmp_path,
        poll_timeout=0.01,
    )
    _drain(first)
    first.close()
    taker = _messages(SyntheticRun(seed=2, run="victim"), range(5, 6))
    _put(bus, taker, KEY_B)  # after the restart, another job's key tries to speak for the run first
    source = MemorySource(bus, ingest=IngestDecoder(SchemaRegistry(), auth=Authenticator(Keyring([KEY_A, KEY_B]))))
    source._offset = 5 * len(taker)
    second = DetectorService(source, state_dir=tmp_path, poll_timeout=0.01)
    assert second.resumed and source.ingest.auth.key_of("victim") is KEY_A
    _drain(second)
    assert source.dead_letter_reasons == {"auth": len(taker)}


# -- issue 36: replays (item 4), unsigned evidence before a binding (item 9) -----------------------


def _victim_read_to_step_30():
    """A signed 8-rank run with a NaN at step 20 on rank 2, its steps 0-29 (one start of job-a's key)
    on the bus and read: (bus, the run, its signer, its messages, the sink, the authenticator, the service)."""
    bus = MemoryBus()
    real = SyntheticRun(seed=1, run="victim", faults=[Fault("nonfinite", 20, rank=2)])
    signer = JobKey.parse(f"job-a:{SECRET_A}")  # one rank process's start
    first = [(k, signer.sign(v)) for k, v in _messages(real, range(0, 30))]
    for k, v in first:
        bus.append(TELEMETRY_TOPIC, k, v)
    sink = ListSink()
    auth = Authenticator(Keyring([KEY_A]))
    svc = _service(bus, auth, [sink])
    _drain(svc)
    return bus, real, signer, first, sink, auth, svc


def test_a_replayed_signed_message_is_refused_counted_as_replayed_and_the_run_loses_nothing():
    """Before: replaying a run's signed messages reopened its NaN and recreated it; replayed end
    markers ended a live run. Each message carries its signer's start and number: taken once."""
    bus, real, signer, first, sink, auth, svc = _victim_read_to_step_30()
    restarted = JobKey.parse(f"job-a:{SECRET_A}")  # the job again, a new start of the same key
    _put(bus, _messages(real, range(30, 40)), restarted)
    for k, v in first:  # the whole first part again: its NaN at 20 among it
        bus.append(TELEMETRY_TOPIC, k, v)
    _put(bus, _messages(real, range(40, 60)), restarted)
    _drain(svc)
    assert [(i.kind, i.first_step, i.ranks) for i in sink.opened] == [("nonfinite", 20, (2,))]
    assert svc.source.dead_letter_reasons == {"auth": len(first)}
    assert auth.refused == {("job-a", "replayed"): len(first)}
    assert svc.pipeline.records_total == 60 * 8


def test_a_rebalance_rereading_taken_messages_takes_them_again_and_a_true_replay_stays_refused():
    """Before: after a consumer-group rebalance, the messages the new owner re-read from the committed
    offset were refused `replayed`, dead-lettered and counted as attacks. The very message read again
    at its place is taken again (the pipeline drops what it had) and counted apart; the same bytes
    appended again are not."""
    from prometheus_client import CollectorRegistry, generate_latest
    from sdcwatch.exporters import SdcwatchCollector

    bus, real, signer, first, sink, auth, svc = _victim_read_to_step_30()
    owner = MemorySource(bus, ingest=svc.source.ingest)  # the partition back, from the committed offset (0)
    reread = owner.poll()
    assert sum(len(block.to_records()) for block in reread) == 30 * 8 and owner.dead_letters == 0
    assert auth.redelivered == {"job-a": len(first)} and auth.refused == {}
    for k, v in first[:3]:  # the same bytes published again: a replay, at offsets never read
        bus.append(TELEMETRY_TOPIC, k, v)
    _put(bus, _messages(real, range(30, 40)), signer)
    _drain(svc)
    assert auth.refused == {("job-a", "replayed"): 3} and svc.source.dead_letter_reasons == {"auth": 3}
    assert auth.redelivered == {"job-a": len(first)}
    assert [(i.kind, i.first_step, i.ranks) for i in sink.opened] == [("nonfinite", 20, (2,))]
    assert svc.pipeline.records_total == 40 * 8
    registry = CollectorRegistry()
    view = svc.pipeline.view(auth_redelivered=dict(auth.redelivered), auth_runs_refused=dict(auth.refused))
    registry.register(SdcwatchCollector(lambda: view))
    text = generate_latest(registry).decode()
    assert f'sdcwatch_auth_redelivered_total{{key="job-a"}} {float(len(first))}' in text
    assert 'sdcwatch_auth_runs_refused_total{key="job-a",reason="replayed"} 3.0' in text


def test_signer_starts_take_each_number_once_in_any_order_and_across_a_restart():
    from sdcwatch.service.auth import SignerStarts

    starts = SignerStarts(max_starts=2, max_gaps=2, clock=lambda: 1000.0)
    a = b"aaaaaaaa"
    assert [starts.check("k", (a, 10.0, n)) for n in (0, 1, 5, 3, 2, 4)] == [None] * 6  # out of order: each once
    assert [starts.check("k", (a, 10.0, n))[0] for n in (0, 3, 5)] == ["replayed"] * 3
    assert starts.check("k", None)[0] == "unfresh"  # a key that signs fresh: no envelope without a start
    assert starts.check("other", None) is None  # an earlier release's emitter, its key never fresh: as before
    assert starts.check("k", (b"zzzzzzzz", 2000.0, 0))[0] == "future"
    again = SignerStarts(max_starts=2, clock=lambda: 1000.0)
    again.restore(json.loads(json.dumps(starts.snapshot())))
    assert again.check("k", (a, 10.0, 4))[0] == "replayed" and again.check("k", (a, 10.0, 6)) is None
    assert again.check("k", (b"bbbbbbbb", 20.0, 0)) is None and again.check("k", (b"cccccccc", 30.0, 0)) is None
    assert again.check("k", (a, 10.0, 7))[0] == "stale"  # forgotten (the bound): no newer than one forgotten
    assert again.check("k", (b"dddddddd", 9.0, 0))[0] == "stale"


def test_a_signer_writing_several_partitions_loses_nothing_when_they_are_read_unevenly():
    """Before: at most 64 spans a start. One key object signing for 8 ranks writes 8 partitions; read
    a poll of 5,000 messages a partition at a time, its numbers open thousands of gaps, and past 64
    the oldest was filled: its messages, read later from the other partitions, were refused
    ``replayed`` (888 records of an 8-rank run lost). The gaps are bounded by key, far above a poll."""
    from sdcwatch.service.auth import SignerStarts

    a, parts, total, poll = b"aaaaaaaa", 8, 80_000, 5_000
    starts = SignerStarts(clock=lambda: 1000.0)
    by_partition = {p: list(range(p, total, parts)) for p in range(parts)}  # round-robin, as a producer spreads
    refused = []
    for first in range(0, total // parts, poll):  # each poll: up to 5,000 messages of each partition in turn
        for p in range(parts):
            for k, n in enumerate(by_partition[p][first : first + poll], start=first):
                refusal = starts.check("k", (a, 10.0, n), (f"t/{p}", k))
                if refusal is not None:
                    refused.append(n)
    assert refused == []
    assert starts.snapshot()["starts"] == [["k", a.hex(), 10.0, [[0, total - 1]]]]  # the gaps closed: one span
    replays = [starts.check("k", (a, 10.0, n), ("t/3", total + n)) for n in (0, 4_999, 79_999)]
    assert [r[0] for r in replays] == ["replayed"] * 3


def test_one_keys_starts_and_gaps_never_cost_another_key_its_start():
    """Before: one bound over every key's starts. Another tenant's key opening more starts than the
    bound made a live job's start the least recently heard: forgotten, and its next message refused
    ``stale``. Starts and gaps are now bounded by key: a flood costs its own key."""
    from sdcwatch.service.auth import SignerStarts

    starts = SignerStarts(max_starts=100, max_gaps=50, clock=lambda: 1000.0)
    job = b"jjjjjjjj"
    assert [starts.check("job-a", (job, 10.0, n)) for n in (0, 1, 3)] == [None] * 3  # one gap of its own
    for i in range(1_000):  # another tenant: 1,000 starts, each with a hole
        nonce = i.to_bytes(8, "big")
        assert starts.check("tenant-b", (nonce, 20.0 + i, 0)) is None
        assert starts.check("tenant-b", (nonce, 20.0 + i, 2)) is None
    for n in range(0, 2_000, 2):  # and one start of it opening a thousand gaps
        starts.check("tenant-b", (b"gggggggg", 1_200.0, n))
    held = {
        kid: sum(len(spans) - 1 for k, _, _, spans in starts.snapshot()["starts"] if k == kid)
        for kid in ("job-a", "tenant-b")
    }
    assert held == {"job-a": 1, "tenant-b": 50} and len(starts) <= 101
    assert starts.check("job-a", (job, 10.0, 4)) is None and starts.check("job-a", (job, 10.0, 2)) is None
    assert starts.check("job-a", (job, 10.0, 3))[0] == "replayed"
    assert starts.check("tenant-b", (b"gggggggg", 1_200.0, 1))[0] == "replayed"  # its own oldest gap, filled
    assert starts.check("tenant-b", (b"gggggggg", 1_200.0, 1_999)) is None  # its newest gap still open


def test_a_message_checked_before_a_restart_is_told_from_a_replay_by_its_offset():
    """Before: the state kept the numbers of messages the reader had checked but the pipeline not yet
    taken; read again after a restart from the committed offset, they were refused ``replayed`` and
    their records lost. The offsets checked are kept with the numbers."""
    from sdcwatch.service.auth import SignerStarts

    a = b"aaaaaaaa"
    starts = SignerStarts(clock=lambda: 1000.0)
    assert [starts.check("k", (a, 10.0, n), ("t/0", 100 + n)) for n in range(5)] == [None] * 5
    again = SignerStarts(clock=lambda: 1000.0)
    again.restore(json.loads(json.dumps(starts.snapshot())))
    assert [again.check("k", (a, 10.0, n), ("t/0", 100 + n))[0] for n in (2, 3, 4)] == ["redelivered"] * 3
    assert again.check("k", (a, 10.0, 1), ("t/0", 105))[0] == "replayed"  # appended past what was read
    assert again.check("k", (a, 10.0, 2), ("t/1", 7))[0] == "replayed"  # another partition: never read there
    assert again.check("k", (a, 10.0, 5), ("t/0", 106)) is None


def test_with_unsigned_accept_what_a_run_sent_unsigned_before_its_first_signed_message_does_not_stand():
    """Before: unsigned NaN records sent before a run's first signed message framed rank 3 and raised
    a false missing_rank for the 7 real ranks. Once the run binds to a key, they are discarded."""
    import math
    import time

    from sdcwatch.core.record import encode
    from sdcwatch.core.record_type import Record

    def forged(step: int) -> bytes:
        scalars = {"loss": math.nan, "nonfinite": 1.0}
        return encode(Record("victim", step, 3, 8, "evil", time.time(), 0, scalars, {}, {}))

    bus = MemoryBus()
    real = SyntheticRun(seed=5, run="victim", faults=[Fault("nonfinite", 30, rank=2)])
    for step in range(0, 3):  # a forger first, unsigned
        bus.append(TELEMETRY_TOPIC, b"evil", forged(step))
    sink = ListSink()
    svc = _service(bus, Authenticator(Keyring([KEY_A]), unsigned="accept"), [sink])
    svc.step()  # read alone: the forged steps wait in the aligner for the other ranks
    bus.append(TELEMETRY_TOPIC, b"evil", forged(3))  # and one more in the poll of the first signed message
    _put(bus, _messages(real, range(0, 50)), KEY_A)
    _drain(svc)
    assert [(i.kind, i.first_step, i.ranks) for i in sink.opened] == [("nonfinite", 30, (2,))]
    assert svc.source.ingest.auth.key_of("victim") is KEY_A
    assert svc.pipeline.records_total - 3 == 50 * 8  # the first three forged were read before the binding
