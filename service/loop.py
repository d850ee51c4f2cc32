"""DetectorService: the streaming loop (source -> pipeline -> sinks) with periodic state snapshots.

It polls a source (a Kafka consumer group or an in-memory bus), feeds the pipeline, closes steps
whose deadline passed, and hands every incident change to the sinks, among them the
:class:`~sdcwatch.service.bus.AnomalyTopicSink` that publishes ``Incident.to_dict()`` JSON to
``sdcwatch.anomalies``.
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
from typing import Any, Callable, Sequence

from sdcwatch.core.errors import ConfigError, RecordError
from sdcwatch.core.incident import IncidentEvent, IncidentSink, ServiceView
from sdcwatch.core.jsonsafe import json_safe
from sdcwatch.service.bus import Source as RecordSource  # the protocol the service reads through
from sdcwatch.service.bus import SummaryTopicSink
from sdcwatch.service.pipeline import DetectionPipeline

__all__ = ["DetectorService", "STATE_FILE", "SCHEMAS_FILE"]

log = logging.getLogger("sdcwatch.service.loop")


def _waiting_for_schema(source: Any) -> int:
    """v2 messages the source holds until their schema comes (0 for a source without v2 ingest)."""
    ingest = getattr(source, "ingest", None)
    return int(getattr(ingest, "pending", 0) or 0)


def _offset_gaps(source: Any) -> dict[str, int]:
    """Gaps in the source's partition offsets by outcome (refetched, filled, skipped); {} without."""
    gaps = getattr(source, "gaps", None)
    counts = getattr(gaps, "counts", None)
    return {k: int(counts[k]) for k in ("refetched", "filled", "skipped")} if counts else {}


STATE_FILE = "pipeline-state.json"
#: The wire-v2 record layouts the source learnt (see ``DetectorService._save_schemas``).
SCHEMAS_FILE = "schemas.json"


