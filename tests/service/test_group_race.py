"""Two stage-both readers that join one consumer group at the same instant, their topic there already
(issue 36, item 7's remaining race): before, each held half of it from the start and both left, so
nothing watched the topic. The one holding partition 0 stays; on the real broker, in process."""

from __future__ import annotations

import threading
import uuid

from polling import wait_for
from sdcwatch.service.kafka_source import KafkaSource
from sdcwatch.telemetry.wire.transports import ensure_topic


def test_of_two_members_joining_together_one_leaves_and_the_one_holding_partition_0_takes_the_topic(bootstrap):
    topic = f"t.{uuid.uuid4().hex[:10]}"
    assert ensure_topic(bootstrap, topic, 4)
    together, members = threading.Barrier(2), []

    def join() -> None:
        together.wait()
        members.append(KafkaSource(bootstrap, topic, group=f"g-{topic}", sole_member_after_s=1.0))

    threads = [threading.Thread(target=join) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        wait_for(lambda: all(m.partitions == 2 for m in members), 60, "the topic split between the two")
        leaving = wait_for(lambda: [m for m in members if m.shared], 60, "a member that sees it shares its group")
        (stays,) = [m for m in members if m not in leaving]
        assert len(leaving) == 1
        members.remove(leaving[0])
        leaving[0].close()  # as `sdcwatch serve` does when it leaves (exit status 2)
        wait_for(lambda: stays.owns_topic, 60, "the other to hold the whole topic")
        assert stays.shared is None and stays.partitions == 4
    finally:
        for m in members:
            m.close()
