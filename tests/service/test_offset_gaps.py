"""OffsetGaps: a partition's messages are handed on only while their offsets follow on."""

from __future__ import annotations

from collections import namedtuple

import pytest
from sdcwatch.service.offset_gaps import OffsetGaps

Msg = namedtuple("Msg", "offset")


def offsets(batches: dict, tp: str) -> list[int]:
    return [m.offset for m in batches.get(tp, [])]


def test_a_later_batch_fetched_first_is_held_until_the_earlier_one_arrives():
    # the embedded broker's race: batch 112-113 confirmed, 114-115 fetchable first
    gaps = OffsetGaps(wait_s=2.0)
    gaps.expect("p0", 110)
    kept, seek = gaps.hold({"p0": [Msg(110), Msg(111), Msg(114), Msg(115)]}, now=0.0)
    assert offsets(kept, "p0") == [110, 111] and seek == {"p0": 112}
    kept, seek = gaps.hold({"p0": [Msg(114), Msg(115)]}, now=0.5)  # still missing: back again
    assert offsets(kept, "p0") == [] and seek == {"p0": 112}
    kept, seek = gaps.hold({"p0": [Msg(112), Msg(113), Msg(114), Msg(115)]}, now=0.6)
    assert offsets(kept, "p0") == [112, 113, 114, 115] and seek == {}
    assert gaps.counts == {"refetched": 2, "filled": 1, "skipped": 0, "skipped_offsets": 0}


def test_a_gap_at_the_first_fetch_of_a_partition_is_held():
    gaps = OffsetGaps(wait_s=2.0)
    gaps.expect("p0", 0)
    kept, seek = gaps.hold({"p0": [Msg(2), Msg(3)]}, now=0.0)
    assert kept == {} and seek == {"p0": 0}


def test_a_gap_that_outlives_the_wait_is_taken_as_real_and_counted(caplog):
    gaps = OffsetGaps(wait_s=2.0)
    gaps.expect("p0", 5)
    assert gaps.hold({"p0": [Msg(7)]}, now=10.0)[1] == {"p0": 5}
    assert gaps.hold({"p0": [Msg(7)]}, now=11.9)[1] == {"p0": 5}
    kept, seek = gaps.hold({"p0": [Msg(7), Msg(8), Msg(10)]}, now=12.0)
    # 5-6 taken as real; 9 is a new gap, held from now
    assert offsets(kept, "p0") == [7, 8] and seek == {"p0": 9}
    assert gaps.counts["skipped"] == 1 and gaps.counts["skipped_offsets"] == 2
    assert "offsets 5 to 6 did not arrive" in caplog.text


def test_partitions_are_independent_and_revoked_ones_forgotten():
    gaps = OffsetGaps(wait_s=1.0)
    gaps.expect("p0", 0)
    kept, seek = gaps.hold({"p0": [Msg(0), Msg(2)], "p1": [Msg(40), Msg(41)]}, now=0.0)
    # p1's position was not known: its first message sets it
    assert offsets(kept, "p0") == [0] and offsets(kept, "p1") == [40, 41] and seek == {"p0": 1}
    assert gaps.hold({"p1": [Msg(43)]}, now=0.0)[1] == {"p1": 42}
    gaps.keep_only(["p0"])
    kept, seek = gaps.hold({"p1": [Msg(90)]}, now=0.1)  # forgotten, reassigned and back: no stale gap
    assert offsets(kept, "p1") == [90] and seek == {}


def test_a_wait_that_is_not_a_duration_is_refused():
    with pytest.raises(ValueError, match=r"^source\.gap_wait_s: must be a number >= 0, got nan$"):
        OffsetGaps(wait_s=float("nan"))


class SeekLog:
    """A consumer double that records where it was sent back to (and may refuse a partition)."""

    def __init__(self, revoked=()) -> None:
        self.seeks: list[tuple[str, int]] = []
        self.revoked = set(revoked)

    def seek(self, tp, offset) -> None:
        if tp in self.revoked:
            raise AssertionError(f"{tp} is not assigned")
        self.seeks.append((tp, offset))


def test_refetch_sends_the_consumer_back_to_each_gap_and_survives_a_revoked_partition():
    # what KafkaSource and the group-less TopicReader (capture, incidents) both call after a poll
    gaps = OffsetGaps(wait_s=2.0)
    gaps.expect("p0", 0)
    gaps.expect("p1", 0)
    consumer = SeekLog(revoked={"p1"})
    kept = gaps.refetch(consumer, {"p0": [Msg(0), Msg(2)], "p1": [Msg(1)]}, now=0.0)
    assert offsets(kept, "p0") == [0] and "p1" not in kept
    assert consumer.seeks == [("p0", 1)]  # p1's seek failed (revoked meanwhile) without raising
    kept = gaps.refetch(consumer, {"p0": [Msg(1), Msg(2)]}, now=0.1)
    assert offsets(kept, "p0") == [1, 2] and consumer.seeks == [("p0", 1)]