class DetectorService:
    """Runs the detection loop; ``state_dir`` (optional) holds the snapshots that make restarts seamless.

    The state is loaded from ``state_dir`` here unless ``resumed`` says the caller has loaded it
    into the pipeline already (``sdcwatch serve`` does, to refuse a damaged state file before it
    connects to the bus).

    The pipeline's stage decides what flows: ``both`` reads records and publishes incidents;
    ``spatial`` reads records and hands step summaries to ``summary_sink``; ``temporal`` reads
    summaries (a source built with ``decode=decode_summary_message``) and publishes incidents.
    """

    def __init__(
        self,
        source: RecordSource,
        pipeline: DetectionPipeline | None = None,
        *,
        sinks: Sequence[IncidentSink] = (),
        summary_sink: SummaryTopicSink | None = None,
        state_dir: str | Path | None = None,
        snapshot_every: float = 10.0,
        poll_timeout: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        resumed: bool | None = None,
    ) -> None:
        if snapshot_every <= 0:
            raise ConfigError("service.snapshot_every", f"must be a positive number of seconds, got {snapshot_every!r}")
        if poll_timeout <= 0:
            raise ConfigError("service.poll_timeout", f"must be positive, got {poll_timeout!r}")
        self.source = source
        self.pipeline = pipeline or DetectionPipeline()
        if self.pipeline.stage == "spatial" and summary_sink is None:
            raise ConfigError("service.summary_sink", "a spatial stage needs a summary sink (the summaries topic)")
        self.summary_sink = summary_sink
        self.sinks = list(sinks)
        self.state_path = Path(state_dir) / STATE_FILE if state_dir is not None else None
        self.snapshot_every = snapshot_every
        self.poll_timeout = poll_timeout
        self.clock = clock
        self.resumed = False
        self.events_published = 0
        self.state_write_errors = 0
        self._state_failing = 0  # failed snapshots since the last one written
        """Snapshots that could not be written (a full or read-only disk): counted, logged, retried."""
        self.consumer_lag = 0  # records behind the end of the topic, refreshed about once a second
        self._lock = threading.Lock()  # guards the pipeline against view() from the scrape thread
        self._last_snapshot = clock()
        self._last_lag = -1e9
        if resumed is not None:  # the caller loaded the state already (before connecting to the bus)
            self.resumed = resumed
        elif self.state_path is not None:
            try:
                self.resumed = self.pipeline.load(self.state_path)
            except Exception:
                self.source.close()  # the caller never gets the service: release the consumer here
                raise
            if self.resumed:
                log.info("resumed detection state from %s", self.state_path)
        if self.state_path is not None:
            self._load_schemas()

    def step(self) -> list[IncidentEvent]:
        """One iteration: poll, detect, close late steps, publish; snapshot when it is time."""
        items = self.source.poll(self.poll_timeout)
        backlog = self._backlog()
        with self._lock:
            self.pipeline.aligner.backlog = backlog
            if self.pipeline.stage == "temporal":
                events = self.pipeline.process_summaries(items)
            else:
                events = self.pipeline.process(items)
            events += self.pipeline.tick()
            events += self.pipeline.expire()
            rejected = self.pipeline.aligner.take_rejected()
            summaries = self.pipeline.take_summaries()
        for reason, why, records in rejected:  # records the aligner refused: dead-lettered, counted
            log.warning("dead-lettering %d record(s): %s", len(records), why)
            try:
                self.source.dead_letter(records, reason, why)
            except Exception:
                log.exception("could not dead-letter %d record(s)", len(records))
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
        with self._lock:  # the state is copied under the lock, written without it (scrapes go on)
            state = json_safe(self.pipeline.snapshot())
        try:
            self.pipeline.save(self.state_path, state)
            self._save_schemas()
        except OSError as exc:  # detection goes on; the offsets stay uncommitted, the next snapshot retries
            self._state_not_saved(exc)
            return
        if self.state_write_errors and self._state_failing:
            log.warning("state written to %s again after %d failed snapshot(s)", self.state_path, self._state_failing)
        self._state_failing = 0
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

    def _state_not_saved(self, exc: OSError) -> None:
        """A snapshot that could not be written: counted (``sdcwatch_state_write_errors_total``,
        which an alert watches), logged at the first failure of a streak and every tenth after,
        retried at the next snapshot. The source is not committed: a restart re-reads from the last
        snapshot that was written."""
        self.state_write_errors += 1
        self._state_failing += 1
        if self._state_failing == 1 or self._state_failing % 10 == 0:
            log.error(
                "state not written to %s (%s; %d snapshot(s) in a row): detection goes on, offsets stay "
                "uncommitted, the next snapshot retries in %.0f s",
                self.state_path,
                exc.strerror or exc,
                self._state_failing,
                self.snapshot_every,
            )
        self._last_snapshot = self.clock()

    def _save_schemas(self) -> None:
        """The wire-v2 layouts the source learnt, beside the state: after a restart, records re-read
        from the middle of a window decode without waiting for their schema to come round again."""
        registry = getattr(self.source, "schemas", None)
        if registry is None or not len(registry):
            return
        path = self.state_path.with_name(SCHEMAS_FILE)
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(registry.snapshot()))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(path)

    def _load_schemas(self) -> None:
        registry = getattr(self.source, "schemas", None)
        path = self.state_path.with_name(SCHEMAS_FILE)
        if registry is None or not path.exists():
            return
        try:
            registry.restore(json.loads(path.read_text()))
        except (ValueError, OSError, RecordError) as exc:  # a damaged file costs a wait for the schemas
            log.warning("could not read the saved record schemas %s: %s", path, exc)

    def _backlog(self) -> bool:
        """Whether records are waiting on the bus (the source's last lag; False if it has none)."""
        try:
            return int(self.source.lag()) > 0
        except Exception:
            return False

    def _refresh_lag(self) -> None:
        try:
            self.consumer_lag = int(self.source.lag())
        except Exception:
            log.debug("consumer lag unavailable", exc_info=True)
        self._last_lag = self.clock()

    def view(self, max_runs: int | None = None) -> ServiceView:
        """A consistent view for the exporter (thread-safe): at most ``max_runs`` runs."""
        with self._lock:
            return self.pipeline.view(
                dead_letters_total=int(getattr(self.source, "dead_letters", 0)),
                consumer_lag=self.consumer_lag,
                dead_letter_reasons=getattr(self.source, "dead_letter_reasons", None),
                consumer_partitions=int(getattr(self.source, "partitions", -1)),
                waiting_for_schema=_waiting_for_schema(self.source),
                offset_gaps=_offset_gaps(self.source),
                state_write_errors_total=self.state_write_errors,
                max_runs=max_runs,
            )

    def run_for(
        self,
        seconds: float | None = None,
        *,
        until: Callable[[], bool] | None = None,
        max_iterations: int | None = None,
    ) -> None:
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
