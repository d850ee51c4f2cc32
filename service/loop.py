"""DetectorService: the streaming loop (source -> pipeline -> sinks). Every ``snapshot_every`` seconds it
writes the pipeline state and only then commits the source's offsets: a restart re-reads at most what came
after the snapshot, without a new warm-up or a repeated alert (docs/service.md, "The state file").
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from sdcwatch.core.errors import ConfigError, RecordError, TransportError
from sdcwatch.core.incident import IncidentEvent, IncidentSink, ServiceView
from sdcwatch.core.jsonsafe import json_safe
from sdcwatch.core.validate import check_positive
from sdcwatch.service.announced import JOURNAL_FILE, AnnouncementJournal
from sdcwatch.service.bus import Source as RecordSource  # the protocol the service reads through
from sdcwatch.service.changelog import ChangelogSnapshot, StateChangelog, resume_state
from sdcwatch.service.host_files import apply_clears, write_host_files
from sdcwatch.service.ingest import RecordColumns
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.statefile import read_state, write_state

if TYPE_CHECKING:
    from sdcwatch.exporters.topics import SummaryTopicSink

__all__ = ["DetectorService", "STATE_FILE", "SCHEMAS_FILE"]

log = logging.getLogger("sdcwatch.service.loop")


#: Records (or summaries) fed to the pipeline under one hold of the lock: /metrics, which takes the
#: same lock, waits for at most this many, not for a whole poll of up to 20,000 (a second of CPU
#: under a flood).
SLICE_RECORDS = 2048


def _slices(items: list, size: int) -> list[list]:
    """``items`` (records, column blocks, summaries) in runs of about ``size`` records, in order;
    at least one (empty) run, so the pipeline hears of an empty poll too."""
    if len(items) <= 1:
        return [items]
    out: list[list] = [[]]
    n = 0
    for it in items:
        k = len(it) if isinstance(it, RecordColumns) else 1
        if n and n + k > size:
            out.append([])
            n = 0
        out[-1].append(it)
        n += k
    return out


#: Longest a step waits for the source's reader to read what is on the bus before judging records
#: that wait for their share (a flood's), with keys on: the pipeline still judges a pass at least this
#: often, and a key's runs sharing one share keep their pace with fewer passes. Without keys each name
#: is a taker, so fewer passes slow a real run among a flood's names: no wait there.
READ_FIRST_S = 1.0

STATE_FILE = "pipeline-state.json"
#: The wire-v2 record layouts the source learnt (see ``DetectorService._save_schemas``).
SCHEMAS_FILE = "schemas.json"


class DetectorService:
    """Runs the detection loop; ``state_dir`` (optional) holds the snapshots that make restarts seamless.

    The state is loaded from ``state_dir`` (or the newer snapshot of the state topic ``changelog``)
    unless ``resumed`` says the caller loaded it already (``taken``: the topic's snapshot it took,
    whose journal is adopted). A ``spatial`` stage hands step summaries to ``summary_sink``; a
    ``temporal`` stage reads them (a source built with ``decode=decode_summary_message``).
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
        changelog: StateChangelog | None = None,
        taken: ChangelogSnapshot | None = None,
    ) -> None:
        check_positive("service", snapshot_every=snapshot_every, poll_timeout=poll_timeout)
        self.source = source
        self.schemas = source.schemas  # the wire-v2 layouts the source learns
        self.pipeline = pipeline or DetectionPipeline()
        if self.pipeline.stage == "spatial" and summary_sink is None:
            raise ConfigError("service.summary_sink", "a spatial stage needs a summary sink (the summaries topic)")
        self.summary_sink = summary_sink
        self.sinks = list(sinks)
        self.state_path = Path(state_dir) / STATE_FILE if state_dir is not None else None
        if changelog is not None and self.state_path is None:
            raise ConfigError("state.topic", "the state topic is written beside the state folder: give state_dir too")
        self.changelog = changelog
        self.snapshot_every = snapshot_every
        self.poll_timeout = poll_timeout
        self.clock = clock
        self.resumed = False
        self.events_published = 0
        self.state_write_errors = 0
        self._state_failing = 0  # failed snapshots since the last one written
        self._state_cause = ""  # why the last one failed (a new cause is logged at once)
        self.consumer_lag = 0  # records behind the end of the topic, refreshed about once a second
        self._lock = threading.Lock()  # guards the pipeline against view() from the scrape thread
        self._last_snapshot = clock()
        self._last_lag = -1e9
        if resumed is not None:  # the caller loaded the state already (before connecting to the bus)
            self.resumed = resumed
        elif self.state_path is not None:
            try:
                origin, taken = resume_state(self.pipeline, self.state_path, changelog)
            except Exception:
                self.source.close()  # the caller never gets the service: release the consumer here
                raise
            self.resumed = origin is not None
            if taken is not None and taken.schemas:
                self.schemas.restore(taken.schemas)
            if self.resumed:
                log.info("resumed detection state from %s", self.state_path if origin == "file" else changelog.topic)
        if self.pipeline.stage != "temporal":  # the runs watched keep their layouts
            self.schemas.holds = self.pipeline.holds
        auth = source.ingest.auth  # the runs' key bindings (None without keys)
        if auth is not None:  # signed runs come first for a place (docs/service.md, "Run lifecycle")
            self.pipeline.signed = lambda run: auth.bindings.kid_of(run) is not None
            self.pipeline.backlog.key_of = auth.bindings.kid_of  # a key's runs share one share of a pass
        if auth is not None and self.resumed:
            auth.bindings.restore(self.pipeline.carried.get("auth_bindings") or {})
            auth.starts.restore(self.pipeline.carried.get("auth_starts"))  # messages taken: a replay refused
        self.journal = None
        if self.state_path is not None:
            self._load_schemas()
            mirror = self.changelog.write_journal if self.changelog is not None else None
            self.journal = AnnouncementJournal(self.state_path.with_name(JOURNAL_FILE), mirror=mirror)
            if taken is not None and taken.journal:  # the state came from the topic: so does the journal
                self.journal.adopt(taken.journal)

    def step(self) -> list[IncidentEvent]:
        """One iteration: poll, detect, close late steps, publish; snapshot when it is time."""
        waiting = self.pipeline.backlog  # records past their run's share of a pass
        if waiting.ready and waiting.key_of is not None:  # runs wait for their share: the bus is read first
            self.source.catch_up(READ_FIRST_S)
        items = self.source.poll(0.0 if waiting.ready else self.poll_timeout)
        backlog = self._backlog()
        process = self.pipeline.process_summaries if self.pipeline.stage == "temporal" else self.pipeline.process
        if self.pipeline.stage != "temporal":  # each run's share of this pass; a flood's excess waits
            with self._lock:
                items = self.pipeline.share(items)
        events: list[IncidentEvent] = []
        auth = getattr(self.source.ingest, "auth", None)
        for run in auth.take_rebound() if auth is not None else ():  # bound to a key: its unsigned past goes
            with self._lock:
                events += self.pipeline.evict(run, "bound to a key: what it sent unsigned is discarded")
        for part in _slices(items, SLICE_RECORDS):  # a scrape waits for one slice, never a whole poll
            with self._lock:
                self.pipeline.aligner.backlog = backlog
                events += process(part)
        with self._lock:
            events += self.pipeline.tick()
            events += self.pipeline.expire()
            rejected = self.pipeline.aligner.take_rejected()
            summaries = self.pipeline.take_summaries()
            marks = self.pipeline.take_marks()
        for reason, why, records in rejected:  # records the aligner refused: dead-lettered, counted
            log.warning("dead-lettering %d record(s): %s", len(records), why)
            try:
                self.source.dead_letter(records, reason, why)
            except Exception:
                log.exception("could not dead-letter %d record(s)", len(records))
        if summaries:
            self.summary_sink.publish(summaries)
        self._publish(events)
        self._publish_marks(marks)
        if self.clock() - self._last_lag >= 1.0:
            self._refresh_lag()
        if self.state_path is not None and self.clock() - self._last_snapshot >= self.snapshot_every:
            self.snapshot()
        return events

    def _publish(self, events: list[IncidentEvent]) -> None:
        """Hand each incident change to every sink, once: a change the journal says was announced
        (before a kill, re-found in the records re-read since the snapshot) is not repeated."""
        journal = self.journal
        if journal is not None:
            events = [ev for ev in events if not journal.said(ev)]
        for ev in events:
            for sink in self.sinks:
                try:
                    sink.publish(ev)
                except Exception:  # the protocol says publish never raises; be sure anyway
                    log.exception("sink %r failed", sink)
            self.events_published += 1
        if journal is not None and events:
            for sink in self.sinks:  # on the bus before the journal says it was announced
                confirm = getattr(sink, "confirm", None)
                if confirm is not None:
                    try:
                        confirm()
                    except Exception:
                        log.exception("sink %r: confirming delivery failed", sink)
            for ev in events:
                journal.note(ev)

    def _publish_marks(self, marks: list) -> None:
        """Each checkpoint marking to the sinks that take markings (``publish_mark``: the anomalies topic)."""
        markers = [sink.publish_mark for sink in self.sinks if hasattr(sink, "publish_mark")]
        for mark in marks:
            bad = mark.mark != "clean" or mark.was is not None
            (log.warning if bad else log.info)(
                "checkpoint of run %s at step %d (%s): %s; %s", mark.run, mark.step, mark.path, mark.mark, mark.reason
            )
            for publish_mark in markers:
                publish_mark(mark)

    def snapshot(self) -> None:
        """Write the state, then commit the source (never the other way round)."""
        if self.state_path is None:
            return
        with self._lock:  # the state is copied under the lock, written without it (scrapes go on)
            auth = self.source.ingest.auth
            if auth is not None:  # a restart keeps which key speaks for which run
                self.pipeline.carried["auth_bindings"] = auth.bindings.snapshot()
                self.pipeline.carried["auth_starts"] = auth.starts.snapshot()
            clears_through = apply_clears(self.pipeline, self.state_path.parent)  # kept in the state
            wall = self.pipeline.wall()
            self.pipeline.hosts.review(wall)  # the verdicts as of now, saved and written alike
            state = json_safe(self.pipeline.snapshot())
            verdicts = self.pipeline.hosts.verdicts(wall)
            hosts = {h: self.pipeline.hosts.host_state(h) for h in self.pipeline.hosts.take_changed()}
        failed = None  # detection goes on; the offsets stay uncommitted, the next snapshot retries
        # the topic first (a file as new as the topic's snapshot is the one to resume from); never by a
        # member that holds only part of the telemetry (sharing its group): the key is the group's
        if self.changelog is not None and self.source.owns_topic:
            try:
                self.changelog.write(state, self._schema_texts(), self.source.positions())  # what is committed next
                self.changelog.write_hosts(hosts)  # keyed by host: an instance of any group adopts them
            except TransportError as exc:
                failed = (exc, f"topic {self.changelog.topic}")
        try:
            self.pipeline.save(self.state_path, state)
            self._save_schemas()
        except OSError as exc:
            failed = failed or (exc, str(self.state_path))
        if failed:
            self._state_not_saved(*failed)
            return
        try:  # what a scheduler reads: after the state that holds the clears applied
            write_host_files(self.state_path.parent, verdicts, wall=wall, clears_through=clears_through)
        except OSError as exc:
            log.warning("host files not written to %s: %s", self.state_path.parent, exc)
        if self.state_write_errors and self._state_failing:
            log.warning("state written to %s again after %d failed snapshot(s)", self.state_path, self._state_failing)
        self._state_failing = 0
        if self.journal is not None:  # the state written holds every incident announced so far
            self.journal.snapshot_written()
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

    def _state_not_saved(self, exc: Exception, where: str | None = None) -> None:
        """A snapshot that could not be written to ``where`` (the file or the state topic): counted,
        logged at the first failure of a streak, every tenth after and whenever the cause changes,
        retried at the next snapshot; the source stays uncommitted."""
        self.state_write_errors += 1
        self._state_failing += 1
        cause = str(getattr(exc, "strerror", None) or exc)
        if self._state_failing == 1 or self._state_failing % 10 == 0 or cause != self._state_cause:
            log.error(
                "state not written to %s (%s; %d snapshot(s) in a row): detection goes on, offsets stay "
                "uncommitted, the next snapshot retries in %.0f s",
                where or self.state_path,
                cause,
                self._state_failing,
                self.snapshot_every,
            )
        self._state_cause = cause
        self._last_snapshot = self.clock()

    def _schema_texts(self) -> dict | None:
        """The wire-v2 layouts the source learnt (what the state topic carries with the state), or None."""
        return self.schemas.snapshot() if len(self.schemas) else None

    def _save_schemas(self) -> None:
        """The wire-v2 layouts the source learnt, beside the state: after a restart, records re-read
        from the middle of a window decode without waiting for their schema to come round again."""
        texts = self._schema_texts()
        if texts is not None:
            write_state(self.state_path.with_name(SCHEMAS_FILE), texts)

    def _load_schemas(self) -> None:
        path = self.state_path.with_name(SCHEMAS_FILE)
        try:
            texts = read_state(path)
            if texts is not None:
                self.schemas.restore(texts)
        except (ValueError, RecordError) as exc:  # a damaged file costs a wait for the schemas
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
            view = self.pipeline.view(
                consumer_lag=self.consumer_lag,
                state_write_errors_total=self.state_write_errors,
                state_topic_refused=dict(self.changelog.refused) if self.changelog is not None else {},
                max_runs=max_runs,
                **self.source.health(),
            )
            view.hosts = self.pipeline.hosts.verdicts(self.pipeline.wall())
            return view

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
            if self.journal is not None:
                self.journal.close()
            if self.changelog is not None:
                self.changelog.close()
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
