"""An in-memory source for the service's tests: reads a :class:`~sdcwatch.telemetry.MemoryBus`
topic the way :class:`~sdcwatch.service.kafka_source.KafkaSource` reads Kafka (same decoding, same
dead letters), so a test drives :class:`~sdcwatch.service.loop.DetectorService` without a broker.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.messages import decode_message
from sdcwatch.core.record import encode
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import DEADLETTER_TOPIC, TELEMETRY_TOPIC
from sdcwatch.service.bus import DeadLetterCounts, dead_letter_value, decode_batch
from sdcwatch.service.ingest import IngestDecoder, Rejected, SchemaRegistry, count_records

__all__ = ["MemorySource", "bus_sink"]


def bus_sink(sink_type: Any, bus: Any, topic: str | None = None, **options: Any) -> Any:
    """A topic sink (:class:`~sdcwatch.exporters.topics.TopicWriter`) writing to ``topic`` (its
    default one when None) of a :class:`~sdcwatch.telemetry.MemoryBus`."""
    topic = topic or sink_type.DEFAULT_TOPIC
    return sink_type(lambda k, v: bus.append(topic, k, v), **options)


class MemorySource(DeadLetterCounts):
    """Reads a :class:`~sdcwatch.telemetry.MemoryBus` topic."""

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
        # telemetry (v1 and v2) is decoded a poll at a time; ``schemas`` is what it learnt
        self.ingest = ingest if ingest is not None else IngestDecoder(SchemaRegistry(limits))
        self.schemas = self.ingest.registry
        self.topic = topic
        self.deadletter_topic = deadletter_topic
        self.records = 0
        self.dead_letters = 0
        self.dead_letter_reasons: dict[str, int] = {}
        self.dead_letter_log: list[Rejected] = []
        self._offset = 0  # next offset to read
        self._committed = 0

    def poll(self, timeout: float = 0.0, max_records: int = 10_000) -> list:
        """Decoded records and v2 column blocks (``RecordColumns``); bad messages are dead-lettered."""
        msgs = self.bus.messages(self.topic, self._offset)[:max_records]
        if not msgs and timeout > 0:
            time.sleep(min(timeout, 0.01))
        origins = [f"{self.topic}/0/{self._offset + i}" for i in range(len(msgs))]
        out, rejected = decode_batch([(o, k, v) for o, (k, v) in zip(origins, msgs)], self.decode, self.ingest)
        for rj in rejected:
            self.dead_letter_log.append(rj)
            self.bus.append(self.deadletter_topic, rj.key, dead_letter_value(rj.value)[0])
            self._count_dead_letter(rj.code)
        self._offset += len(msgs)
        self.records += count_records(out)
        return out

    def catch_up(self, timeout: float) -> None:
        """Nothing to wait for: the in-memory topic is read whole at each poll."""

    def dead_letter(self, records: Sequence[Record], reason: str, why: str) -> None:
        """Route records the pipeline refused (e.g. an implausible step) to the dead-letter topic."""
        for rec in records:
            self.bus.append(self.deadletter_topic, None, encode(rec))
            self.dead_letter_log.append(Rejected("pipeline", None, None, why, reason))
        self._count_dead_letter(reason, len(records))

    assigned = True  # an in-memory topic needs no group join
    owns_topic = True

    def health(self) -> dict[str, Any]:
        return {
            "dead_letters_total": self.dead_letters,
            "dead_letter_reasons": dict(self.dead_letter_reasons),
            "consumer_partitions": 1,
            "waiting_for_schema": self.ingest.pending,
        }

    def commit(self) -> None:
        self._committed = self._offset

    def positions(self) -> dict[int, int]:
        return {0: self._offset}

    def lag(self) -> int:
        return self.bus.size(self.topic) - self._offset

    def close(self) -> None:
        pass
