"""Several `sdcwatch serve` instances in one consumer group, stage both: the one that joins a group
already served leaves with a clear error (exit status 2), committing nothing; the first keeps
detecting, with every partition back."""

from __future__ import annotations

import math
import uuid

import pytest
from polling import wait_for
from serve_process import ServeProcess, Topics, rank_emitters, train_ranks

pytestmark = pytest.mark.integration

WHOLE = "assigned partitions [0, 1, 2, 3] "


def _committed_to_end(bootstrap, group, topic) -> bool:
    """Whether ``group`` has committed every partition of ``topic`` to its end (read without joining)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=[bootstrap], group_id=group, enable_auto_commit=False)
    try:
        ends = consumer.end_offsets([TopicPartition(topic, p) for p in range(4)])
        return all((consumer.committed(tp) or 0) >= end for tp, end in ends.items())
    finally:
        consumer.close()


def test_a_second_instance_in_the_group_of_a_stage_both_instance_leaves_with_a_clear_error(bootstrap, tmp_path):
    from sdcwatch.telemetry.wire.transports import ensure_topic

    tag = uuid.uuid4().hex[:8]
    topics, group = Topics.fresh(tag), f"shared-{tag}"
    assert ensure_topic(bootstrap, topics.telemetry, 4)
    flags = ("--bus-share-timeout-s", "3")
    first = ServeProcess(bootstrap, topics, tmp_path / "a", *flags, group=group, metrics_port=0, snapshot_interval_s=1)
    second = None
    emitters = rank_emitters(bootstrap, topics.telemetry)
    try:
        first.wait_banner()
        first.wait_line(lambda ln: WHOLE in ln, what="the whole topic")
        train_ranks(emitters, range(40))
        second = ServeProcess(
            bootstrap, topics, tmp_path / "b", *flags, group=group, metrics_port=0, snapshot_interval_s=1
        )
        second.wait_banner()
        code = second.wait(90)
        err = second.stderr()
        assert code == 2, err[-3000:]
        assert f"sdcwatch serve: error: bus.group: group {group}: this instance has held only partitions" in err
        assert "another instance shares its consumer group" in err and "run one instance per group" in err
        assert "--stage spatial" in err
        # the first stays and finds a NaN at its step; once the second has left, the group is the first's
        # alone again: its offsets are committed to the end of every partition
        assert first.running()
        train_ranks(emitters, range(40, 80), lambda step, rank, loss: math.nan if (step, rank) == (60, 2) else loss)
        nan = first.wait_incident("nonfinite", 60)
        assert (nan["first_step"], nan["ranks"]) == (60, [2])
        wait_for(lambda: _committed_to_end(bootstrap, group, topics.telemetry), 60, "the first to commit everything")
    finally:
        for em in emitters:
            em.close(5)
        first.close()
        if second is not None:
            second.close()
