"""The service's end of the bus: the sources it reads, the dead-letter topic, the topic sinks it writes.

(The ranks' end is :mod:`sdcwatch.telemetry.transports`; every Kafka client of both is built by
:mod:`sdcwatch.core.kafka`.)

A source returns decoded records in batches and commits only when told to, after the records
have been processed: delivery is at least once, and de-duplication by (run, step, rank) belongs
to the step aligner. A message that does not decode is not an error of the service: it goes to
the dead-letter topic with the reason (header ``sdcwatch.reason``) and its origin
(``sdcwatch.origin`` = topic/partition/offset), is counted, and reading goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
import json
from typing import Any, Callable, ClassVar, Protocol, Sequence

from sdcwatch.core.errors import RecordError, TransportError
from sdcwatch.core.kafka import SECURITY_KEYS, new_consumer, new_producer, security_settings
from sdcwatch.core.names import ANOMALY_TOPIC, DEADLETTER_TOPIC, SUMMARY_TOPIC, TELEMETRY_TOPIC
from sdcwatch.detectors.summary import StepSummary, encode_summary
from sdcwatch.detectors.types import IncidentEvent
from sdcwatch.telemetry.record import Record, decode_message

__all__ = ["Source", "KafkaSource", "MemorySource", "DeadLetter", "FAST_JOIN", "decode_summary_message",
           "AnomalyTopicSink", "SummaryTopicSink"]

log = logging.getLogger("sdcwatch.detectors")

#: Consumer-group timings that make a new member's first join take ~3 s instead of ~25 s: the
#: join waits for the rebalance timeout (max poll interval) and the session timeout.
FAST_JOIN = dict(max_poll_interval_ms=6000, session_timeout_ms=6000, heartbeat_interval_ms=1000)


@dataclass(frozen=True)
class DeadLetter:
    """A message that could not be decoded, with why and where it came from."""

    reason: str
    origin: str
    key: bytes | None
    value: bytes | None


class Source(Protocol):
    """What the detector service reads from."""

    records: int  # good records returned so far
    dead_letters: int  # malformed messages routed to the dead-letter topic
    assigned: bool  # the source holds partitions to read (a consumer group has finished joining)

    def poll(self, timeout: float) -> list[Record]: ...

    def commit(self) -> None: ...

    def lag(self) -> int: ...

    def close(self) -> None: ...


def decode_summary_message(value: bytes) -> list:
    """The temporal stage's decoder: one step summary per message."""
    from sdcwatch.detectors.summary import decode_summary

    return [decode_summary(value)]


def _decode_or_reason(value: Any, decode: Callable[[bytes], list] = decode_message) -> tuple[list | None, str]:
    if value is None:
        return None, "empty message (null value)"
    try:
        return decode(value), ""
    except RecordError as exc:
        return None, str(exc)


class MemorySource:
    """Reads a :class:`~sdcwatch.telemetry.MemoryBus` topic (unit tests, in-process demos)."""

    def __init__(self, bus: Any, topic: str = TELEMETRY_TOPIC, deadletter_topic: str = DEADLETTER_TOPIC,
                 decode: Callable[[bytes], list] = decode_message) -> None:
        self.bus = bus
        self.decode = decode
        self.topic = topic
        self.deadletter_topic = deadletter_topic
        self.records = 0
        self.dead_letters = 0
        self.dead_letter_log: list[DeadLetter] = []
        self._offset = 0  # next offset to read
        self._committed = 0

    def poll(self, timeout: float = 0.0, max_records: int = 10_000) -> list[Record]:
        msgs = self.bus.messages(self.topic, self._offset)[:max_records]
        if not msgs and timeout > 0:
            time.sleep(min(timeout, 0.01))
        out = []
        for i, (key, value) in enumerate(msgs):
            recs, reason = _decode_or_reason(value, self.decode)
            if recs is None:
                dl = DeadLetter(reason, f"{self.topic}/0/{self._offset + i}", key, value)
                self.dead_letter_log.append(dl)
                self.bus.append(self.deadletter_topic, key, value if value is not None else b"")
                self.dead_letters += 1
            else:
                out.extend(recs)
        self._offset += len(msgs)
        self.records += len(out)
        return out

    assigned = True  # an in-memory topic needs no group join

    def commit(self) -> None:
        self._committed = self._offset

    def lag(self) -> int:
        return self.bus.size(self.topic) - self._offset

    def close(self) -> None:
        pass


