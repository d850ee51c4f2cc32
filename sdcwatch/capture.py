"""``sdcwatch capture``: one run's telemetry from the bus into the JSON lines ``replay`` and ``report``
read, in the order the ranks made them, signed runs verified with the service's keys.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from sdcwatch.bus_reading import Refusals, add_bus_arguments, bus_settings, open_reader, stop_on_signals
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.messages import encode_line, is_end_marker
from sdcwatch.core.record_type import Record
from sdcwatch.core.signing import Keyring
from sdcwatch.core.validate import check_number
from sdcwatch.service.auth import Authenticator
from sdcwatch.service.ingest import IngestDecoder, RecordColumns
from sdcwatch.service.kafka_source import TopicReader

__all__ = ["Capture", "capture", "build_parser", "capture_main"]


@dataclass
class Capture:
    """Folds bus messages into one run's JSON lines and knows when the run is over."""

    run: str
    out: TextIO
    keyring: Keyring | None = None  # verifies signed messages (unsigned ones are read too)
    records: int = 0  # records of the run written (markers included)
    refused: Refusals = field(default_factory=Refusals)  # messages that did not decode or verify, by why
    other: int = 0  # records of other runs, passed over
    first_step: int | None = None
    last_step: int | None = None
    world: int = 0
    ranks: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # ranks whose end-of-run marker was written
    end_world: int = 0
    decoder: IngestDecoder = field(init=False)  # remembers the v2 layouts seen

    def __post_init__(self) -> None:
        auth = Authenticator(self.keyring, unsigned="accept") if self.keyring is not None else None
        self.decoder = IngestDecoder(auth=auth)

    def take(self, values: Iterable[bytes | None]) -> int:
        """Decode and write the run's messages among ``values`` (either wire: a v2 message's layout
        arrives ahead of it in its partition); returns how many records were written."""
        items = []
        for value in values:  # one at a time: the file keeps the order the ranks made them in
            got, rejected = self.decoder.decode([("capture", None, value)])
            items += got
            for rj in rejected:
                self.refused.add(rj.code, rj.reason)
        lines, written = [], 0
        for item in items:
            recs = item.to_records() if isinstance(item, RecordColumns) else [item]
            for rec in recs:
                if rec.run != self.run:
                    self.other += isinstance(rec, Record)
                    continue
                lines.append(encode_line(rec))
                if isinstance(rec, Record):
                    written += 1
                    self._note(rec)
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()
        self.records += written
        return written

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
    of the run (0: never), or ``stop`` is set; returns why it stopped. The run ends once every
    rank's marker is read *and* every partition is read up to where the topic ended when the last
    marker was seen: the markers may overtake earlier windows' records in other partitions."""
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


def _say(text: str) -> None:
    print(f"sdcwatch capture: {text}", file=sys.stderr, flush=True)


def _capture_into(
    reader: TopicReader, args: argparse.Namespace, out_path: Path, stop: threading.Event, keyring: Keyring | None
) -> tuple[Capture, str]:
    """Write the run's records from ``reader`` into ``out_path``; returns the capture and why it stopped."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fh = open(out_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise ConfigError("--output", f"cannot write {out_path}: {exc.strerror or exc}") from None
    with fh:
        cap = Capture(args.run, fh, keyring)
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
    args = build_parser().parse_args(argv)
    check_number("--idle-timeout", args.idle_timeout, lo=0)
    out_path = Path(args.output)
    if out_path.exists() and not args.force:
        raise ConfigError("--output", f"{out_path} exists; pass --force to overwrite it")
    bus, keyring = bus_settings(args, "telemetry_topic")
    stop, _ = stop_on_signals()
    reader = open_reader(bus, bus.telemetry_topic, from_beginning=args.from_beginning)
    try:
        cap, why = _capture_into(reader, args, out_path, stop, keyring)
    finally:
        reader.close()
    skipped = f"; {len(cap.refused)} messages refused: {cap.refused.describe()}" if cap.refused else ""
    _say(f"wrote {cap.describe()} to {out_path}; stopped: {why}{skipped}")
    if cap.records == 0:
        _say(
            f"no record of run {args.run!r} was seen"
            + ("" if args.from_beginning else " (records sent before the capture started need --from-beginning)")
        )
    return 0
