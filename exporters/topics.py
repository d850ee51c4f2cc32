"""The sinks that write to the bus: incident changes to the anomalies topic (signed with the service's
key when it has keys), the guards' decisions to the control topic, a spatial stage's step summaries to
the summaries topic. Each is a :class:`TopicWriter` over one ``send(key, value)``; it never raises,
failures count in ``errors``."""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable, ClassVar, Protocol, Sequence

from sdcwatch.core.control import Decision
from sdcwatch.core.incident import Incident, IncidentEvent
from sdcwatch.core.kafka import SECURITY_KEYS, new_producer
from sdcwatch.core.signing import JobKey
from sdcwatch.core.vocabulary import ANOMALY_TOPIC, CONTROL_TOPIC, SUMMARY_TOPIC

__all__ = ["TopicWriter", "AnomalyTopicSink", "ControlTopicSink", "SummaryTopicSink", "DecisionPolicy"]

log = logging.getLogger("sdcwatch.detectors")
decisions_log = logging.getLogger("sdcwatch.service.control_policy")
_REMEMBER = 10_000  # (incident, action) pairs the control sink remembers deciding, and decisions it keeps


def _kafka_sender(bootstrap: str, topic: str, **producer_settings: Any):
    """(send(key, value), flush() -> bool, close()) over one kafka-python producer, asynchronous: a
    message the broker refuses is logged and makes the next ``flush`` return False (no commit)."""
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
    """The writing end of one topic, shared by the sinks that publish to the bus: over any
    ``send(key, value)``, or :meth:`to_kafka`, which hands what is not the sink's own (:attr:`OPTIONS`) to the producer."""

    DEFAULT_TOPIC: ClassVar[str]
    KAFKA_SETTINGS: ClassVar[dict[str, Any]] = {}
    OPTIONS: ClassVar[tuple[str, ...]] = ()
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
    def to_kafka(cls, bootstrap: str, topic: str | None = None, **settings: Any):
        """A sink writing to ``topic`` through a kafka-python producer (``settings`` past :attr:`OPTIONS`)."""
        options = {k: settings.pop(k) for k in cls.OPTIONS if k in settings}
        producer = {**cls.KAFKA_SETTINGS, **settings}
        return cls(*_kafka_sender(bootstrap, topic or cls.DEFAULT_TOPIC, **producer), **options)

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
    """Publishes each incident change as JSON (``Incident.to_dict()`` plus ``change``) to a topic,
    and each checkpoint marking as ``{"change": "checkpoint", ...}`` keyed by the checkpoint's id
    (readers keep the latest per id)."""

    DEFAULT_TOPIC = ANOMALY_TOPIC
    KAFKA_SETTINGS = {"linger_ms": 20}
    OPTIONS = ("key",)
    LABEL = "anomaly"

    def __init__(self, *args: Any, key: JobKey | None = None) -> None:
        super().__init__(*args)
        self.key = key
        """The service's key for this topic (``Keyring.service_key("anomalies")``): each message signed
        with it, and readers that hold the key file believe no other (None: unsigned, no keys)."""

    def publish(self, event: IncidentEvent) -> None:
        self._write(event.change, event.incident)

    def publish_mark(self, mark: Any) -> None:
        """One checkpoint marking (:class:`~sdcwatch.core.rank_notes.CheckpointMark`)."""
        self._write("checkpoint", mark)

    def _write(self, change: str, item: Any) -> None:
        try:
            body = json.dumps({"change": change, **item.to_dict()}, allow_nan=False).encode("utf-8")
            self._send(item.id.encode("utf-8"), body if self.key is None else self.key.sign(body, fresh=False))
            self.published += 1
        except Exception:  # a sink must never stall or break detection
            self.errors += 1
            log.exception("anomaly topic: could not publish incident %s", item.id)


class DecisionPolicy(Protocol):
    """What the control sink asks of a policy (:class:`sdcwatch.service.control_policy.ControlPolicy`)."""

    def decide(self, incident: Incident) -> Decision | None: ...


