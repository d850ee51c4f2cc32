"""Wire v2 through the real broker into the detector service, beside v1 emitters of the same run."""

from __future__ import annotations

import uuid

import pytest
from polling import step_until, wait_for
from stand_ins import ListSink
from sdcwatch.core.columnar import encode_rows
from sdcwatch.core.record_layout import schema_for
from sdcwatch.service.kafka_source import KafkaSource
from sdcwatch.service.loop import DetectorService
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings
from sdcwatch.telemetry import Emitter, KafkaTransport

pytestmark = pytest.mark.integration


def test_mixed_v1_and_v2_emitters_of_one_run_through_the_broker(bootstrap, unique_topic):
    world, steps, bad_rank, bad_step = 8, 30, 5, 20
    emitters = [
        Emitter(
            KafkaTransport(bootstrap, unique_topic),
            run="mixed",
            rank=r,
            world=world,
            host=f"h{r // 4}",
            wire="v2" if r % 2 else "v1",
        )
        for r in range(world)
    ]
    for step in range(steps):
        for r, em in enumerate(emitters):
            loss = float("nan") if (r, step) == (bad_rank, bad_step) else 2.0 + 0.01 * r
            em.emit(
                step,
                loss=loss,
                grad_norm_local=1.0 + 0.001 * r,
                grad_norm_global=1.0,
                layers={"attn_entropy": [1.0, 1.1, 1.2]},
                fingerprints={"grad_fp": step},
            )
    for em in emitters:
        em.close()
    assert [(em.sent, em.invalid) for em in emitters] == [(steps, 0)] * world
    source = KafkaSource(
        bootstrap, unique_topic, group=f"g-{uuid.uuid4().hex[:8]}", deadletter_topic=f"{unique_topic}.dead"
    )
    events = ListSink()
    pipe = DetectionPipeline(PipelineSettings(align_timeout_s=30.0))
    svc = DetectorService(source, pipe, sinks=[events], poll_timeout=0.5)
    try:
        step_until(svc.step, lambda: pipe.records_total >= world * steps, 60, "every record on the broker")
    except AssertionError as exc:  # say where the records are: read, dead-lettered, waiting for a schema
        raise AssertionError(f"{exc}; {pipe.records_total} records processed; reader: {source.health()}") from None
    for _ in range(2):
        svc.step()
    svc.close()
    assert (pipe.records_total, source.dead_letters) == (world * steps, 0)
    assert pipe.aligner.incomplete_steps == 0  # v1 and v2 ranks met in the same steps
    nonfinite = [i for i in events.opened if i.kind == "nonfinite"]
    assert [(i.first_step, i.ranks[0], i.hosts[0], i.metric) for i in nonfinite] == [(bad_step, bad_rank, "h1", "loss")]


def test_bad_v2_messages_on_the_topic_are_dead_lettered_with_the_reason(bootstrap, unique_topic):
    from kafka import KafkaConsumer, KafkaProducer

    sch = schema_for(("loss",))
    other = schema_for(("loss", "lr"))  # a layout no message on the topic carries
    orphan = encode_rows(other, "r", ["h"], other.struct.pack(1, 0, 1, 0, 0, 1.0, 2.0, 0.1), 1, with_schema=False)
    bad_rank = encode_rows(sch, "r", ["h"], sch.struct.pack(2, 7, 4, 0, 0, 1.0, 2.0), 1, with_schema=True)
    good = encode_rows(sch, "r", ["h"], sch.struct.pack(3, 0, 1, 0, 0, 1.0, 2.0), 1, with_schema=True)
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for value in (orphan, bad_rank, good):
        producer.send(unique_topic, key=b"r/0", value=value)
    producer.flush()
    producer.close()
    dead = f"{unique_topic}.dead"
    from sdcwatch.service.ingest import IngestDecoder

    source = KafkaSource(
        bootstrap,
        unique_topic,
        group=f"g-{uuid.uuid4().hex[:8]}",
        deadletter_topic=dead,
        ingest=IngestDecoder(schema_wait=0.5),
    )
    read: list[int] = []

    def one_read_two_dead() -> bool:
        read.extend(len(x) for x in source.poll(0.3))
        return sum(read) >= 1 and source.dead_letters >= 2

    wait_for(one_read_two_dead, 30, "one record read and two dead-lettered", interval=0)
    source.commit()
    source.close()
    assert (sum(read), source.dead_letters) == (1, 2)
    consumer = KafkaConsumer(
        dead, bootstrap_servers=bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=10_000, group_id=None
    )
    reasons = sorted(dict(m.headers)["sdcwatch.reason"].decode() for m in consumer)
    consumer.close()
    assert len(reasons) == 2
    assert any("'rank'" in r and "7 out of range [0, 4)" in r for r in reasons), reasons
    assert any("unknown schema" in r for r in reasons), reasons
