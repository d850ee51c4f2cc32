"""The emitter's side of the job key: every message its transport sends is signed, on the sender thread.

Records, layer names and the end-of-run marker, on v1 and v2, through the in-memory bus and the
real embedded broker; the key from ``key=``, ``SDCWATCH_KEY`` or ``SDCWATCH_KEY_FILE``; an unusable
key refused in the constructor, naming where it came from and never showing the secret.
"""

from __future__ import annotations

import logging
import threading
import traceback

import pytest
from polling import wait_for
from sdcwatch.core.messages import decode_stream
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.rank_notes import NAMES_MAGIC
from sdcwatch.core.signing import AuthError, JobKey, Keyring, is_signed
from sdcwatch.telemetry import Emitter, FileTransport, KafkaTransport, MemoryBus, MemoryTransport, is_end_marker

SECRET = "Zq7-UNIQUE-s3cret-9f2b41"
KEY = JobKey("job-a", SECRET.encode())
RING = Keyring([KEY])


def run_into(bus: MemoryBus, *, wire: str, key=None, env=None, steps: int = 40) -> Emitter:
    em = Emitter(MemoryTransport(bus), run="r", rank=1, world=2, host="h", wire=wire, key=key, env=env or {})
    em.set_names({"layers": ["model.layers.0", "model.layers.1"]})
    for step in range(steps):
        em.emit(step, time=100.0 + step, loss=1.0 / (step + 1), layers={"attn_entropy": [1.0, 2.0]})
    assert em.flush(10)
    em.close()
    return em


@pytest.mark.parametrize("wire", ["v2", "v1"])
def test_signed_messages_verify_and_carry_the_same_payload_as_unsigned_ones(wire):
    plain, signed = MemoryBus(), MemoryBus()
    run_into(plain, wire=wire)
    em = run_into(signed, wire=wire, key=KEY)
    assert em.key is KEY and em.transport.key is KEY
    got, want = signed.messages(em.transport.topic), plain.messages(em.transport.topic)
    assert len(got) == len(want) >= 4  # names, records (more than one key window), the end marker
    kinds = set()
    for (k1, v1), (k0, v0) in zip(got, want):
        assert is_signed(v1) and not is_signed(v0) and k1 == k0
        kid, message = RING.verify(v1)
        assert kid == "job-a"
        kinds.add(bytes(message[:4]))
        if message[:4] == NAMES_MAGIC or not is_end_marker(decode_stream([message])[-1]):
            assert message == v0  # the same bytes: only the envelope is new
    assert NAMES_MAGIC in kinds  # the layer names were signed too
    recs = signed.records(em.transport.topic, keyring=RING)
    assert [r.step for r in recs] == list(range(40)) + [39] and is_end_marker(recs[-1])
    assert [(r.step, r.scalars, r.layers) for r in recs[:-1]] == [
        (r.step, r.scalars, r.layers) for r in plain.records(em.transport.topic)[:-1]
    ]
    with pytest.raises(Exception, match="signed message"):
        signed.records(em.transport.topic)  # a signed topic is not read as if it were not


def test_altering_any_byte_of_a_signed_message_fails_verification():
    bus = MemoryBus()
    em = run_into(bus, wire="v2", key=KEY, steps=3)
    value = bus.messages(em.transport.topic)[1][1]
    assert RING.verify(value)[1]
    for at in range(len(value)):
        bad = bytearray(value)
        bad[at] ^= 0x01
        with pytest.raises(AuthError):
            RING.verify(bytes(bad))
    with pytest.raises(AuthError):
        Keyring([JobKey("job-a", b"another-secret-of-16b")]).verify(value)  # same key id, other secret


def test_the_key_comes_from_the_environment_the_file_first(tmp_path):
    path = tmp_path / "job.key"
    path.write_text("from-file:" + SECRET + "-file\n")
    for env, kid in (
        ({"SDCWATCH_KEY": "from-var:" + SECRET}, "from-var"),
        ({"SDCWATCH_KEY_FILE": str(path)}, "from-file"),
        ({"SDCWATCH_KEY_FILE": str(path), "SDCWATCH_KEY": "from-var:" + SECRET}, "from-file"),
    ):
        bus = MemoryBus()
        em = run_into(bus, wire="v2", env=env, steps=2)
        assert em.key.kid == kid
        values = [v for _, v in bus.messages(em.transport.topic)]
        ring = Keyring([JobKey("from-var", SECRET.encode()), JobKey("from-file", (SECRET + "-file").encode())])
        assert values and all(ring.verify(v)[0] == kid for v in values)
    bus = MemoryBus()
    em = run_into(bus, wire="v2", env={}, steps=2)  # no key anywhere: unsigned, as before
    assert em.key is None and not any(is_signed(v) for _, v in bus.messages(em.transport.topic))
    # an explicit key wins over the environment
    em = run_into(MemoryBus(), wire="v2", key="given:" + SECRET, env={"SDCWATCH_KEY": "from-var:" + SECRET})
    assert em.key.kid == "given"


def test_the_emitters_default_kafka_transport_signs_with_the_environments_key():
    env = {"SDCWATCH_BOOTSTRAP": "127.0.0.1:1", "SDCWATCH_KEY": "from-var:" + SECRET}
    em = Emitter(run="r", rank=0, world=1, host="h", env=env)
    try:
        assert isinstance(em.transport, KafkaTransport) and em.transport.key.kid == "from-var"
    finally:
        em.close(0.3)


