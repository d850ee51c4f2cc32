"""Offset gaps in a partition: held back and re-fetched until the missing batch arrives.

A broker may list a later batch of a partition before an earlier one is written (the embedded
broker does, with two producers), and kafka-python moves past the gap for good (why: bench/README.md).
:class:`OffsetGaps` hands on only offsets that follow on and has the reader seek back to the first
missing one, until it arrives or the gap is :data:`GAP_WAIT_S` old, then taken as real and logged.

>>> from collections import namedtuple
>>> Msg = namedtuple("Msg", "offset")
>>> gaps = OffsetGaps(wait_s=2.0)
>>> gaps.expect("p0", 10)
>>> kept, seek = gaps.hold({"p0": [Msg(10), Msg(11), Msg(14)]}, now=0.0)
>>> [m.offset for m in kept["p0"]], seek
([10, 11], {'p0': 12})
>>> kept, seek = gaps.hold({"p0": [Msg(12), Msg(13), Msg(14)]}, now=0.1)
>>> [m.offset for m in kept["p0"]], seek, gaps.counts["filled"]
([12, 13, 14], {}, 1)
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Sequence

from sdcwatch.core.validate import check_number

__all__ = ["GAP_WAIT_S", "OffsetGaps"]

log = logging.getLogger("sdcwatch.detectors")

#: Seconds a gap in a partition's offsets is re-fetched before it is taken as real (on Kafka only
#: compaction or transaction markers make one, which sdcwatch's producers do not use).
GAP_WAIT_S = 2.0


class OffsetGaps:
    """Where each partition's next message must be, and the gaps open now.

    ``counts``: ``refetched`` (times the reader went back to a gap), ``filled`` (gaps whose first
    offset then arrived), ``skipped`` (gaps taken as real after ``wait_s``) and ``skipped_offsets``
    (the offsets those spanned).
    """

    def __init__(self, wait_s: float = GAP_WAIT_S) -> None:
        self.wait_s = check_number("source.gap_wait_s", wait_s, 0)
        self.counts = {"refetched": 0, "filled": 0, "skipped": 0, "skipped_offsets": 0}
        self._next: dict[Any, int] = {}  # partition -> the offset its next message must have
        self._gap: dict[Any, tuple[int, float]] = {}  # partition -> (first missing offset, since)

    def expect(self, partition: Any, offset: int) -> None:
        """The partition's fetch position (a new assignment): its next message must be there."""
        self._next[partition] = offset

    def keep_only(self, partitions: Iterable[Any]) -> None:
        """Forget the partitions not in ``partitions`` (revoked)."""
        keep = set(partitions)
        for tp in [tp for tp in self._next if tp not in keep]:
            del self._next[tp]
            self._gap.pop(tp, None)

    def hold(self, batches: Mapping[Any, Sequence[Any]], now: float) -> tuple[dict, dict]:
        """(``batches`` cut before the first young gap of each partition, {partition: offset to seek
        back to}). Messages are anything with an ``offset``, in offset order per partition."""
        out: dict = {}
        seek: dict = {}
        for tp, msgs in batches.items():
            expected = self._next.get(tp)
            keep = len(msgs)
            for i, msg in enumerate(msgs):
                gap = self._gap.get(tp)
                if gap is not None and msg.offset == gap[0]:
                    del self._gap[tp]
                    self.counts["filled"] += 1
                elif expected is not None and msg.offset > expected:
                    if gap is None or gap[0] != expected:
                        gap = self._gap[tp] = (expected, now)
                    if now - gap[1] < self.wait_s:
                        keep = i
                        break
                    del self._gap[tp]
                    self.counts["skipped"] += 1
                    self.counts["skipped_offsets"] += msg.offset - expected
                    log.warning(
                        "%s: offsets %d to %d did not arrive within %.1f s; reading on from %d",
                        tp,
                        expected,
                        msg.offset - 1,
                        self.wait_s,
                        msg.offset,
                    )
                expected = msg.offset + 1
            if keep < len(msgs):
                self.counts["refetched"] += 1
                seek[tp] = expected
            if expected is not None:
                self._next[tp] = expected
            if keep:
                out[tp] = list(msgs[:keep])
        return out, seek

    def refetch(self, consumer: Any, batches: Mapping[Any, Sequence[Any]], now: float) -> dict:
        """``batches`` (a kafka-python poll) up to the first young gap of each partition, with
        ``consumer`` sent back to each gap."""
        held, seek = self.hold(batches, now)
        for tp, offset in seek.items():
            try:
                consumer.seek(tp, offset)
            except Exception as exc:  # revoked meanwhile: its next owner starts from the committed offset
                log.debug("cannot go back to offset %d of %s: %s", offset, tp, exc)
        return held
