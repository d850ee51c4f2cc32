"""A flood on the real broker does not throw the service's consumer out of its group.

The reader takes as many messages a poll as it can handle well within the max poll interval, at
the cost a message has taken it lately (a signed flood costs verification): every record sent is
processed once, none re-read after a rebalance. Before, a poll of 20,000 costly messages outlasted
the interval: ``CommitFailedError``, records re-read (160,744 processed of 101,608 sent).
"""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaProducer
from polling import step_until
from sdcwatch.core.record import encode
from sdcwatch.core.record_type import Record
from sdcwatch.service.ingest import IngestDecoder
from sdcwatch.service.kafka_source import KafkaSource
from sdcwatch.service.loop import DetectorService
from sdcwatch.service.pipeline import DetectionPipeline

pytestmark = [pytest.mark.integration]

FLOOD = 30_000  # one-record messages
MESSAGE_COST_S = 0.0004  # what a message costs the reader (a signature checked on a loaded machine)


class CostlyDecoder(IngestDecoder):
    """The service's decoder, with the time a costly message takes (12 s for 30,000)."""

    def decode(self, messages):
        messages = list(messages)
        time.sleep(MESSAGE_COST_S * len(messages))  # stands for CPU work, not for waiting on anything
        return super().decode(messages)


def flood(bootstrap: str, topic: str, count: int, runs: int) -> None:
    """``count`` one-record messages of ``runs`` 8-rank runs on ``topic``."""
    sender = KafkaProducer(bootstrap_servers=[bootstrap], linger_ms=20, batch_size=1 << 20)
    for i in range(count):
        rec = Record(f"run-{i % runs}", i // (8 * runs), i % 8, 8, "h", 0.0, 0, {"loss": 1.0}, {}, {})
        sender.send(topic, key=b"flood", value=encode(rec))
    sender.flush(60)
    sender.close()


def costly_source(bootstrap: str, topic: str, **settings) -> KafkaSource:
    """A source of ``topic`` in a group of its own whose messages cost the reader (:class:`CostlyDecoder`)."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    return KafkaSource(
        bootstrap, topic, group=group, deadletter_topic=f"{topic}.dead", ingest=CostlyDecoder(), **settings
    )


def test_a_flood_of_costly_messages_keeps_the_consumer_in_its_group_and_is_processed_once(
    bootstrap, unique_topic, caplog
):
    flood(bootstrap, unique_topic, FLOOD, runs=1)
    source = costly_source(bootstrap, unique_topic)  # the group's defaults: evicted after 6 s without a poll
    pipe = DetectionPipeline()
    svc = DetectorService(source, pipe, poll_timeout=0.1)
    try:
        with caplog.at_level("WARNING", logger="sdcwatch"):
            step_until(svc.step, lambda: pipe.records_total >= FLOOD, 300, "the flood to be processed")
            svc.source.commit()
            step_until(svc.step, lambda: source.lag() == 0, 60, "the lag to reach 0")
    finally:
        svc.close()
    assert source.rebalances == 0 and source.records == pipe.records_total == FLOOD
    assert pipe.aligner.duplicates == pipe.aligner.late_records == 0
    assert 100 <= source.poll_budget() < 20_000  # the budget followed the cost of a message
    assert not [r.getMessage() for r in caplog.records if "commit failed" in r.getMessage()]


def test_catch_up_returns_once_the_reader_has_read_what_is_on_the_bus(bootstrap, unique_topic):
    """What the service asks of the source while runs wait for their share of a pass: the reader
    reads ahead of the judging (its polls full of messages mean more waits on the bus), so a real
    run's record behind a flood is read, and given its share, before the flood is judged."""
    sent = 6_000
    flood(bootstrap, unique_topic, sent, runs=3)
    source = costly_source(bootstrap, unique_topic, max_poll_records=500)  # 2.4 s to read, in many full polls
    try:
        got = step_until(lambda: None, lambda: source.poll(0.2), 60, "the reader's first poll")
        source.catch_up(60.0)
        rest = source.poll(0.0, max_records=sent)
    finally:
        source.close()
    assert len(got) <= 1_000 and len(got) + len(rest) == sent  # all of it read while nothing was judged