def bad_keys(tmp_path):
    binary = tmp_path / "binary.key"
    binary.write_bytes(b"job-a:\xff\xfe" + SECRET.encode())
    two = tmp_path / "two.key"
    two.write_text(f"a:{SECRET}\nb:{SECRET}\n")
    return [
        (dict(env={"SDCWATCH_KEY": SECRET}), "SDCWATCH_KEY"),  # no key id: the secret alone
        (dict(env={"SDCWATCH_KEY": "job-a:" + SECRET[:9]}), "SDCWATCH_KEY"),  # too short
        (dict(env={"SDCWATCH_KEY": "job a!:" + SECRET}), "SDCWATCH_KEY"),  # a bad key id
        (dict(env={"SDCWATCH_KEY_FILE": str(tmp_path / "missing.key")}), "SDCWATCH_KEY_FILE"),
        (dict(env={"SDCWATCH_KEY_FILE": str(binary)}), "SDCWATCH_KEY_FILE"),
        (dict(env={"SDCWATCH_KEY_FILE": str(two)}), "SDCWATCH_KEY_FILE"),
        (dict(env={}, key=SECRET), "key"),
        (dict(env={}, key=b"job-a:" + SECRET.encode()), "key"),
    ]


def test_an_unusable_key_fails_in_the_constructor_naming_the_variable_never_the_secret(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    before = threading.active_count()
    for kwargs, where in bad_keys(tmp_path):
        with pytest.raises(ConfigError) as info:
            Emitter(MemoryTransport(MemoryBus()), run="r", rank=0, world=1, host="h", **kwargs)
        exc = info.value
        assert exc.key == where, (kwargs, str(exc))
        shown = "".join(traceback.format_exception(exc)) + repr(exc)
        for part in (SECRET, SECRET[:9], SECRET[-9:]):
            assert part not in shown, shown
    assert threading.active_count() == before  # failed before any sender thread started
    for part in (SECRET, SECRET[:9], SECRET[-9:]):
        assert part not in caplog.text
    assert SECRET not in repr(KEY) and SECRET not in str(RING)


def test_signing_happens_on_the_sender_thread_never_in_emit():
    threads: list[str] = []

    class WatchedKey(JobKey):
        def sign(self, message: bytes) -> bytes:
            threads.append(threading.current_thread().name)
            return super().sign(message)

    key = WatchedKey("job-a", SECRET.encode())
    bus = MemoryBus()
    em = Emitter(MemoryTransport(bus), run="r", rank=3, world=4, host="h", key=key, env={})
    for step in range(200):
        em.emit(step, loss=1.0)
    assert em.flush(10)
    assert threads and set(threads) == {"sdcwatch-emitter-3"}
    em.close()
    assert len(bus.records(em.transport.topic, keyring=Keyring([key]))) == 201


def test_a_file_transport_writes_unsigned_lines_and_says_so_once(tmp_path, caplog):
    path = tmp_path / "cap.jsonl"
    with caplog.at_level(logging.WARNING, logger="sdcwatch.telemetry"):
        with Emitter(FileTransport(path), run="r", rank=0, world=1, host="h", key=KEY) as em:
            em.emit(0, loss=1.0)
    assert "FileTransport does not sign" in caplog.text and SECRET not in caplog.text
    assert path.read_text().startswith("{")


def test_a_transport_with_its_own_key_keeps_it_and_a_different_explicit_key_is_refused():
    other = JobKey("job-b", b"another-secret-of-16b")
    em = Emitter(MemoryTransport(MemoryBus(), key=other), run="r", rank=0, world=1, host="h", env={})
    assert em.key is other
    em.close()
    with pytest.raises(ConfigError, match="job-b"):
        Emitter(MemoryTransport(MemoryBus(), key=other), run="r", rank=0, world=1, host="h", key=KEY)
    with pytest.raises(ConfigError) as info:
        MemoryTransport(MemoryBus(), key="job-a:" + SECRET)
    assert info.value.key == "key" and SECRET not in str(info.value)


@pytest.mark.integration
@pytest.mark.parametrize("wire", ["v2", "v1"])
def test_the_kafka_transports_messages_on_the_real_broker_are_signed(bootstrap, unique_topic, wire):
    from sdcwatch.core.kafka import new_consumer

    em = Emitter(KafkaTransport(bootstrap, unique_topic), run="r", rank=0, world=1, host="h", wire=wire, key=KEY)
    em.set_names({"layers": ["model.layers.0", "model.layers.1"]})
    for step in range(50):
        em.emit(step, loss=float(step), layers={"attn_entropy": [1.0, 2.0]})
    assert em.flush(30)
    em.close()
    assert em.ended and em.transport.key is KEY
    from kafka import TopicPartition

    consumer = new_consumer(bootstrap, auto_offset_reset="earliest", enable_auto_commit=False)
    parts = [TopicPartition(unique_topic, p) for p in consumer.partitions_for_topic(unique_topic)]
    consumer.assign(parts)  # the raw messages of every partition, no group to join
    consumer.seek_to_beginning(*parts)
    values: list[bytes] = []
    recs: list = []

    def all_in() -> bool:
        for batch in consumer.poll(timeout_ms=500).values():
            values.extend(m.value for m in batch)
        recs[:] = decode_stream(RING.verify(v)[1] for v in values)
        return len(recs) >= 51

    try:  # the topic has several partitions: read until all 51 records are in, however they interleave
        wait_for(all_in, 60, "the 51 signed records", interval=0)
    finally:
        consumer.close()
    assert values and all(is_signed(v) for v in values)
    opened = [RING.verify(v)[1] for v in values]  # every one verifies under the job's key
    assert any(m[:4] == NAMES_MAGIC for m in opened)
    assert sorted(r.step for r in recs if not is_end_marker(r)) == list(range(50))
    assert [r.step for r in recs if is_end_marker(r)] == [49]
