"""The service's end of the bus: the sources it reads, the dead-letter topic, the topic sinks it writes.

(The ranks' end is :mod:`sdcwatch.telemetry.wire.transports`; every Kafka client of both is built by
:mod:`sdcwatch.core.kafka`.)

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

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol, Sequence

from sdcwatch.core.errors import RecordError
from sdcwatch.core.incident import IncidentEvent
from sdcwatch.core.kafka import SECURITY_KEYS, new_producer
from sdcwatch.core.limits import RecordLimits, reason_of
from sdcwatch.core.record import decode_message, encode
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import ANOMALY_TOPIC, DEADLETTER_TOPIC, SUMMARY_TOPIC, TELEMETRY_TOPIC
from sdcwatch.service.ingest import IngestDecoder, Rejected, SchemaRegistry, count_records
from sdcwatch.service.summary import StepSummary, encode_summary

__all__ = [
    "Source",
    "MemorySource",
    "DeadLetter",
    "FAST_JOIN",
    "DEADLETTER_MAX_BYTES",
    "dead_letter_value",
    "decode_summary_message",
    "AnomalyTopicSink",
    "SummaryTopicSink",
]

log = logging.getLogger("sdcwatch.detectors")

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
    from sdcwatch.service.summary import decode_summary

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
    """Dead letters counted in total and by reason (mixed into both sources)."""

    dead_letters: int
    dead_letter_reasons: dict[str, int]

    def _count_dead_letter(self, reason: str, n: int = 1) -> None:
        self.dead_letters += n
        # a new dict each time: the scrape thread may be reading the old one
        self.dead_letter_reasons = {**self.dead_letter_reasons, reason: self.dead_letter_reasons.get(reason, 0) + n}


class MemorySource(DeadLetterCounts):
    """Reads a :class:`~sdcwatch.telemetry.MemoryBus` topic (unit tests, in-process demos)."""

    def __init__(
        self,
        bus: Any,
        topic: str = TELEMETRY_TOPIC,
        deadletter_topic: str = DEADLETTER_TOPIC,
        decode: Callable[..., list] = decode_message,
        limits: RecordLimits | None = None,
        ingest: IngestDecoder | None = None,
    ) -> None:
        self.bus = bus
        self.decode = decode
        self.limits = limits if limits is not None else (RecordLimits() if decode is decode_message else None)
        # telemetry (v1 and v2) is decoded a poll at a time; ``schemas`` is what it learnt
        self.ingest = ingest if ingest is not None else IngestDecoder(SchemaRegistry(self.limits))
        self.schemas = self.ingest.registry
        self.topic = topic
        self.deadletter_topic = deadletter_topic
        self.records = 0
        self.dead_letters = 0
        self.dead_letter_reasons: dict[str, int] = {}
        self.dead_letter_log: list[DeadLetter] = []
        self._offset = 0  # next offset to read
        self._committed = 0

    def poll(self, timeout: float = 0.0, max_records: int = 10_000) -> list:
        """Decoded records and v2 column blocks (``RecordColumns``); bad messages are dead-lettered."""
        msgs = self.bus.messages(self.topic, self._offset)[:max_records]
        if not msgs and timeout > 0:
            time.sleep(min(timeout, 0.01))
        origins = [f"{self.topic}/0/{self._offset + i}" for i in range(len(msgs))]
        out: list = []
        rejected: list[Rejected] = []
        if self.decode is decode_message:
            out, rejected = self.ingest.decode([(o, k, v) for o, (k, v) in zip(origins, msgs)])
        else:
            for origin, (key, value) in zip(origins, msgs):
                recs, reason, why = decode_or_reason(value, self.decode, self.limits)
                if recs is None:
                    rejected.append(Rejected(origin, key, value, why, reason))
                else:
                    out.extend(recs)
        for rj in rejected:
            self.dead_letter_log.append(DeadLetter(rj.reason, rj.origin, rj.key, rj.value, rj.code))
            self.bus.append(self.deadletter_topic, rj.key, dead_letter_value(rj.value)[0])
            self._count_dead_letter(rj.code)
        self._offset += len(msgs)
        self.records += count_records(out)
        return out

    def dead_letter(self, records: Sequence[Record], reason: str, why: str) -> None:
        """Route records the pipeline refused (e.g. an implausible step) to the dead-letter topic."""
        for rec in records:
            self.bus.append(self.deadletter_topic, None, encode(rec))
            self.dead_letter_log.append(DeadLetter(why, "pipeline", None, None, reason))
        self._count_dead_letter(reason, len(records))

    assigned = True  # an in-memory topic needs no group join
    partitions = 1

    def commit(self) -> None:
        self._committed = self._offset

    def lag(self) -> int:
        return self.bus.size(self.topic) - self._offset

    def close(self) -> None:
        pass


def _kafka_sender(bootstrap: str, topic: str, **producer_settings: Any):
    """(send(key, value), flush() -> bool, close()) over one kafka-python producer.

    Sending is asynchronous; a message the broker refuses (too large, topic gone, timed out) is
    logged and makes the next ``flush`` return False, so the caller does not commit as if it had
    been delivered.
    """
    security = {k: v for k, v in producer_settings.items() if k in SECURITY_KEYS}
    settings = {k: v for k, v in producer_settings.items() if k not in SECURITY_KEYS}
    producer = new_producer(bootstrap, security, acks=1, **settings)  # kafka-python is imported here, lazily
    failed = {"n": 0, "at_flush": 0}

    def on_error(exc: BaseException) -> None:
        failed["n"] += 1
        if failed["n"] == 1 or failed["n"] % 100 == 0:
            log.error("%s: the broker did not take a message (%d so far): %s", topic, failed["n"], exc)

    def send(key: bytes, value: bytes) -> None:
        producer.send(topic, key=key, value=value).add_errback(on_error)

    def flush() -> bool:
        try:
            producer.flush(timeout=10)
        except Exception as exc:
            log.warning("%s: flush failed: %s", topic, exc)
            return False
        ok = failed["n"] == failed["at_flush"]
        failed["at_flush"] = failed["n"]
        return ok

    def close() -> None:
        producer.flush(timeout=5)
        producer.close(timeout=5)

    return send, flush, close


class TopicWriter:
    """The writing end of one topic, shared by the sinks that publish to the bus.

    ``send(key: bytes, value: bytes)`` is where messages go: :meth:`to_bus` writes to a
    :class:`~sdcwatch.telemetry.MemoryBus`, :meth:`to_kafka` to a kafka-python producer (sending is
    asynchronous there). Publishing never raises; failures are counted in ``errors``.
    """

    DEFAULT_TOPIC: ClassVar[str]
    KAFKA_SETTINGS: ClassVar[dict[str, Any]] = {}
    LABEL: ClassVar[str]

    def __init__(
        self,
        send: Callable[[bytes, bytes], Any],
        flush: Callable[[], bool] = lambda: True,
        close: Callable[[], Any] | None = None,
    ) -> None:
        self._send, self._flush, self._close = send, flush, close
        self.published = 0
        self.errors = 0

    @classmethod
    def to_bus(cls, bus: Any, topic: str | None = None):
        topic = topic or cls.DEFAULT_TOPIC
        return cls(lambda k, v: bus.append(topic, k, v))

    @classmethod
    def to_kafka(cls, bootstrap: str, topic: str | None = None, **producer_settings: Any):
        return cls(*_kafka_sender(bootstrap, topic or cls.DEFAULT_TOPIC, **{**cls.KAFKA_SETTINGS, **producer_settings}))

    def confirm(self) -> bool:
        """Wait until what was published is on the bus; False if the bus did not take all of it."""
        return bool(self._flush())

    def close(self) -> None:
        if self._close is not None:
            try:
                self._close()
            except Exception:
                log.exception("%s topic: close failed", self.LABEL)


class AnomalyTopicSink(TopicWriter):
    """Publishes each incident change as JSON (``Incident.to_dict()`` plus ``change``) to a topic."""

    DEFAULT_TOPIC = ANOMALY_TOPIC
    KAFKA_SETTINGS = {"linger_ms": 20}
    LABEL = "anomaly"

    def publish(self, event: IncidentEvent) -> None:
        try:
            body = {"change": event.change, **event.incident.to_dict()}
            self._send(event.incident.id.encode("utf-8"), json.dumps(body, allow_nan=False).encode("utf-8"))
            self.published += 1
        except Exception:  # a sink must never stall or break detection
            self.errors += 1
            log.exception("anomaly topic: could not publish incident %s", event.incident.id)


class SummaryTopicSink(TopicWriter):
    """The spatial stage's output: each step summary as one message, keyed by run, to a topic.

    Keyed by run so that one run's summaries share a partition and so a temporal instance. The
    service flushes it before it commits its telemetry offsets: a summary is on the bus before the
    records it came from count as done.
    """

    DEFAULT_TOPIC = SUMMARY_TOPIC
    # summaries grow with ranks x metrics (330 kB measured at 16,384 ranks x 136 metrics): past the
    # producer's 1 MB default for the largest jobs; the broker's message.max.bytes still applies
    KAFKA_SETTINGS = {"linger_ms": 5, "max_request_size": 8 << 20}
    LABEL = "summaries"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unflushed_errors = 0
        self.bytes = 0

    def publish(self, summaries: Sequence[StepSummary]) -> None:
        for s in summaries:
            try:
                value = encode_summary(s)
                self._send(s.run.encode("utf-8"), value)
                self.published += 1
                self.bytes += len(value)
            except Exception as exc:
                self.errors += 1
                self._unflushed_errors += 1
                if self.errors == 1 or self.errors % 100 == 0:
                    log.error(
                        "summaries topic: could not publish step %s of run %s (%d so far): %s",
                        s.step,
                        s.run,
                        self.errors,
                        exc,
                    )

    def flush(self) -> bool:
        """Wait for the bus; False if a summary since the last flush was not delivered."""
        ok = bool(self._flush()) and not self._unflushed_errors
        self._unflushed_errors = 0
        return ok


# The Kafka source builds on the helpers above; it lives in a module of its own (its reader thread).
