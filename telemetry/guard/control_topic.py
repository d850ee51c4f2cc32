"""Control decisions: what the detector service asks the training job's guard to do.

The service publishes one JSON object per decision to the control topic (``sdcwatch.control``),
keyed by run; the guard on rank 0 of that run reads it (:class:`KafkaControl`, from a background
thread of its own) and the ranks agree on it at the next step boundary. The wire format
(:class:`Decision`, :func:`decode_decision`) lives in :mod:`sdcwatch.core.control`, shared with
the service; this module holds the readers the guard polls: :class:`KafkaControl` for a real bus,
:class:`MemoryControl` for tests and in-process loops.

A reader never raises into, or blocks, the training loop: a bus that cannot be reached, or a
malformed message, costs one warning (malformed ones are counted in ``rejected``) and training
continues with the local checks only.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Iterable

from sdcwatch.core.control import Decision, open_decision
from sdcwatch.core.errors import ControlError
from sdcwatch.core.signing import JobKey, job_key_from_env
from sdcwatch.core.kafka import new_consumer
from sdcwatch.core.vocabulary import CONTROL_TOPIC

__all__ = ["DecisionCheck", "MemoryControl", "KafkaControl"]

log = logging.getLogger("sdcwatch.telemetry.guard.control_topic")


class DecisionCheck:
    """What the guard reads off the control topic: decisions for its run, signed with its job key
    when it holds one, each sequence number once (a replayed or older decision is refused).

    ``refused`` counts what was not taken (malformed, forged, unsigned while a key is held, replayed);
    the first and every hundredth refusal is logged with its reason (never a secret).
    """

    def __init__(self, run: str, key: JobKey | None) -> None:
        self.run, self.key = run, key
        self.refused = 0
        self.replayed = 0
        self._last_seq = -1

    def take(self, value: bytes) -> Decision | None:
        """The decision in a control message, or None (another run's, or refused)."""
        try:
            d = open_decision(value, self.key)
        except ControlError as exc:
            self._refuse(str(exc))
            return None
        if d.run != self.run:
            return None
        if self.key is not None:
            if d.seq <= self._last_seq:
                self.replayed += 1
                self._refuse(f"decision {d.seq} replayed or out of date (the last taken was {self._last_seq})")
                return None
            self._last_seq = d.seq
        return d

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if self.refused == 1 or self.refused % 100 == 0:
            log.warning("sdcwatch guard: refused %d control message(s); latest: %s", self.refused, why)


class MemoryControl:
    """Decisions handed over in process (tests, the campaign): ``put`` them, the guard ``poll`` s."""

    def __init__(self, decisions: Iterable[Decision] = ()) -> None:
        self._queue: collections.deque[Decision] = collections.deque(decisions, maxlen=1024)
        self._lock = threading.Lock()
        self.rejected = 0

    def put(self, decision: Decision) -> None:
        with self._lock:
            self._queue.append(decision)

    def poll(self) -> list[Decision]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def close(self) -> None:
        pass


class KafkaControl:
    """Reads the control topic from a daemon thread of its own; ``poll()`` returns what arrived.

    Only decisions for ``run`` are kept; it starts at the end of the topic (a decision about an
    earlier run of the same name is not acted on). With a job key (``key``, by default the one
    ``SDCWATCH_KEY_FILE`` or ``SDCWATCH_KEY`` names, as the emitter's), only decisions the service
    signed with it are taken, each sequence number once: a forged, unsigned or replayed decision is
    refused, counted in ``rejected`` and logged. If kafka-python is missing or the bus cannot be
    reached, it logs one warning and stays empty: the guard's local checks still work.
    """

    def __init__(
        self,
        bootstrap: str,
        run: str,
        topic: str = CONTROL_TOPIC,
        *,
        poll_timeout: float = 0.2,
        key: JobKey | None | str = "env",
        **kafka_settings: Any,
    ) -> None:
        self.bootstrap, self.run, self.topic = bootstrap, run, topic
        self.poll_timeout = poll_timeout
        self.kafka_settings = kafka_settings
        self.check = DecisionCheck(run, job_key_from_env() if key == "env" else key)  # type: ignore[arg-type]
        self.received = 0  # decisions for this run
        self.available = True  # False once the bus was found unusable
        self.inbox = MemoryControl()
        """The decisions read, until polled."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdcwatch-guard-control", daemon=True)
        self._thread.start()

    def poll(self) -> list[Decision]:
        return self.inbox.poll()

    def _give_up(self, why: str) -> None:
        self.available = False
        log.warning(
            "sdcwatch guard: control topic %s at %s unavailable (%s); training continues with the "
            "guard's local checks only",
            self.topic,
            self.bootstrap,
            why,
        )

    def _run(self) -> None:
        try:
            from kafka import TopicPartition
        except Exception as exc:  # kafka-python missing
            self._give_up(f"kafka-python not importable: {exc}")
            return
        consumer = None
        try:
            consumer = new_consumer(
                self.bootstrap,
                security=self.kafka_settings,
                enable_auto_commit=False,
                group_id=None,
                request_timeout_ms=5000,
            )
            parts = consumer.partitions_for_topic(self.topic)
            existed = bool(parts)
            while not parts and not self._stop.is_set():
                # no topic yet: the service creates it with its first decision; everything in it is new
                self._stop.wait(1.0)
                consumer.topics()  # a metadata refresh
                parts = consumer.partitions_for_topic(self.topic)
            if self._stop.is_set():
                return
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            if existed:
                consumer.seek_to_end(*tps)
                for tp in tps:
                    consumer.position(tp)
            else:
                consumer.seek_to_beginning(*tps)
            while not self._stop.is_set():
                batch = consumer.poll(timeout_ms=int(self.poll_timeout * 1000))
                for msgs in batch.values():
                    for m in msgs:
                        self._take(m.value)
        except Exception as exc:
            if not self._stop.is_set():
                self._give_up(str(exc))
        finally:
            if consumer is not None:
                try:
                    consumer.close()
                except Exception:
                    pass

    @property
    def rejected(self) -> int:
        """Control messages refused: malformed, forged, unsigned while a key is held, or replayed."""
        return self.check.refused

    def _take(self, value: bytes) -> None:
        d = self.check.take(value)
        if d is not None:
            self.inbox.put(d)
            self.received += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
