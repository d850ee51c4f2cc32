"""The readers the guard polls for the service's decisions (wire format: :mod:`sdcwatch.core.control`):
:class:`KafkaControl` for the control topic, :class:`MemoryControl` in process. A reader never raises
into, or blocks, the training loop: a bus it cannot reach or a malformed message costs a warning."""

from __future__ import annotations

import contextlib
import collections
import logging
import threading
import time
from typing import Any, Callable, Iterable

from sdcwatch.core.control import Decision, JobStart, open_decision
from sdcwatch.core.errors import ControlError
from sdcwatch.core.kafka import new_consumer, new_producer
from sdcwatch.core.signing import JobKey, job_key_from_env
from sdcwatch.core.validate import check_number
from sdcwatch.core.vocabulary import CONTROL_TOPIC, TELEMETRY_TOPIC
from sdcwatch.telemetry.wire.environment import RankEnvironment

__all__ = ["DecisionCheck", "MemoryControl", "KafkaControl"]

log = logging.getLogger("sdcwatch.telemetry.guard.control_topic")


class DecisionCheck:
    """What the guard reads off the control topic: decisions for its run. With a job key, only a
    decision signed with it, carrying this start's nonce (:attr:`start`), issued at most ``max_age``
    seconds ago and at most ``skew`` seconds ahead of this clock, each sequence number once.

    ``refused`` counts what was not taken, ``refused_by`` by reason (malformed, signature, start,
    stale, future, replayed); each reason's first refusal and every hundredth refusal is logged
    with why (never a secret). Never raises.
    """

    REASONS = ("malformed", "signature", "start", "stale", "future", "replayed")

    def __init__(
        self,
        run: str,
        key: JobKey | None,
        *,
        max_age: float = 300.0,
        skew: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_number("control.max_age", max_age, lo=0, lo_open=True)
        check_number("control.skew", skew, lo=0)
        self.run, self.key, self.max_age, self.skew, self.clock = run, key, max_age, skew, clock
        self.start = JobStart(run, started_at=clock())
        """This start of the job: its nonce is what a decision for it must carry."""
        self.refused = 0
        self.refused_by = dict.fromkeys(self.REASONS, 0)
        self._last_seq = -1

    @property
    def replayed(self) -> int:
        return self.refused_by["replayed"]

    def take(self, value: bytes) -> Decision | None:
        """The decision in a control message, or None (another run's, or refused)."""
        try:
            d = open_decision(value, self.key)
        except ControlError as exc:
            self._refuse("signature" if exc.key == "signature" else "malformed", str(exc))
            return None
        if d.run != self.run:
            return None
        if self.key is None:
            return d
        now = self.clock()
        if d.nonce != self.start.nonce:
            self._refuse("start", f"decision {d.seq} was issued for another start of run {d.run!r} (its nonce differs)")
        elif now - d.issued_at > self.max_age:
            self._refuse("stale", f"decision {d.seq} was issued {now - d.issued_at:.0f} s ago (max {self.max_age:g} s)")
        elif d.issued_at - now > self.skew:
            self._refuse("future", f"decision {d.seq} is stamped {d.issued_at - now:.0f} s ahead of this clock")
        elif d.seq <= self._last_seq:
            self._refuse("replayed", f"decision {d.seq} replayed or out of date (the last taken was {self._last_seq})")
        else:
            self._last_seq = d.seq
            return d
        return None

    def _refuse(self, reason: str, why: str) -> None:
        self.refused += 1
        self.refused_by[reason] += 1
        if self.refused_by[reason] == 1 or self.refused % 100 == 0:
            log.warning("sdcwatch guard: refused %d control message(s); latest (%s): %s", self.refused, reason, why)


class MemoryControl:
    """Decisions handed over in process (tests, the campaign): ``put`` them, the guard ``poll`` s."""

    def __init__(self, decisions: Iterable[Decision] = ()) -> None:
        self._queue: collections.deque[Decision] = collections.deque(decisions, maxlen=1024)
        self._lock = threading.Lock()

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
    ``SDCWATCH_KEY_FILE`` or ``SDCWATCH_KEY`` names, as the emitter's), it first announces this
    start (:class:`~sdcwatch.core.control.JobStart`, signed) on ``telemetry_topic`` (default the
    emitter's: ``SDCWATCH_BUS_TELEMETRY_TOPIC``, else ``sdcwatch.telemetry``), and takes only decisions
    the service signed with the key for this start, fresh (:class:`DecisionCheck`), each sequence
    number once: anything else is refused, counted in ``rejected`` and logged. If kafka-python is
    missing or the bus cannot be reached, it logs one warning and stays empty: the guard's local
    checks still work.
    """

    def __init__(
        self,
        bootstrap: str,
        run: str,
        topic: str = CONTROL_TOPIC,
        *,
        poll_timeout: float = 0.2,
        key: JobKey | None | str = "env",
        telemetry_topic: str | None = None,
        max_age: float = 300.0,
        skew: float = 30.0,
        **kafka_settings: Any,
    ) -> None:
        self.bootstrap, self.run, self.topic = bootstrap, run, topic
        self.telemetry_topic = telemetry_topic or RankEnvironment.read().telemetry_topic or TELEMETRY_TOPIC
        self.poll_timeout = poll_timeout
        self.kafka_settings = kafka_settings
        key = job_key_from_env() if key == "env" else key
        self.check = DecisionCheck(run, key, max_age=max_age, skew=skew)  # type: ignore[arg-type]
        self.announced = key is None  # nothing to announce without a key
        self.received = 0  # decisions for this run
        self.inbox = MemoryControl()
        """The decisions read, until polled."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdcwatch-guard-control", daemon=True)
        self._thread.start()

    def _announce(self) -> None:
        """Send this start, signed, to the telemetry topic (retried from the reader's loop until sent)."""
        key = self.check.key
        if self.announced or key is None:
            return
        producer = None
        try:
            producer = new_producer(self.bootstrap, security=self.kafka_settings, linger_ms=0)
            value = key.sign(self.check.start.encode())
            producer.send(self.telemetry_topic, key=self.run.encode("utf-8"), value=value).get(timeout=10)
            self.announced = True
        except Exception as exc:
            log.warning("sdcwatch guard: could not announce this start on %s (%s); retrying", self.telemetry_topic, exc)
        finally:
            if producer is not None:
                with contextlib.suppress(Exception):
                    producer.close(1)

    def poll(self) -> list[Decision]:
        return self.inbox.poll()

    def _give_up(self, why: str) -> None:
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
            self._announce()  # before the first decision can be made for this start
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
                self._announce()  # when the first try failed
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
                if not self.announced and not self._stop.wait(1.0):
                    self._announce()
                batch = consumer.poll(timeout_ms=int(self.poll_timeout * 1000))
                for msgs in batch.values():
                    for m in msgs:
                        self._take(m.value)
        except Exception as exc:
            if not self._stop.is_set():
                self._give_up(str(exc))
        finally:
            if consumer is not None:
                with contextlib.suppress(Exception):
                    consumer.close()

    @property
    def rejected(self) -> int:
        """Control messages refused: malformed, forged, unsigned while a key is held, for another
        start, stale, from the future or replayed (``check.refused_by``: by reason)."""
        return self.check.refused

    def _take(self, value: bytes) -> None:
        d = self.check.take(value)
        if d is not None:
            self.inbox.put(d)
            self.received += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
