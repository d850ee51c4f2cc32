"""``sdcwatch capture``: one run's telemetry from the bus into the JSON lines ``replay`` and ``report`` read.

It reads the telemetry topic without a consumer group (it commits nothing and takes no partitions
from the detector service) but with the service's re-fetch of offset gaps, keeps the records of one
run, and writes each as one line of strict JSON, the end-of-run markers included. It stops when
every rank of the run has sent its marker, after ``--idle-timeout`` seconds at the end of the topic
without a record of the run, or on Ctrl-C / SIGTERM; what was written until then is a complete
file. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sdcwatch.core.errors import ConfigError, TransportError
from sdcwatch.core.layer_names import LayerNames, names_to_json
from sdcwatch.core.record_json import to_json
from sdcwatch.core.record_type import Record
from sdcwatch.service.ingest import IngestDecoder, as_records
from sdcwatch.service.kafka_source import TopicReader
from sdcwatch.telemetry.wire.end_marker import is_end_marker

if TYPE_CHECKING:
    from sdcwatch.config import BusConfig

__all__ = ["Capture", "open_reader", "capture", "build_parser", "add_bus_arguments", "capture_main"]


@dataclass
class Capture:
    """Folds bus messages into one run's JSON lines and knows when the run is over."""

    run: str
    out: TextIO
    records: int = 0  # records of the run written (markers included)
    skipped: int = 0  # messages that did not decode (the service dead-letters them)
    other: int = 0  # records of other runs, passed over
    first_step: int | None = None
    last_step: int | None = None
    world: int = 0
    ranks: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # ranks whose end-of-run marker was written
    end_world: int = 0
    decoder: IngestDecoder = field(default_factory=IngestDecoder)  # remembers the v2 layouts seen

    def take(self, values: Iterable[bytes | None]) -> int:
        """Decode and write the run's records among ``values`` (either wire: a v2 message's layout
        arrives ahead of it in its partition); returns how many were written."""
        items, rejected = self.decoder.decode(("capture", None, value) for value in values)
        self.skipped += len(rejected)
        # the run's layer names go along, so a replay of the file names the modules too
        lines = [names_to_json(x) for x in items if isinstance(x, LayerNames) and x.run == self.run]
        named = len(lines)
        for rec in as_records(items):
            if rec.run != self.run:
                self.other += 1
                continue
            lines.append(to_json(rec))
            self._note(rec)
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()
        self.records += len(lines) - named
        return len(lines) - named

    def _note(self, rec: Record) -> None:
        if is_end_marker(rec):
            if rec.world != self.end_world:
                self.end_world, self.ended = rec.world, set()
            self.ended.add(rec.rank)
            return
        self.first_step = rec.step if self.first_step is None else min(self.first_step, rec.step)
        self.last_step = rec.step if self.last_step is None else max(self.last_step, rec.step)
        self.world = max(self.world, rec.world)
        self.ranks.add(rec.rank)

    @property
    def finished(self) -> bool:
        """Every rank of the run's world sent its end-of-run marker."""
        return self.end_world > 0 and len(self.ended) >= self.end_world

    def describe(self) -> str:
        steps = "no steps yet" if self.first_step is None else f"steps {self.first_step}-{self.last_step}"
        ended = f", {len(self.ended)}/{self.end_world} ranks ended" if self.ended else ""
        return f"{self.records} records of run {self.run!r} ({steps}, {len(self.ranks)} of {self.world} ranks{ended})"


def open_reader(
    bus: BusConfig, topic: str, *, from_beginning: bool, connect_timeout: float, consumer: Any = None
) -> TopicReader:
    """``topic`` on ``bus``'s broker, read as the service reads it: every partition, offset gaps
    re-fetched (:class:`~sdcwatch.service.kafka_source.TopicReader`). A broker that does not answer
    is a :class:`TransportError` that says where its address came from."""
    try:
        return TopicReader(
            bus.bootstrap,
            topic,
            from_beginning=from_beginning,
            connect_timeout=connect_timeout,
            consumer=consumer,
            **bus.security,
        )
    except TransportError as exc:
        raise TransportError(
            f"{exc}; check --bus-bootstrap / SDCWATCH_BOOTSTRAP and that the broker is running"
        ) from None


