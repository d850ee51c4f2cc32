"""Transports: how the emitter's batches reach the bus, one method ``send(items)``: Kafka, a file of JSON
lines, or in-memory topics. A transport raises TransportError listing what it could not send
(``unsent``), which the emitter keeps and retries; the Kafka and in-memory ones sign with a job key.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol, Sequence

from sdcwatch.core.errors import ConfigError, TransportError
from sdcwatch.core.kafka import new_admin, new_producer, security_settings
from sdcwatch.core.messages import decode_stream, encode_items, encode_line
from sdcwatch.core.record import record_key
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.record_type import Record
from sdcwatch.core.signing import JobKey, Keyring
from sdcwatch.core.validate import check_choice, check_int
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC

__all__ = ["Transport", "KafkaTransport", "FileTransport", "MemoryTransport", "MemoryBus", "key_for_transport"]

log = logging.getLogger("sdcwatch.telemetry")


class Transport(Protocol):
    """Sends a batch of records; raises TransportError (with ``unsent``) when it cannot."""

    def send(self, records: Sequence[Record]) -> None: ...

    def close(self) -> None: ...


def _checked_key(key: Any) -> JobKey | None:
    if key is not None and not isinstance(key, JobKey):
        raise ConfigError("key", f"must be a JobKey (sdcwatch.core.signing), got a {type(key).__name__}")
    return key


def key_for_transport(key: JobKey | None, transport: Any, *, explicit: bool) -> JobKey | None:
    """Give ``key`` to a transport that signs (has a ``key`` attribute) and has none; returns the key
    it signs with. Its own key is kept (an explicit, different one is an error); one that cannot
    sign is said once, by key id."""
    if key is None:
        return getattr(transport, "key", None)
    if not hasattr(transport, "key"):
        log.warning("sdcwatch: transport %s does not sign; key %r is not used", type(transport).__name__, key.kid)
        return key
    own = transport.key
    if own is None:
        transport.key = key
        return key
    if explicit and own is not key and own.kid != key.kid:
        raise ConfigError("key", f"key {key.kid!r} given, the transport signs with {own.kid!r}")
    return own


class MemoryBus:
    """In-process topics: lists of (key, value) messages. Thread-safe, for tests and demos."""

    def __init__(self) -> None:
        self._topics: dict[str, list[tuple[bytes | None, bytes]]] = {}
        self._lock = threading.Lock()
        self.down = False  # set True to simulate an outage

    def append(self, topic: str, key: bytes | None, value: bytes) -> None:
        with self._lock:
            self._topics.setdefault(topic, []).append((key, value))

    def messages(self, topic: str, start: int = 0) -> list[tuple[bytes | None, bytes]]:
        """Raw messages of ``topic`` from offset ``start``."""
        with self._lock:
            return list(self._topics.get(topic, [])[start:])

    def records(self, topic: str = TELEMETRY_TOPIC, *, keyring: Keyring | None = None) -> list[Record]:
        """Decoded records of ``topic`` (RecordError on a malformed one; notes left out), signed ones
        verified with ``keyring`` (AuthError when one does not verify)."""
        return decode_stream((v for _, v in self.messages(topic)), keyring=keyring)

    def size(self, topic: str) -> int:
        with self._lock:
            return len(self._topics.get(topic, []))


class MemoryTransport:
    """Publishes encoded records into a :class:`MemoryBus` topic, each message signed with ``key``
    when one is set."""

    def __init__(self, bus: MemoryBus, topic: str = TELEMETRY_TOPIC, *, key: JobKey | None = None) -> None:
        self.bus = bus
        self.topic = topic
        self.key = _checked_key(key)
        self._schemas_sent: set = set()  # (key, schema id) pairs whose schema went inline

    def send(self, records: Sequence[Record | PackedRecord]) -> None:
        if self.bus.down:
            raise TransportError("memory bus is down", unsent=records)
        sign = self.key.sign if self.key is not None else None
        for key, value, _ in encode_items(records, record_key, 256, self._schemas_sent):
            self.bus.append(self.topic, key, sign(value) if sign else value)

    def close(self) -> None:
        pass


class FileTransport:
    """Appends records as JSON lines (offline capture; ``sdcwatch replay`` reads them back).
    Unsigned: a capture file is read by whoever holds it, not by a service on a shared bus."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fh = None
        self._lock = threading.Lock()

    def send(self, records: Sequence[Record]) -> None:
        with self._lock:
            try:
                if self._fh is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._fh = open(self.path, "a", encoding="utf-8")
                self._fh.write("".join(encode_line(r) + "\n" for r in records))
                self._fh.flush()
            except OSError as exc:
                raise TransportError(f"cannot write {self.path}: {exc}", unsent=records) from None

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


