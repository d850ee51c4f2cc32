"""Sources: where the detector service reads telemetry records from.

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
from typing import Any, Callable, Protocol

from sdcwatch.core.errors import RecordError, TransportError
from sdcwatch.core.names import DEADLETTER_TOPIC, TELEMETRY_TOPIC
from sdcwatch.telemetry.record import Record, decode_message

__all__ = ["Source", "KafkaSource", "MemorySource", "DeadLetter", "DEADLETTER_TOPIC", "TELEMETRY_TOPIC", "FAST_JOIN",
           "decode_summary_message"]

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
        from kafka import KafkaConsumer, KafkaProducer
        from kafka.errors import KafkaError

        from sdcwatch.telemetry.transports import kafka_security_settings

        security = kafka_security_settings(security)
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
            self._consumer = KafkaConsumer(
                topic,
                bootstrap_servers=bootstrap.split(","),
                group_id=group,
                enable_auto_commit=False,
                auto_offset_reset=auto_offset_reset,
                max_poll_records=max_poll_records,
                max_poll_interval_ms=max_poll_interval_ms,
                session_timeout_ms=session_timeout_ms,
                heartbeat_interval_ms=heartbeat_interval_ms,
                fetch_max_wait_ms=100,
                **security,
            )
            self._dl_producer = KafkaProducer(bootstrap_servers=bootstrap.split(","), linger_ms=5,
                                              max_block_ms=5000, **security)
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
