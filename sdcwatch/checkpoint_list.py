"""``sdcwatch checkpoints``: a run's checkpoints as the detector service marked them (``clean``,
``suspect``, ``after-fault``, :mod:`sdcwatch.service.checkpoint_marks`), oldest first, and the
newest clean one. Reads the anomalies topic as :mod:`sdcwatch.bus_reading` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence, TextIO

from sdcwatch.bus_reading import (
    Refusals,
    anomaly_opener,
    add_bus_arguments,
    bus_settings,
    open_reader,
    read_to_end,
    stop_on_signals,
)
from sdcwatch.core.errors import RecordError
from sdcwatch.core.jsonsafe import json_safe
from sdcwatch.core.messages import decode_object
from sdcwatch.core.rank_notes import CheckpointMark

__all__ = ["CheckpointList", "checkpoint_line", "build_parser", "checkpoints_main"]


class CheckpointList:
    """The latest marking of each checkpoint of one run, folded from the anomalies topic.

    >>> board = CheckpointList("r")
    >>> board.take(b'{"change": "checkpoint", "run": "r", "step": 40, "path": "c-40", "mark": "clean"}')
    True
    >>> board.take(b'{"change": "opened", "id": "r:nonfinite:50", "run": "r"}')
    False
    >>> board.newest_clean()["step"]
    40
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self._latest: dict[int, dict[str, Any]] = {}
        self.unreadable = 0  # checkpoint messages of the wrong shape (anyone can write to the topic)

    def take(self, value: bytes | None) -> bool:
        """Fold one message in; True when it was a marking of this run's checkpoints."""
        try:
            event = json.loads(value) if value is not None else None
        except ValueError:
            return False
        if not isinstance(event, dict) or event.get("change") != "checkpoint" or event.get("run") != self.run:
            return False
        try:
            mark: CheckpointMark = decode_object(event)  # a "checkpoint" change is a marking or a RecordError
        except RecordError:
            self.unreadable += 1
            return False
        self._latest[mark.step] = event
        return True

    def listing(self) -> list[dict[str, Any]]:
        """Each checkpoint's latest marking, oldest first."""
        return [self._latest[s] for s in sorted(self._latest)]

    def newest_clean(self) -> dict[str, Any] | None:
        """The newest checkpoint marked clean (None: there is none)."""
        return next((e for e in reversed(self.listing()) if e["mark"] == "clean"), None)


def checkpoint_line(event: dict[str, Any]) -> str:
    """One checkpoint on one line: step, marking, path, and the incidents behind the marking.

    >>> checkpoint_line({"step": 60, "mark": "suspect", "path": "out/c-60", "incidents": ["r:silent_drift:50"]})
    'step 60      suspect      out/c-60  (incidents: r:silent_drift:50)'
    """
    path = str(event.get("path") or "(no path)")
    ids = [str(i) for i in event.get("incidents") or [] if isinstance(i, str)]
    why = f"  (incidents: {', '.join(ids[:8])}{', ...' if len(ids) > 8 else ''})" if ids else ""
    evidence = event.get("evidence") if isinstance(event.get("evidence"), list) else []
    kept = [e for e in evidence if isinstance(e, dict) and e.get("effect") == "none"]
    if kept:  # faults that did not count: say why
        why += "  (not counted: " + "; ".join(f"{e.get('incident')}: {e.get('why')}" for e in kept[:4]) + ")"
    return f"step {event['step']:<7} {event['mark']:<12} {path}{why}"


def build_parser() -> argparse.ArgumentParser:
    """Declare ``sdcwatch checkpoints``' options."""
    parser = argparse.ArgumentParser(
        prog="sdcwatch checkpoints",
        description="List a run's checkpoints as the detector service marked them, oldest first: clean "
        "(no incident of a fault began before it), suspect (a silent drift or a canary-only replica divergence "
        "began at or before its step and had not cleared), or after-fault (a non-finite value, checksum "
        "mismatch, SDC suspected or parameter divergence began at or before its step and had not resolved; "
        "not when the job's guard skipped, reran clean or rolled back the fault, or a finite flip's effect "
        "stayed within the checks' bounds: the listing says so), "
        "then name the newest clean one: the checkpoint to resume from. A checkpoint is marked once the "
        "service has judged its step, and marked again when an incident found later began before it. Jobs "
        "report checkpoints with Emitter.checkpoint(step, path), Watch.checkpoint or the Hugging Face and "
        "Lightning callbacks. The broker and topic come from flags, the environment (SDCWATCH_BOOTSTRAP, "
        "SDCWATCH_BUS_*) or the serve configuration file (SASL too), as for 'sdcwatch incidents'. Exits 0 "
        "(also with no checkpoints), 2 on bad input, 130 on Ctrl-C.",
    )
    parser.add_argument("--run", required=True, help="the run (the emitters' SDCWATCH_RUN)")
    parser.add_argument(
        "--json",
        action="store_true",
        help='one JSON object: {"run", "checkpoints": [each marking as the service sent it, with '
        '"evidence": the incidents it rests on and the effect each had], "newest_clean": the newest clean one or null}',
    )
    add_bus_arguments(parser, "anomalies")
    return parser


def _show(board: CheckpointList, as_json: bool, exists: bool, topic: str, out: TextIO) -> None:
    listing, newest = board.listing(), board.newest_clean()
    if as_json:
        body = {"run": board.run, "checkpoints": listing, "newest_clean": newest}
        print(json.dumps(json_safe(body), allow_nan=False), file=out, flush=True)
        return
    if not listing:
        print(f"no checkpoints of run {board.run!r}" + ("" if exists else f" (topic {topic} does not exist yet)"))
        return
    for event in listing:
        print(checkpoint_line(event), file=out)
    if newest is None:
        print("newest clean: none (every checkpoint is suspect or after a fault)", file=out, flush=True)
    else:
        print(f"newest clean: step {newest['step']} {newest.get('path') or ''}".rstrip(), file=out, flush=True)


def checkpoints_main(argv: Sequence[str]) -> int:
    """``sdcwatch checkpoints --run R [--json]``; the exit code (0 shown, 2 bad input, 130 Ctrl-C)."""
    args = build_parser().parse_args(argv)
    bus, keyring = bus_settings(args, "anomalies_topic")
    stop, signals = stop_on_signals()
    board = CheckpointList(args.run)
    refused = Refusals()
    open_anomaly = anomaly_opener(keyring)

    def take(msg: Any) -> None:
        try:
            board.take(open_anomaly(msg.value))
        except RecordError as exc:  # not signed by the service (with keys), or does not verify
            refused.refused(exc)

    reader = open_reader(bus, bus.anomalies_topic, from_beginning=True)
    try:
        exists = read_to_end(reader, take, stop)
        if not stop.is_set():
            _show(board, args.json, exists, bus.anomalies_topic, sys.stdout)
        if board.unreadable:
            print(f"sdcwatch checkpoints: {board.unreadable} checkpoint messages unreadable; skipped", file=sys.stderr)
        if refused:
            print(f"sdcwatch checkpoints: {len(refused)} messages refused: {refused.describe()}", file=sys.stderr)
    finally:
        reader.close()
    return 128 + signals[0] if signals else 0
