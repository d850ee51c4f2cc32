"""DetectorService: the streaming loop (source -> pipeline -> sinks) with periodic state snapshots.

It polls a source (a Kafka consumer group or an in-memory bus), feeds the pipeline, closes steps
whose deadline passed, and hands every incident change to the sinks, among them the
:class:`AnomalyTopicSink` that publishes ``Incident.to_dict()`` JSON to ``sdcwatch.anomalies``.
Every ``snapshot_every`` seconds it writes the pipeline state to ``state_dir`` and only then commits
the source's offsets: after a crash or a restart the service reloads the state, re-reads at most
what came after the snapshot (duplicates and already-closed steps are dropped by the aligner) and
so resumes without a new warm-up and without repeating an alert.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

from sdcwatch.detectors.pipeline import DetectionPipeline
from sdcwatch.detectors.source import Source as RecordSource  # the protocol the service reads through
from sdcwatch.core.names import ANOMALY_TOPIC, SUMMARY_TOPIC
from sdcwatch.detectors.summary import StepSummary, encode_summary
from sdcwatch.detectors.types import IncidentEvent, IncidentSink, ServiceView
from sdcwatch.core.errors import ConfigError

__all__ = ["DetectorService", "AnomalyTopicSink", "SummaryTopicSink", "RecordSource", "ANOMALY_TOPIC", "STATE_FILE"]

log = logging.getLogger("sdcwatch.detectors.service")

STATE_FILE = "pipeline-state.json"


def _kafka_sender(bootstrap: str, topic: str, **producer_settings: Any):
    """(send(key, value), flush() -> bool, close()) over one kafka-python producer.

    Sending is asynchronous; a message the broker refuses (too large, topic gone, timed out) is
    logged and makes the next ``flush`` return False, so the caller does not commit as if it had
    been delivered.
    """
    from kafka import KafkaProducer  # lazy: replay and unit tests never need it

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks=1, **producer_settings)
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


class DetectorService:
    """Runs the detection loop; ``state_dir`` (optional) holds the snapshots that make restarts seamless.

    The pipeline's role decides what flows: ``both`` reads records and publishes incidents;
    ``spatial`` reads records and hands step summaries to ``summary_sink``; ``temporal`` reads
    summaries (a source built with ``decode=decode_summary_message``) and publishes incidents.
    """

    def __init__(self, source: RecordSource, pipeline: DetectionPipeline | None = None, *,
                 sinks: Sequence[IncidentSink] = (), summary_sink: SummaryTopicSink | None = None,
                 state_dir: str | Path | None = None,
                 snapshot_every: float = 10.0, poll_timeout: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if snapshot_every <= 0:
            raise ConfigError("service.snapshot_every", f"must be a positive number of seconds, got {snapshot_every!r}")
        if poll_timeout <= 0:
            raise ConfigError("service.poll_timeout", f"must be positive, got {poll_timeout!r}")
        self.source = source
        self.pipeline = pipeline or DetectionPipeline()
        if self.pipeline.role == "spatial" and summary_sink is None:
            raise ConfigError("service.summary_sink", "a spatial stage needs a summary sink (the summaries topic)")
        self.summary_sink = summary_sink
        self.sinks = list(sinks)
        self.state_path = Path(state_dir) / STATE_FILE if state_dir is not None else None
        self.snapshot_every = snapshot_every
        self.poll_timeout = poll_timeout
        self.clock = clock
        self.resumed = False
        self.events_published = 0
        self._lock = threading.Lock()  # guards the pipeline against view() from the scrape thread
        self._last_snapshot = clock()
        self._last_lag = -1e9
        if self.state_path is not None:
            self.resumed = self.pipeline.load(self.state_path)
            if self.resumed:
                log.info("resumed detection state from %s", self.state_path)

    def step(self) -> list[IncidentEvent]:
        """One iteration: poll, detect, close late steps, publish; snapshot when it is time."""
        items = self.source.poll(self.poll_timeout)
        with self._lock:
            if self.pipeline.role == "temporal":
                events = self.pipeline.process_summaries(items)
            else:
                events = self.pipeline.process(items)
            events += self.pipeline.tick()
            events += self.pipeline.expire()
            self.pipeline.dead_letters_total = int(getattr(self.source, "dead_letters", 0))
            summaries, self.pipeline.outbox = self.pipeline.outbox, []
        if summaries:
            self.summary_sink.publish(summaries)
        self._publish(events)
        if self.clock() - self._last_lag >= 1.0:
            self._refresh_lag()
        if self.state_path is not None and self.clock() - self._last_snapshot >= self.snapshot_every:
            self.snapshot()
        return events

    def _publish(self, events: list[IncidentEvent]) -> None:
        for ev in events:
            for sink in self.sinks:
                try:
                    sink.publish(ev)
                except Exception:  # the protocol says publish never raises; be sure anyway
                    log.exception("sink %r failed", sink)
            self.events_published += 1

    def snapshot(self) -> None:
        """Write the state, then commit the source (never the other way round)."""
        if self.state_path is None:
            return
        with self._lock:
            self.pipeline.save(self.state_path)
        if self.summary_sink is not None and not self.summary_sink.flush():
            log.warning("summaries not confirmed by the bus: offsets not committed (the steps will be re-read)")
            self._last_snapshot = self.clock()
            return
        try:
            self.source.commit()
        except Exception:
            log.exception("source commit failed (records after the last commit will be re-read)")
        self._refresh_lag()
        self._last_snapshot = self.clock()

    def _refresh_lag(self) -> None:
        try:
            self.pipeline.consumer_lag = int(self.source.lag())
        except Exception:
            log.debug("consumer lag unavailable", exc_info=True)
        self._last_lag = self.clock()

    def view(self) -> ServiceView:
        """A consistent view for the exporter (thread-safe)."""
        with self._lock:
            return self.pipeline.view()

    def run_for(self, seconds: float | None = None, *, until: Callable[[], bool] | None = None,
                max_iterations: int | None = None) -> None:
        """Run until ``seconds`` passed, ``until()`` is true or ``max_iterations`` ran."""
        start = self.clock()
        n = 0
        while True:
            self.step()
            n += 1
            if seconds is not None and self.clock() - start >= seconds:
                break
            if until is not None and until():
                break
            if max_iterations is not None and n >= max_iterations:
                break

    def run_forever(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set, then snapshot and close."""
        try:
            while not stop.is_set():
                self.step()
        finally:
            self.close()

    def close(self) -> None:
        """Snapshot (so the next start resumes), close the source and the sinks."""
        try:
            self.snapshot()
        finally:
            try:
                self.source.close()
            finally:
                if self.summary_sink is not None:
                    self.summary_sink.close()
                for sink in self.sinks:
                    try:
                        sink.close()
                    except Exception:
                        log.exception("sink %r close failed", sink)
