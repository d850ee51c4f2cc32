"""The service's end of the bus: the protocol of the sources it reads, their decoding and dead letters.
Delivery is at least once (commit after processing; the step aligner drops duplicates); a message that does
not decode or breaks a limit is dead-lettered with its reason and counted, and reading goes on.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, Sequence

from sdcwatch.core.errors import RecordError
from sdcwatch.core.limits import reason_of
from sdcwatch.core.messages import decode_message
from sdcwatch.core.record_type import Record
from sdcwatch.service.ingest import IngestDecoder, Rejected, SchemaRegistry
from sdcwatch.service.summary import decode_summary

__all__ = [
    "Source",
    "DeadLetterCounts",
    "FAST_JOIN",
    "DEADLETTER_MAX_BYTES",
    "dead_letter_value",
    "decode_batch",
    "decode_summary_message",
]

#: Consumer-group timings that make a new member's first join take ~3 s instead of ~25 s: the
#: join waits for the rebalance timeout (max poll interval) and the session timeout.
FAST_JOIN = dict(max_poll_interval_ms=6000, session_timeout_ms=6000, heartbeat_interval_ms=1000)


class Source(Protocol):
    """What the detector service reads from."""

    records: int  # good records returned so far
    assigned: bool  # the source holds partitions to read (a consumer group has finished joining)
    owns_topic: bool  # the source reads every partition (False: it shares its group, and commits nothing)
    ingest: IngestDecoder  # its decoder (``ingest.auth``: the runs' key bindings, None without keys)
    schemas: SchemaRegistry  # the wire-v2 layouts it learnt

    def poll(self, timeout: float) -> list[Record]: ...

    def catch_up(self, timeout: float) -> None:
        """Wait up to ``timeout`` while more is on the bus than the source's reader could take at its
        last read (the service calls it before judging records that wait for their share)."""
        ...

    def dead_letter(self, records: Sequence[Record], reason: str, why: str) -> None: ...

    def commit(self) -> None: ...

    def positions(self) -> dict[int, int]:
        """The offset after what ``poll`` returned, by partition: what ``commit`` commits."""
        ...

    def lag(self) -> int: ...

    def health(self) -> dict[str, Any]:
        """The source's fields of :class:`~sdcwatch.core.incident.PipelineView` (dead letters, by
        reason, partitions, messages waiting for a schema, offset gaps)."""
        ...

    def close(self) -> None: ...


def decode_summary_message(value: bytes) -> list:
    """The temporal stage's decoder: one step summary per message."""
    return [decode_summary(value)]


def decode_batch(
    messages: Iterable[tuple[str, bytes | None, Any]], decode: Callable[[bytes], list], ingest: IngestDecoder
) -> tuple[list, list[Rejected]]:
    """``(origin, key, value)`` messages -> (decoded items, rejected messages): telemetry (``decode``
    is ``decode_message``) many at once through ``ingest``, anything else one by one through ``decode``."""
    if decode is decode_message:
        return ingest.decode(messages)
    out: list = []
    rejected: list[Rejected] = []
    for origin, key, value in messages:
        if value is None:
            rejected.append(Rejected(origin, key, value, "empty message (null value)", "empty"))
            continue
        try:
            out.extend(decode(value))
        except RecordError as exc:
            rejected.append(Rejected(origin, key, value, str(exc), reason_of(exc)))
    return out, rejected


#: Most bytes of a message's value kept in the dead-letter topic; the full size travels in the
#: ``sdcwatch.size`` header. Keeps a huge message from being lost to the producer's request limit.
DEADLETTER_MAX_BYTES = 64 * 1024


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