def capture(
    reader: Any,
    cap: Capture,
    *,
    idle_timeout: float,
    stop: threading.Event,
    progress: Callable[[str], None] = lambda s: None,
    progress_every: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Read until the run ends, ``idle_timeout`` passes at the end of the topic without a record
    of the run (0: never), or ``stop`` is set. Returns why it stopped.

    The run's records are keyed by window, so they lie in several partitions: the last rank's
    end-of-run marker can be read before an earlier window's records in another partition. The
    run has ended once every rank's marker is read *and* every partition has been read up to
    where the topic ended when the last marker was seen (each rank sends its marker after
    everything it emitted was confirmed, so all of the run lies before that point)."""
    last_record = last_progress = clock()
    end_mark = None
    while True:
        if stop.is_set():
            return "interrupted"
        if cap.take(reader.poll(0.5)):
            last_record = clock()
        if cap.finished:
            if end_mark is None:
                end_mark = reader.end_mark()
            if reader.past(end_mark):
                return "the run ended (every rank sent its end-of-run marker)"
        now = clock()
        if idle_timeout and now - last_record >= idle_timeout:
            if reader.at_end():
                return f"no record of the run for {idle_timeout:g} s"
            last_record = now - idle_timeout / 2  # still reading a backlog of other runs: look again soon
        if now - last_progress >= progress_every:
            last_progress = now
            progress(cap.describe())


def build_parser() -> argparse.ArgumentParser:
    """Declare ``sdcwatch capture``'s options."""
    parser = argparse.ArgumentParser(
        prog="sdcwatch capture",
        description="Write one run's telemetry from the bus as JSON lines, for 'sdcwatch replay' and "
        "'sdcwatch report'. The broker and topic come from flags, the environment "
        "(SDCWATCH_BOOTSTRAP, SDCWATCH_BUS_*) or the serve configuration file, as for "
        "'sdcwatch serve'. Stops when every rank sent its end-of-run marker, after "
        "--idle-timeout, or on Ctrl-C.",
    )
    parser.add_argument("--run", required=True, help="the run to capture (the emitters' SDCWATCH_RUN)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="JSON-lines file to write")
    parser.add_argument(
        "--from-beginning",
        action="store_true",
        help="read the topic from its first record (default: only records sent from now on)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="stop after this long without a record of the run, once the topic is read to "
        "its end; 0 waits for the end marker or Ctrl-C (default %(default)s)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    add_bus_arguments(parser, "telemetry")
    return parser


def add_bus_arguments(parser: argparse.ArgumentParser, topic: str) -> None:
    """The options of a command that reads one topic (``topic``: its key in ``[bus]``, ``telemetry``
    or ``anomalies``): the broker, the topic, the serve configuration, how long to wait."""
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the broker to answer (default %(default)s)",
    )
    parser.add_argument(
        "--bus-bootstrap",
        "--bootstrap",
        dest="bootstrap",
        metavar="HOST:PORT",
        help="Kafka bootstrap servers [SDCWATCH_BOOTSTRAP; default: the serve configuration's]",
    )
    parser.add_argument(
        f"--bus-{topic}-topic",
        "--topic",
        dest="topic",
        metavar="TOPIC",
        help=f"{topic} topic [SDCWATCH_BUS_{topic.upper()}_TOPIC; default sdcwatch.{topic}]",
    )
    parser.add_argument("--config", metavar="PATH", help="serve configuration file (TOML) for the bus settings")


def _output_path(args: argparse.Namespace) -> Path:
    """The file to write, once the timeouts are checked; an existing one only with ``--force``."""
    if args.idle_timeout < 0:
        raise ConfigError("--idle-timeout", f"must be >= 0 seconds, got {args.idle_timeout:g}")
    if args.connect_timeout <= 0:
        raise ConfigError("--connect-timeout", f"must be > 0 seconds, got {args.connect_timeout:g}")
    out_path = Path(args.output)
    if out_path.exists() and not args.force:
        raise ConfigError("--output", f"{out_path} exists; pass --force to overwrite it")
    return out_path


def _stop_on_signals() -> threading.Event:
    """An event set on SIGTERM or Ctrl-C: the capture stops there, its file complete."""
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def _say(text: str) -> None:
    print(f"sdcwatch capture: {text}", file=sys.stderr, flush=True)


def _capture_into(
    reader: TopicReader, args: argparse.Namespace, out_path: Path, stop: threading.Event
) -> tuple[Capture, str]:
    """Write the run's records from ``reader`` into ``out_path``; returns the capture and why it stopped."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fh = open(out_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise ConfigError("--output", f"cannot write {out_path}: {exc.strerror or exc}") from None
    with fh:
        cap = Capture(args.run, fh)
        start = "the beginning" if args.from_beginning else "now on"
        if not reader.assign():
            _say(f"topic {reader.topic} does not exist on {reader.bootstrap} yet: waiting for it")
        _say(
            f"reading {reader.topic} on {reader.bootstrap} from {start} for run {args.run!r} "
            f"into {out_path} (Ctrl-C to stop)"
        )
        why = capture(reader, cap, idle_timeout=args.idle_timeout, stop=stop, progress=_say)
    return cap, why


def capture_main(argv: Sequence[str]) -> int:
    """``sdcwatch capture --run NAME -o FILE``; returns the exit code (0 done, 2 bad input)."""
    from sdcwatch.config import load_config

    args = build_parser().parse_args(argv)
    out_path = _output_path(args)
    cfg = load_config(args.config, overrides={"bus.bootstrap": args.bootstrap, "bus.telemetry_topic": args.topic})
    bus = cfg.bus
    stop = _stop_on_signals()
    reader = open_reader(
        bus, bus.telemetry_topic, from_beginning=args.from_beginning, connect_timeout=args.connect_timeout
    )
    try:
        cap, why = _capture_into(reader, args, out_path, stop)
    finally:
        reader.close()
    skipped = f"; {cap.skipped} undecodable messages skipped" if cap.skipped else ""
    _say(f"wrote {cap.describe()} to {out_path}; stopped: {why}{skipped}")
    if cap.records == 0:
        _say(
            f"no record of run {args.run!r} was seen"
            + ("" if args.from_beginning else " (records sent before the capture started need --from-beginning)")
        )
    return 0