class KafkaSource:
    """Reads the telemetry topic in a consumer group, with a dead-letter topic for bad messages.

    The group timings default to :data:`FAST_JOIN`: kafka-python's first join of a new group waits
    for the rebalance and session timeouts; at the defaults a fresh service would sit idle for
    tens of seconds before its first record.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str = TELEMETRY_TOPIC,
        *,
        group: str = "sdcwatch-detectors",
        deadletter_topic: str = DEADLETTER_TOPIC,
        auto_offset_reset: str = "earliest",
        max_poll_records: int = 20_000,
        max_poll_interval_ms: int = FAST_JOIN["max_poll_interval_ms"],
        session_timeout_ms: int = FAST_JOIN["session_timeout_ms"],
        heartbeat_interval_ms: int = FAST_JOIN["heartbeat_interval_ms"],
        lag_interval: float = 1.0,
        decode: Callable[[bytes], list] = decode_message,
        **security: Any,
    ) -> None:
        from kafka.errors import KafkaError

        security = security_settings(security)
        self.bootstrap = bootstrap
        self.topic = topic
        self.group = group
        self.deadletter_topic = deadletter_topic
        self.max_poll_records = max_poll_records
        self.lag_interval = lag_interval
        self.decode = decode  # decode_summary_message for the temporal stage
        self.records = 0
        self.dead_letters = 0
        self._lag = 0
        self._lag_at = 0.0
        self._assignment: list[int] | None = None
        try:
            self._consumer = new_consumer(
                bootstrap,
                topic,
                security=security,
                group_id=group,
                enable_auto_commit=False,
                auto_offset_reset=auto_offset_reset,
                max_poll_records=max_poll_records,
                max_poll_interval_ms=max_poll_interval_ms,
                session_timeout_ms=session_timeout_ms,
                heartbeat_interval_ms=heartbeat_interval_ms,
                fetch_max_wait_ms=100,
            )
            self._dl_producer = new_producer(bootstrap, security, linger_ms=5, max_block_ms=5000)
        except (KafkaError, OSError, ValueError) as exc:
            raise TransportError(f"cannot connect to Kafka at {bootstrap}: {exc}") from None

    def poll(self, timeout: float = 1.0, max_records: int | None = None) -> list[Record]:
        """Decoded records, at most ``max_records``; bad messages are dead-lettered."""
        batches = self._consumer.poll(timeout_ms=int(timeout * 1000), max_records=max_records or self.max_poll_records)
        parts = sorted(tp.partition for tp in self._consumer.assignment())
        if parts != self._assignment:  # a join or a rebalance: say which share of the topic is ours
            self._assignment = parts
            log.info("group %s: assigned partitions %s of %s", self.group, parts, self.topic)
        out: list[Record] = []
        for tp, messages in batches.items():
            for msg in messages:
                recs, reason = _decode_or_reason(msg.value, self.decode)
                if recs is not None:
                    out.extend(recs)
                    continue
                self.dead_letters += 1
                origin = f"{tp.topic}/{tp.partition}/{msg.offset}"
                log.debug("dead letter %s: %s", origin, reason)
                try:
                    self._dl_producer.send(
                        self.deadletter_topic,
                        key=msg.key,
                        value=msg.value if msg.value is not None else b"",
                        headers=[("sdcwatch.reason", reason.encode()), ("sdcwatch.origin", origin.encode())],
                    )
                except Exception as exc:  # the count stays; the service must keep going
                    log.warning("could not dead-letter %s: %s", origin, exc)
        self.records += len(out)
        return out

    @property
    def assigned(self) -> bool:
        """Whether this member has joined its group and owns partitions (records can flow)."""
        return bool(self._consumer.assignment())

    def commit(self) -> None:
        """Commit everything returned by ``poll`` so far (call after processing it)."""
        try:
            if self.dead_letters:
                self._dl_producer.flush(timeout=5)
            self._consumer.commit()
        except Exception as exc:  # a failed commit means redelivery, which dedup absorbs
            log.warning("offset commit failed (records may be redelivered): %s", exc)

    def lag(self) -> int:
        """Records between this group's position and the end of the topic (refreshed each second)."""
        now = time.monotonic()
        if now - self._lag_at < self.lag_interval:
            return self._lag
        self._lag_at = now
        try:
            parts = self._consumer.assignment()
            if parts:
                ends = self._consumer.end_offsets(list(parts))
                self._lag = int(sum(max(0, ends[tp] - self._consumer.position(tp)) for tp in parts))
        except Exception as exc:
            log.debug("lag unavailable: %s", exc)
        return self._lag

    def close(self) -> None:
        try:
            self._dl_producer.close(timeout=5)
        finally:
            self._consumer.close()


# -- topic sinks: what the service writes to the bus ------------------------------------------------


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


class _TopicWriter:
    """The writing end of one topic, shared by the sinks that publish to the bus.

    ``send(key: bytes, value: bytes)`` is where messages go: :meth:`to_bus` writes to a
    :class:`~sdcwatch.telemetry.MemoryBus`, :meth:`to_kafka` to a kafka-python producer (sending is
    asynchronous there). Publishing never raises; failures are counted in ``errors``.
    """

    DEFAULT_TOPIC: ClassVar[str]
    KAFKA_SETTINGS: ClassVar[dict[str, Any]] = {}
    LABEL: ClassVar[str]

    def __init__(self, send: Callable[[bytes, bytes], Any], flush: Callable[[], bool] = lambda: True,
                 close: Callable[[], Any] | None = None) -> None:
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

    def close(self) -> None:
        if self._close is not None:
            try:
                self._close()
            except Exception:
                log.exception("%s topic: close failed", self.LABEL)


class AnomalyTopicSink(_TopicWriter):
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


class SummaryTopicSink(_TopicWriter):
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
                    log.error("summaries topic: could not publish step %s of run %s (%d so far): %s",
                              s.step, s.run, self.errors, exc)

    def flush(self) -> bool:
        """Wait for the bus; False if a summary since the last flush was not delivered."""
        ok = bool(self._flush()) and not self._unflushed_errors
        self._unflushed_errors = 0
        return ok