class ControlTopicSink(TopicWriter):
    """An incident sink that publishes a policy's decisions to the control topic, keyed by run.

    Each (incident, action) is decided once: an incident updated every step does not repeat its
    decision, one that escalates to a kind with another action gets the new one. A run whose
    telemetry is signed (``keys(run)``, ``Authenticator.key_of``) gets its decisions bound to the
    start it announced last (``nonces(run)``, ``Authenticator.nonce_of``), numbered and
    signed with its key. ``deliver`` hands decisions over in process instead (the campaign's
    closed loop, tests). Never raises.
    """

    DEFAULT_TOPIC = CONTROL_TOPIC
    KAFKA_SETTINGS = {"linger_ms": 0}
    OPTIONS = ("policy", "keys", "nonces", "deliver")
    LABEL = "control"

    def __init__(
        self,
        *args: Any,
        policy: DecisionPolicy,
        keys: Callable[[str], JobKey | None] | None = None,
        nonces: Callable[[str], str] | None = None,
        deliver: Callable[[Decision], Any] | None = None,
    ) -> None:
        super().__init__(*args)
        self.policy = policy
        self.keys, self.nonces = keys, nonces
        self.deliver = deliver
        self._seq = 0
        self.decisions: list[Decision] = []
        """Decisions published so far (the newest 10,000)."""
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def _next_seq(self) -> int:
        """An increasing number, across restarts too: microseconds of wall time, or one more than
        the last (a guard acts on each number of its run once and refuses older ones)."""
        self._seq = max(self._seq + 1, time.time_ns() // 1000)
        return self._seq

    def publish(self, event: IncidentEvent) -> None:
        try:
            if event.change == "resolved":
                return
            decision = self.policy.decide(event.incident)
            if decision is None:
                return
            key = (event.incident.id, decision.action)
            if key in self._seen:
                return
            self._seen[key] = None
            while len(self._seen) > _REMEMBER:
                self._seen.popitem(last=False)
            if self.deliver is not None:
                self.deliver(decision)
            else:
                job_key = self.keys(decision.run) if self.keys is not None else None
                if job_key is None:  # an unsigned decision, as an earlier release reads it
                    self._send(decision.run.encode("utf-8"), decision.encode())
                else:  # numbered and signed: the job's guard takes each number once
                    nonce = self.nonces(decision.run) if self.nonces is not None else ""
                    decision = replace(decision, seq=self._next_seq(), nonce=nonce)
                    self._send(decision.run.encode("utf-8"), decision.sign(job_key))
            self.decisions.append(decision)
            del self.decisions[:-_REMEMBER]
            self.published += 1
            decisions_log.warning(
                "control decision for run %s: %s %s (%s)",
                decision.run,
                decision.action,
                list(decision.ranks) or "the run",
                decision.reason,
            )
        except Exception:  # a sink must never stall or break detection
            self.errors += 1
            log.exception("control topic: could not publish a decision for incident %s", event.incident.id)


class SummaryTopicSink(TopicWriter):
    """The spatial stage's output: each step summary, made by ``encode``, as one message, keyed by run so
    one run's summaries reach one temporal instance; flushed before the telemetry offsets are committed."""

    DEFAULT_TOPIC = SUMMARY_TOPIC
    # summaries grow with ranks x metrics (330 kB measured at 16,384 ranks x 136 metrics): past the
    # producer's 1 MB default for the largest jobs; the broker's message.max.bytes still applies
    KAFKA_SETTINGS = {"linger_ms": 5, "max_request_size": 8 << 20}
    OPTIONS = ("encode",)
    LABEL = "summaries"

    def __init__(self, *args: Any, encode: Callable[[Any], bytes]) -> None:
        super().__init__(*args)
        self.encode = encode
        self._unflushed_errors = 0
        self.bytes = 0

    def publish(self, summaries: Sequence[Any]) -> None:
        for s in summaries:
            try:
                value = self.encode(s)
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
