"""The emitter, the Kafka transport and the source against a real Kafka-protocol broker."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from sdcwatch.core.record import encode_batch
from sdcwatch.telemetry import Emitter, KafkaTransport, Record, encode, is_end_marker

pytestmark = pytest.mark.integration

PRODUCER = textwrap.dedent(
    """
    import sys
    from sdcwatch.telemetry import Emitter, KafkaTransport
    bootstrap, topic, first_rank, n_ranks, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
    ems = [Emitter(KafkaTransport(bootstrap, topic), run="bus-test", rank=r, world=8, host=f"h{r // 4}")
           for r in range(first_rank, first_rank + n_ranks)]
    for step in range(steps):
        for em in ems:
            em.emit(step, loss=float(step), grad_norm_local=float(em.rank), layers={"attn_entropy": [1.0, 2.0]})
    ok = all(em.flush(120) for em in ems)
    for em in ems:
        em.close()
        assert em.sent == steps and em.dropped == 0, (em.sent, em.dropped)
    print("OK" if ok else "FLUSH-TIMEOUT")
    """
)


def test_8_ranks_in_2_processes_80k_records_none_lost_none_invented(bootstrap, unique_topic, consume):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER, bootstrap, unique_topic, str(first), "4", "10000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for first in (0, 4)
    ]
    got, src = consume(bootstrap, unique_topic, 80_008, timeout=180)
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and out.strip() == "OK", err[-2000:]
    # each rank's close() adds its end-of-run marker at its last step, after all its records
    assert sorted((r.rank, r.step) for r in got if is_end_marker(r)) == [(rank, 9_999) for rank in range(8)]
    got = [r for r in got if not is_end_marker(r)]
    keys = [(r.rank, r.step) for r in got]
    assert len(keys) == 80_000
    assert set(keys) == {(rank, step) for rank in range(8) for step in range(10_000)}
    assert src.dead_letters == 0
    sample = next(r for r in got if r.rank == 5 and r.step == 1234)
    assert sample.scalars["loss"] == 1234.0 and sample.scalars["grad_norm_local"] == 5.0
    assert sample.host == "h1" and sample.layers["attn_entropy"] == (1.0, 2.0)


def emit_through_an_outage(broker, em, seconds: float) -> int:
    """Steps 0-499 confirmed, then the broker killed and steps emitted at about 2 kHz (a fast
    training loop) for ``seconds``; the broker is left down. Returns the most records the emitter
    held at once. (How long an emit takes in an outage is bench/bench_emitter.py --mode outage's.)"""
    for step in range(500):
        em.emit(step, loss=1.0)
    assert em.flush(30) and em.sent == 500
    broker.kill()
    max_pending = 0
    step = 500
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        em.emit(step, loss=1.0)
        step += 1
        max_pending = max(max_pending, em.pending)
        time.sleep(0.0005)
    return max_pending


def test_broker_outage_never_blocks_training_and_drops_are_exact(broker, unique_topic, consume, caplog):
    bootstrap = broker.bootstrap
    # The outage (4 s) outlasts the producer's delivery timeout (1.5 s), so this test covers the path
    # where the producer from before the kill gives up and a new one is made after the restart. A
    # restart shorter than the delivery timeout, which the old producer lives through, is the next test.
    transport = KafkaTransport(bootstrap, unique_topic, request_timeout_ms=1000, delivery_timeout_ms=1500)
    em = Emitter(transport, run="outage", rank=0, world=1, host="h", buffer=2000, batch=256)
    max_pending = emit_through_an_outage(broker, em, 4.0)
    step = outage_last = em.emitted
    assert em.dropped > 0, "the outage should have overflowed the 2,000-record buffer"
    assert max_pending <= 2000  # memory stays within the configured bound

    broker.start()  # same port; memory storage: the old topic and its records are gone
    assert em.flush(60), "the buffered records were not sent after the broker came back"
    resumed_at = step
    for _ in range(500):
        em.emit(step, loss=2.0)
        step += 1
    assert em.flush(60), "sending did not resume after the broker came back"
    em.close()
    assert em.emitted == step
    assert em.sent + em.dropped == em.emitted  # every record is either confirmed or counted as dropped

    sent_after_restart = em.sent - 500
    got, _ = consume(bootstrap, unique_topic, sent_after_restart, timeout=60)
    steps = {r.step for r in got}
    assert len(steps) == sent_after_restart  # what the new broker confirmed is all there, nothing invented
    kept = sent_after_restart - 500
    assert 0 < kept <= 2000
    # the buffer kept the oldest outage records, dropped the newest, and every later record arrived
    assert steps == set(range(500, 500 + kept)) | set(range(resumed_at, step))
    assert em.dropped == (outage_last - 500) - kept
    # the restarted broker started its log again at 0: the 500 records it had confirmed are gone, and
    # the transport said so once
    assert transport.log_resets == 1
    assert "went back from offset" in caplog.text and "lost records it had confirmed" in caplog.text


def test_restart_shorter_than_the_delivery_timeout_loses_nothing_sent_after_it(broker, unique_topic, consume, caplog):
    """A 1 s restart of the in-memory broker, with the transport's default timeouts.

    The producer lives through it, and the new broker confirms its records but does not serve
    them. The transport sees the offsets go back, says so, and replaces its producer, which
    creates the topic: then every record sent after the restart is readable. Without that, 4 of 4
    runs lost records sent after the restart (3 of them lost every one).
    """
    bootstrap = broker.bootstrap
    transport = KafkaTransport(bootstrap, unique_topic)
    em = Emitter(transport, run="blip", rank=0, world=1, host="h", buffer=20_000, batch=256)
    emit_through_an_outage(broker, em, 1.0)
    step = em.emitted
    broker.start()
    for _ in range(300):
        em.emit(step, loss=2.0)
        step += 1
    assert em.flush(60)
    em.close()
    assert (em.emitted, em.sent, em.dropped) == (step, step, 0)

    got, _ = consume(bootstrap, unique_topic, step - 500, timeout=60)
    assert {r.step for r in got} == set(range(500, step))  # all of it, nothing invented
    assert transport.log_resets == 1
    assert "went back from offset" in caplog.text


def test_malformed_and_foreign_messages_go_to_dead_letters(bootstrap, unique_topic, consume):
    from kafka import KafkaConsumer, KafkaProducer

    producer = KafkaProducer(bootstrap_servers=[bootstrap])
    good = [Record("dl", step, 0, 2, "h") for step in range(6)]
    bad_version = bytearray(encode(good[0]))
    bad_version[4] = 9
    bad = [
        b"hello, I am some other application's message",
        b'{"v": 1, "run": "dl"}',
        bytes(bad_version),
        encode(good[0])[:-4],  # truncated
        encode_batch(good[:2])[:-1],
    ]
    sequence = [
        encode(good[0]),
        bad[0],
        encode(good[1]),
        bad[1],
        bad[2],
        encode_batch(good[2:4]),
        bad[3],
        encode(good[4]),
        bad[4],
        encode(good[5]),
    ]
    for value in sequence:
        producer.send(unique_topic, key=b"dl/0", value=value)  # one key: one partition, in order
    producer.flush()
    producer.close()

    got, src = consume(bootstrap, unique_topic, len(good), timeout=60)
    assert [r.step for r in got] == list(range(6))
    assert src.dead_letters == len(bad)

    consumer = KafkaConsumer(
        f"{unique_topic}.dead",
        bootstrap_servers=[bootstrap],
        auto_offset_reset="earliest",
        group_id=None,
        consumer_timeout_ms=30_000,
    )  # no group: no join to wait for
    dead = []
    for msg in consumer:
        dead.append((msg.value, dict(msg.headers)))
        if len(dead) == len(bad):
            break
    consumer.close()
    assert [value for value, _ in dead] == bad  # the original bytes, for inspection
    reasons = [headers["sdcwatch.reason"].decode() for _, headers in dead]
    assert "magic" in reasons[0]
    assert "magic" in reasons[1]
    assert "unknown record version 9" in reasons[2]
    assert "truncated" in reasons[3]
    assert "truncated" in reasons[4]
    assert all(headers["sdcwatch.origin"].decode().startswith(f"{unique_topic}/") for _, headers in dead)