class KafkaTransport:
    """Produces records to a Kafka topic with kafka-python, signed with ``key`` when one is set.

    The producer is created at the first ``send`` and re-created after a failure (a broker down at
    the start, or restarted, is picked up again); the topic is created if missing with
    ``partitions`` partitions. No call blocks for long: a connection attempt gives up after
    ``connect_timeout_ms``, and every wait ends by :attr:`deadline` once the emitter closes.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str = TELEMETRY_TOPIC,
        *,
        partitions: int = 4,
        replication: int = 1,
        acks: int | str = 1,
        linger_ms: int = 5,
        batch_size: int = 256 * 1024,
        compression_type: str | None = None,
        max_block_ms: int = 2000,
        request_timeout_ms: int = 3000,
        delivery_timeout_ms: int = 6000,
        flush_timeout: float = 10.0,
        max_records_per_message: int = 256,
        connect_timeout_ms: int = 2000,
        key: JobKey | None = None,
        **security: Any,
    ) -> None:
        if not bootstrap or not isinstance(bootstrap, str):
            raise ConfigError("bootstrap", f"must be 'host:port[,host:port]', got {bootstrap!r}")
        check_int("partitions", partitions, lo=1)
        check_choice("acks", acks, (0, 1, -1, "all"))
        self.bootstrap = bootstrap
        self.topic = topic
        self.partitions = partitions
        self.replication = replication
        self.flush_timeout = flush_timeout
        self.max_records_per_message = max_records_per_message
        self.connect_timeout_ms = connect_timeout_ms
        self.key = _checked_key(key)
        #: monotonic time by which every call must return (None: no deadline); set by Emitter.close
        self.deadline: float | None = None
        self.security = security_settings(security)
        self._producer_config = dict(
            acks=acks,
            linger_ms=linger_ms,
            batch_size=batch_size,
            compression_type=compression_type,
            max_block_ms=max_block_ms,
            request_timeout_ms=request_timeout_ms,
            delivery_timeout_ms=max(delivery_timeout_ms, linger_ms + request_timeout_ms),
            retries=3,
            enable_idempotence=False,
            # a retried batch must not land behind a later one: a rank's first v2 message carries its
            # schema inline, and the ones after it wait for it at the service only so long
            max_in_flight_requests_per_connection=1,
        )
        self._producer = None
        self._topic_ready = False
        self._schemas_sent: set = set()  # (key, schema id) pairs whose schema went inline on this connection
        self._last_offsets: dict[int, int] = {}  # partition -> highest offset the broker confirmed
        self.log_resets = 0  # times the broker's log went back (it lost confirmed records)

    def _budget_ms(self, wanted_ms: float) -> int:
        """``wanted_ms``, shortened to what is left before :attr:`deadline`."""
        if self.deadline is None:
            return int(wanted_ms)
        return int(max(0.0, min(wanted_ms, (self.deadline - time.monotonic()) * 1000)))

    def _connect(self):
        from kafka.errors import KafkaError

        budget = self._budget_ms(self.connect_timeout_ms)
        if budget <= 0:
            raise TransportError(f"cannot connect to Kafka at {self.bootstrap}: no time left before close")
        try:
            self._producer = new_producer(
                self.bootstrap, self.security, **self._producer_config, bootstrap_timeout_ms=budget
            )
        except (KafkaError, OSError, ValueError) as exc:
            raise TransportError(f"cannot connect to Kafka at {self.bootstrap}: {exc}") from None
        if not self._topic_ready:
            self._topic_ready = ensure_topic(
                self.bootstrap,
                self.topic,
                self.partitions,
                self.replication,
                self.security,
                timeout_ms=max(1, self._budget_ms(3000)),
            )
        return self._producer

    def send(self, records: Sequence[Record]) -> None:
        from kafka.errors import KafkaError

        try:
            producer = self._producer or self._connect()
        except TransportError as exc:
            raise TransportError(str(exc), unsent=records) from None
        encoded = encode_items(records, record_key, self.max_records_per_message, self._schemas_sent)
        messages = [(key, recs) for key, _, recs in encoded]
        sign = self.key.sign if self.key is not None else None
        futures = []
        try:
            for key, value, _ in encoded:
                futures.append(producer.send(self.topic, key=key, value=sign(value) if sign else value))
            producer.flush(timeout=self._budget_ms(self.flush_timeout * 1000) / 1000)
        except (KafkaError, OSError) as exc:
            failed = [r for (_, recs), f in zip(messages, futures) if not (f.is_done and f.succeeded()) for r in recs]
            failed.extend(r for _, recs in messages[len(futures) :] for r in recs)
            self._reset()
            raise TransportError(f"Kafka send to {self.bootstrap} failed: {exc}", unsent=failed) from None
        failed = [r for (_, recs), f in zip(messages, futures) if not (f.is_done and f.succeeded()) for r in recs]
        self._check_offsets([f.value for f in futures if f.is_done and f.succeeded()])
        if failed:
            exc = next((f.exception for f in futures if f.is_done and f.failed()), None)
            self._reset()
            raise TransportError(f"Kafka did not confirm {len(failed)} of {len(records)} records: {exc}", unsent=failed)

    def _check_offsets(self, confirmed: Sequence[Any]) -> None:
        """Warn when a partition's offsets go back: the broker lost records it had confirmed (restarted
        without persistent storage). The producer is replaced: fresh metadata, the topic created again.
        """
        confirmed = [md for md in confirmed if md is not None and md.offset >= 0]  # acks=0: no offsets
        went_back = [
            (md.partition, self._last_offsets[md.partition], md.offset)
            for md in confirmed
            if md.offset < self._last_offsets.get(md.partition, -1)
        ]
        if went_back:  # the whole log started again: forget the old offsets of every partition
            self._last_offsets = {}
        for md in confirmed:
            self._last_offsets[md.partition] = max(md.offset, self._last_offsets.get(md.partition, -1))
        if went_back:
            self.log_resets += 1
            part, last, now = went_back[0]
            log.warning(
                "Kafka at %s: %s partition %d went back from offset %d to %d: the broker lost records it "
                "had confirmed (restarted without persistent storage?); telemetry sent before is gone "
                "from the bus",
                self.bootstrap,
                self.topic,
                part,
                last,
                now,
            )
            self._reset()

    def _reset(self) -> None:
        producer, self._producer = self._producer, None
        self._topic_ready = False
        self._schemas_sent = set()  # what the broker had may be gone: send each schema again
        if producer is not None:
            try:
                producer.close(timeout=0)
            except Exception:  # closing a broken producer must not raise into the sender
                pass

    def close(self) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=self._budget_ms(self.flush_timeout * 1000) / 1000)
            finally:
                self._producer = None


def ensure_topic(
    bootstrap: str,
    topic: str,
    partitions: int,
    replication: int = 1,
    security: dict[str, Any] | None = None,
    timeout_ms: int = 3000,
) -> bool:
    """Create ``topic`` if it does not exist; True when it exists afterwards (not reaching the admin
    API is not fatal: a broker that auto-creates topics still takes the records)."""
    from kafka.admin import NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    try:
        admin = new_admin(bootstrap, security, request_timeout_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms)
    except (KafkaError, OSError, ValueError) as exc:
        log.debug("cannot reach Kafka admin API at %s: %s", bootstrap, exc)
        return False
    try:
        if topic in set(admin.list_topics()):
            return True
        try:
            admin.create_topics([NewTopic(name=topic, num_partitions=partitions, replication_factor=replication)])
        except TopicAlreadyExistsError:
            pass
        return True
    except KafkaError as exc:
        log.warning("could not create topic %s on %s: %s", topic, bootstrap, exc)
        return False
    finally:
        admin.close()
