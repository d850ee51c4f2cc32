"""``sdcwatch incidents``: the incidents the detector service published on the anomalies topic,
folded into the latest state of each, one line each or JSON; with ``--follow`` every change as it
arrives. Reads the topic as :mod:`sdcwatch.bus_reading` does; needs only the base install.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from sdcwatch.bus_reading import (
    Refusals,
    anomaly_opener,
    add_bus_arguments,
    bus_settings,
    open_reader,
    read_to_end,
    stop_on_signals,
)
from sdcwatch.core.errors import ConfigError, RecordError
from sdcwatch.core.incident import Incident
from sdcwatch.core.jsonsafe import json_safe
from sdcwatch.core.messages import decode_object
from sdcwatch.core.validate import duration_seconds
from sdcwatch.service.kafka_source import TopicReader

__all__ = [
    "Since",
    "parse_since",
    "IncidentBoard",
    "status_of",
    "incident_line",
    "build_parser",
    "incidents_main",
]

_MAX_LISTED = 8  # ranks or hosts written out on a line; the rest counted


@dataclass(frozen=True)
class Since:
    """Where ``--since`` starts: a step of the run, or a wall-clock time (seconds since the epoch)."""

    step: int | None = None
    time: float | None = None

    def keeps(self, event: dict[str, Any], changed_at: float) -> bool:
        """Whether the incident was active at or after this point: still open, or (for a step) its
        last or resolved step is there or later, or (for a time) its last change was published then
        or later."""
        if event.get("open", True):
            return True
        if self.step is not None:
            last = max(int(event.get("last_step") or 0), int(event.get("resolved_step") or 0))
            return last >= self.step
        return self.time is None or changed_at >= self.time


def parse_since(text: str, now: float) -> Since:
    """``--since``: a step number (``300``) or a duration back from ``now`` (``90s``, ``10m``, ``2h``,
    ``1d``); anything else is a :class:`ConfigError` naming the option.

    >>> parse_since("300", now=0.0)
    Since(step=300, time=None)
    >>> parse_since("10m", now=1000.0)
    Since(step=None, time=400.0)
    """
    text = text.strip()
    if text.isdigit():
        return Since(step=int(text))
    seconds = duration_seconds(text)
    if seconds is None:
        raise ConfigError("--since", f"{text!r} is neither a step (300) nor a duration (90s, 10m, 2h, 1d)")
    return Since(time=now - seconds)


class IncidentBoard:
    """The latest state of each incident on the anomalies topic, and which of them a reader asked for.

    >>> board = IncidentBoard(run="a")
    >>> seen = b'"kind": "nonfinite", "severity": "critical", "first_step": 3, "message": "NaN"'
    >>> board.take(b'{"change": "opened", "id": "a:nonfinite:3", "run": "a", ' + seen + b'}', 0)["id"]
    'a:nonfinite:3'
    >>> board.take(b'{"change": "opened", "id": "b:nonfinite:9", "run": "b", ' + seen + b'}', 0) is None
    True
    >>> [e["change"] for e in board.incidents()], board.unreadable
    (['opened'], 0)
    """

    def __init__(self, run: str | None = None, since: Since | None = None) -> None:
        self.run = run
        self.since = since
        self.unreadable = 0  # messages that are not an incident change (nor a checkpoint's marking)
        self._latest: dict[str, dict[str, Any]] = {}
        self._changed_at: dict[str, float] = {}

    def take(self, value: bytes | None, timestamp_ms: int | None) -> dict[str, Any] | None:
        """Fold one message of the topic in; the incident's new state when the reader asked for it."""
        try:  # anyone who can write to the topic can write anything: count it
            event = json.loads(value) if value is not None else None
            if not isinstance(decode_object(event), Incident):
                return None  # a checkpoint's marking (sdcwatch checkpoints)
        except (ValueError, RecordError):
            self.unreadable += 1
            return None
        if not isinstance(event.get("id"), str):
            self.unreadable += 1
            return None
        wall = float(event.get("resolved_at") or event.get("opened_at") or 0.0)  # when the message has no timestamp
        changed_at = timestamp_ms / 1000 if timestamp_ms and timestamp_ms > 0 else wall
        self._latest[event["id"]] = event
        self._changed_at[event["id"]] = changed_at
        return event if self._shows(event, changed_at) else None

    def _shows(self, event: dict[str, Any], changed_at: float) -> bool:
        if self.run is not None and event.get("run") != self.run:
            return False
        return self.since is None or self.since.keeps(event, changed_at)

    def incidents(self) -> list[dict[str, Any]]:
        """The latest state of each incident asked for, in the order they were opened."""
        shown = [e for i, e in self._latest.items() if self._shows(e, self._changed_at[i])]
        return sorted(shown, key=lambda e: (e.get("opened_at") or 0.0, e.get("first_step") or 0, e["id"]))


def status_of(event: dict[str, Any]) -> str:
    """``open`` or ``resolved``: the service's last word on the incident."""
    return "open" if event.get("open", event.get("change") != "resolved") else "resolved"


def _listed(values: Sequence[Any]) -> str:
    shown = ",".join(str(v) for v in values[:_MAX_LISTED])
    return shown + (f",+{len(values) - _MAX_LISTED}" if len(values) > _MAX_LISTED else "")


