"""The Kafka transport's own bookkeeping, without a broker."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from sdcwatch.telemetry import KafkaTransport


def confirmed(*pairs):
    return [SimpleNamespace(partition=p, offset=o) for p, o in pairs]


def test_offsets_that_go_back_are_reported_once_per_lost_log(caplog):
    t = KafkaTransport("127.0.0.1:1", "tel")
    with caplog.at_level(logging.WARNING, logger="sdcwatch.telemetry"):
        t._check_offsets(confirmed((0, 0), (1, 0)))
        t._check_offsets(confirmed((0, 5), (1, 9), (2, 3)))
        assert t.log_resets == 0 and not caplog.records
        # the broker restarted empty: partition 0 starts again; partitions 1 and 2 follow later
        t._check_offsets(confirmed((0, 0)))
        assert t.log_resets == 1
        assert "tel partition 0 went back from offset 5 to 0" in caplog.text
        t._check_offsets(confirmed((1, 0), (2, 0)))
        t._check_offsets(confirmed((1, 1), (2, 4), (0, 1)))
    assert t.log_resets == 1 and len(caplog.records) == 1


def test_acks_0_confirms_without_offsets_and_is_never_a_lost_log():
    t = KafkaTransport("127.0.0.1:1", "tel", acks=0)
    t._check_offsets(confirmed((0, 7)))
    t._check_offsets(confirmed((0, -1), (0, -1)))
    assert t.log_resets == 0


def test_the_emitters_default_transport_takes_the_topic_and_bus_from_the_environment():
    from sdcwatch.telemetry import Emitter

    env = {"SDCWATCH_BOOTSTRAP": "127.0.0.1:1", "SDCWATCH_BUS_TELEMETRY_TOPIC": "team.telemetry"}
    em = Emitter(run="r", rank=0, world=1, host="h", env=env)
    try:
        assert em.transport.topic == "team.telemetry"  # the variable serve reads its topic from
    finally:
        em.close(0.5)
    em = Emitter(run="r", rank=0, world=1, host="h", env=env, topic="given")
    try:
        assert em.transport.topic == "given"  # an argument wins over the environment
    finally:
        em.close(0.5)


def test_a_transports_key_must_be_a_job_key_and_a_signed_topic_needs_its_keyring():
    import pytest
    from sdcwatch.core.errors import ConfigError, RecordError
    from sdcwatch.core.signing import JobKey, Keyring
    from sdcwatch.telemetry import MemoryBus, MemoryTransport, Record

    with pytest.raises(ConfigError) as info:
        KafkaTransport("127.0.0.1:1", "tel", key="kid:0123456789abcdef-secret")
    assert info.value.key == "key" and "0123456789abcdef" not in str(info.value)
    key = JobKey("kid", b"0123456789abcdef-secret")
    bus = MemoryBus()
    MemoryTransport(bus, "tel", key=key).send([Record.make(run="r", step=1, rank=0, world=1, scalars={"loss": 1.0})])
    with pytest.raises(RecordError, match="keyring"):
        bus.records("tel")
    assert [r.step for r in bus.records("tel", keyring=Keyring([key]))] == [1]
