"""The service's end of the bus: the protocol of the sources it reads, and the dead-letter topic.

(The ranks' end is :mod:`sdcwatch.telemetry.wire.transports`; the topics the service writes are
sinks in :mod:`sdcwatch.exporters.topics`; every Kafka client is built by :mod:`sdcwatch.core.kafka`.)

A source returns decoded records in batches and commits only when told to, after the records
have been processed: delivery is at least once, and de-duplication by (run, step, rank) belongs
to the step aligner. A message that does not decode, or a record past the service's
:class:`~sdcwatch.core.limits.RecordLimits`, is not an error of the service: it goes to the
dead-letter topic with the reason (headers ``sdcwatch.reason``, ``sdcwatch.reason_code``), its
origin (``sdcwatch.origin`` = topic/partition/offset) and size (``sdcwatch.size``; the value is
truncated past :data:`DEADLETTER_MAX_BYTES`), is counted by reason, and reading goes on. Records
the pipeline refuses later (a step too far ahead, a run too many) go the same way
(``dead_letter``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from sdcwatch.core.errors import RecordError
from sdcwatch.core.limits import RecordLimits, reason_of
from sdcwatch.core.messages import decode_message
from sdcwatch.core.record_type import Record
from sdcwatch.service.summary import decode_summary

__all__ = [
    "Source",
    "DeadLetter",
    "DeadLetterCounts",
    "FAST_JOIN",
    "DEADLETTER_MAX_BYTES",
    "dead_letter_value",
    "decode_or_reason",
    "decode_summary_message",
]

#: Consumer-group timings that make a new member's first join take ~3 s instead of ~25 s: the
#: join waits for the rebalance timeout (max poll interval) and the session timeout.
FAST_JOIN = dict(max_poll_interval_ms=6000, session_timeout_ms=6000, heartbeat_interval_ms=1000)


@dataclass(frozen=True)
class DeadLetter:
    """A message that could not be decoded, with why and where it came from."""

    reason: str  # what is wrong, in words
    origin: str
    key: bytes | None
    value: bytes | None
    code: str = "malformed"  # the reason code (one of DEAD_LETTER_REASONS)


class Source(Protocol):
    """What the detector service reads from."""

    records: int  # good records returned so far
    dead_letters: int  # malformed messages routed to the dead-letter topic
    assigned: bool  # the source holds partitions to read (a consumer group has finished joining)
    dead_letter_reasons: dict[str, int]  # the same, by reason (DEAD_LETTER_REASONS)
    partitions: int  # partitions this reader owns now (0: evicted or waiting for its group)

    def poll(self, timeout: float) -> list[Record]: ...

    def dead_letter(self, records: Sequence[Record], reason: str, why: str) -> None: ...

    def commit(self) -> None: ...

    def lag(self) -> int: ...

    def close(self) -> None: ...


def decode_summary_message(value: bytes) -> list:
    """The temporal stage's decoder: one step summary per message."""
    return [decode_summary(value)]


#: Most bytes of a message's value kept in the dead-letter topic; the full size travels in the
#: ``sdcwatch.size`` header. Keeps a huge message from being lost to the producer's request limit.
DEADLETTER_MAX_BYTES = 64 * 1024


def decode_or_reason(
    value: Any, decode: Callable[..., list] = decode_message, limits: RecordLimits | None = None
) -> tuple[list | None, str, str]:
    """(records, "", "") or (None, reason code, description of the fault)."""
    if value is None:
        return None, "empty", "empty message (null value)"
    try:
        return (decode(value, limits) if limits is not None else decode(value)), "", ""
    except RecordError as exc:
        return None, reason_of(exc), str(exc)


def dead_letter_value(value: bytes | None) -> tuple[bytes, list[tuple[str, bytes]]]:
    """The value to put on the dead-letter topic (truncated past :data:`DEADLETTER_MAX_BYTES`) and
    the headers that say so (``sdcwatch.size``, ``sdcwatch.truncated``)."""
    value = value if value is not None else b""
    headers = [("sdcwatch.size", str(len(value)).encode())]
    if len(value) > DEADLETTER_MAX_BYTES:
        headers.append(("sdcwatch.truncated", b"true"))
        value = value[:DEADLETTER_MAX_BYTES]
    return value, headers


class DeadLetterCounts:
    """Dead letters counted in total and by reason (mixed into the sources)."""

    dead_letters: int
    dead_letter_reasons: dict[str, int]

    def _count_dead_letter(self, reason: str, n: int = 1) -> None:
        self.dead_letters += n
        # a new dict each time: the scrape thread may be reading the old one
        self.dead_letter_reasons = {**self.dead_letter_reasons, reason: self.dead_letter_reasons.get(reason, 0) + n}