def incident_line(event: dict[str, Any], status: str) -> str:
    """One incident on one line: status, severity, kind, run, steps, ranks, hosts, where, id, message,
    and the opening finding's message when a later one changed it.

    >>> incident_line({"id": "r:nonfinite:30", "run": "r", "kind": "nonfinite", "severity": "critical",
    ...                "first_step": 30, "last_step": 31, "ranks": [2], "hosts": ["h2"], "metric": "stream_max",
    ...                "layer": 0, "layer_name": "blocks.0", "message": "NaN on rank 2"}, "open")
    'open      critical  nonfinite  run=r  steps=30-31  ranks=2  hosts=h2  metric=stream_max  layer=0:blocks.0  id=r:nonfinite:30  NaN on rank 2'
    """
    first, last = event.get("first_step"), event.get("last_step")
    fields = [f"{status:<9} {event.get('severity', ''):<8}", str(event.get("kind", "")), f"run={event.get('run')}"]
    fields.append(f"step={first}" if last in (None, first) else f"steps={first}-{last}")
    if event.get("ranks"):
        fields.append(f"ranks={_listed(event['ranks'])}")
    if event.get("hosts"):
        fields.append(f"hosts={_listed(event['hosts'])}")
    if event.get("metric"):
        fields.append(f"metric={event['metric']}")
    layer, name = event.get("layer"), event.get("layer_name")
    if layer is not None or name:
        fields.append("layer=" + ":".join(str(x) for x in (layer, name) if x is not None and x != ""))
    fields.append(f"id={event['id']}")
    onset = event.get("onset")
    began = onset.get("message") if isinstance(onset, dict) else None
    if began and began != event.get("message"):  # what opened it, when later findings changed the message
        return "  ".join([*fields, f"{event.get('message', '')}  (onset: {began})"]).rstrip()
    return "  ".join([*fields, str(event.get("message", ""))]).rstrip()


def build_parser() -> argparse.ArgumentParser:
    """Declare ``sdcwatch incidents``' options."""
    parser = argparse.ArgumentParser(
        prog="sdcwatch incidents",
        description="Show the incidents the detector service published on the anomalies topic: the latest "
        "state of each (open or resolved), one line each or --json. The broker and topic come from flags, "
        "the environment (SDCWATCH_BOOTSTRAP, SDCWATCH_BUS_*) or the serve configuration file, as for "
        "'sdcwatch serve'. Exits 0 (also with no incidents), 2 on bad input, 130 on Ctrl-C.",
    )
    parser.add_argument("--run", help="only this run's incidents (the emitters' SDCWATCH_RUN)")
    parser.add_argument(
        "--since",
        metavar="STEP|DURATION",
        help="only incidents active since a step (300: still open, or their last step is 300 or later) "
        "or a time ago (10m, 2h, 1d: still open, or changed since)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object a line: the incident as the service sent it (its latest evidence, and "
        '"onset": the step, ranks, place, message and evidence of the finding that opened it)',
    )
    parser.add_argument(
        "-f", "--follow", action="store_true", help="then keep reading and print each change as it arrives"
    )
    add_bus_arguments(parser, "anomalies")
    return parser


def _show(event: dict[str, Any], status: str, as_json: bool) -> None:
    """One incident on stdout, as a line or a JSON object, flushed at once (a pipe sees each)."""
    if as_json:
        text = json.dumps(json_safe({**event, "status": status_of(event)}), allow_nan=False)
    else:
        text = incident_line(event, status)
    print(text, flush=True)


def _say(text: str) -> None:
    print(f"sdcwatch incidents: {text}", file=sys.stderr, flush=True)


def _follow(reader: TopicReader, take: Any, as_json: bool, stop: threading.Event) -> None:
    """Print each change (opened, updated, resolved) the reader asked for, as it arrives, until ``stop``."""
    while not stop.is_set():
        for msg in reader.poll_messages(0.5):
            event = take(msg)
            if event is not None:
                _show(event, str(event.get("change", status_of(event))), as_json)


def incidents_main(argv: Sequence[str]) -> int:
    """``sdcwatch incidents [--run R] [--since S] [--json] [--follow]``; the exit code (0 shown,
    2 bad input, 130 Ctrl-C)."""
    args = build_parser().parse_args(argv)
    since = parse_since(args.since, time.time()) if args.since is not None else None
    bus, keyring = bus_settings(args, "anomalies_topic")
    stop, signals = stop_on_signals()
    board = IncidentBoard(args.run, since)
    refused = Refusals()
    open_anomaly = anomaly_opener(keyring)

    def take(msg: Any) -> dict[str, Any] | None:
        try:
            return board.take(open_anomaly(msg.value), msg.timestamp)
        except RecordError as exc:  # not signed by the service (with keys), or does not verify
            refused.refused(exc)
            return None

    reader = open_reader(bus, bus.anomalies_topic, from_beginning=True)
    try:
        exists = read_to_end(reader, take, stop)
        shown = [] if stop.is_set() else board.incidents()  # interrupted: no half-read listing
        for event in shown:
            _show(event, status_of(event), args.json)
        if not shown and not stop.is_set():
            which = "".join([f" of run {args.run!r}" if args.run else "", f" since {args.since}" if args.since else ""])
            nothing = f"no incidents{which}" + ("" if exists else f" (topic {bus.anomalies_topic} does not exist yet)")
            if args.json:  # stdout stays JSON lines
                _say(nothing)
            else:
                print(nothing, flush=True)
        if board.unreadable:
            _say(f"{board.unreadable} messages on {bus.anomalies_topic} are not incident changes; skipped")
        if refused:
            _say(f"{len(refused)} messages on {bus.anomalies_topic} refused: {refused.describe()}")
        if args.follow and not stop.is_set():
            _say(f"following {bus.anomalies_topic} on {bus.bootstrap} (Ctrl-C to stop)")
            _follow(reader, take, args.json, stop)
    finally:
        reader.close()
    return 128 + signals[0] if signals else 0


if __name__ == "__main__":  # ``python -m sdcwatch.incidents``: as ``sdcwatch incidents`` runs
    from sdcwatch.cli import main

    raise SystemExit(main(["incidents", *sys.argv[1:]]))
