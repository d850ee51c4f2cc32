"""Offline replay: the same detectors over a file (JSON lines, or a CSV log with ``step`` and ``loss``
columns run as a one-rank job), for post-mortems and tuning. A malformed file raises :class:`ReplayError`
naming the line; memory is bounded by :data:`MAX_LINE_BYTES` and :data:`MAX_COLUMNS`, not by the file.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from sdcwatch.core.errors import RecordError, ReplayError
from sdcwatch.core.incident import Incident
from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.messages import Message, decode_line
from sdcwatch.core.rank_notes import CheckpointNote, LayerNames, RankDevice
from sdcwatch.core.record_type import Record
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings

__all__ = [
    "replay",
    "read_records",
    "read_csv_frames",
    "format_table",
    "replay_main",
    "bounded_lines",
    "MAX_LINE_BYTES",
    "MAX_COLUMNS",
]

#: Longest line read from a replay file (a record of 8,192 values is about 200 kB of JSON).
MAX_LINE_BYTES = 4 << 20
#: Most columns of a CSV log.
MAX_COLUMNS = 4096


_LIMITS = RecordLimits()


def bounded_lines(fh, path: Path, max_line: int = MAX_LINE_BYTES) -> Iterator[str]:
    """The lines of ``fh``, each read with a bound: a longer one is a ReplayError naming it."""
    lineno = 0
    while True:
        line = fh.readline(max_line + 1)
        if not line:
            return
        lineno += 1
        if len(line) > max_line:
            raise ReplayError(str(path), lineno, f"line longer than {max_line:,} characters (not a telemetry log?)")
        yield line


#: CSV column names understood as the record's well-known scalars.
CSV_ALIASES = {
    "grad_norm": "grad_norm_global",
    "gradnorm": "grad_norm_global",
    "grad_norm_global": "grad_norm_global",
    "train_loss": "loss",
    "train/loss": "loss",
    "learning_rate": "lr",
}
_NAME_OK = re.compile(r"[^A-Za-z0-9_.:-]")


def _is_jsonl(path: Path) -> bool:
    """JSON lines by name (a damaged first line is a bad record, not a CSV header), else by content."""
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        return True
    with open(path, "rb") as fh:
        for raw in iter(lambda: fh.readline(MAX_LINE_BYTES), b""):
            line = raw.strip()
            if line:
                return line.startswith(b"{")
    return False


def read_records(path: str | Path, *, names: bool = False) -> Iterator[Message]:
    """Records from a JSON-lines file, with ``names`` its layer names, checkpoint notes and GPUs too;
    ReplayError names the first bad line (anything but a telemetry message is one)."""
    path = Path(path)
    with open(path, encoding="utf-8", errors="strict") as fh:
        lineno = 0
        try:
            for lineno, line in enumerate(bounded_lines(fh, path), 1):
                if not line.strip():
                    continue
                try:
                    msg = decode_line(line, _LIMITS)  # the service's limits: a file cannot size memory either
                except RecordError as exc:
                    raise ReplayError(str(path), lineno, str(exc)) from None
                if isinstance(msg, Record) or (names and isinstance(msg, (LayerNames, CheckpointNote, RankDevice))):
                    yield msg
                elif not isinstance(msg, (LayerNames, CheckpointNote, RankDevice)):
                    raise ReplayError(str(path), lineno, f"a {type(msg).__name__}, not telemetry")
        except UnicodeDecodeError as exc:
            raise ReplayError(str(path), lineno + 1, f"not UTF-8 text: {exc.reason}") from None


def read_csv_frames(path: str | Path, run: str | None = None) -> Iterator[StepFrame]:
    """One-rank frames from a CSV log; ReplayError names the first bad line."""
    path = Path(path)
    run = run or path.stem
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(bounded_lines(fh, path))
        try:
            header = next(reader)
        except StopIteration:
            raise ReplayError(str(path), 0, "empty file") from None
        except csv.Error as exc:
            raise ReplayError(str(path), 1, f"bad CSV header: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ReplayError(str(path), 1, f"not UTF-8 text: {exc.reason}") from None
        if len(header) > MAX_COLUMNS:
            raise ReplayError(str(path), 1, f"{len(header):,} columns, more than {MAX_COLUMNS:,} (not a training log?)")
        cols = [h.strip().lower() for h in header]
        if "step" not in cols or "loss" not in cols:
            raise ReplayError(str(path), 1, f"header must name 'step' and 'loss' columns, got {header}")
        if len(set(cols)) != len(cols):
            raise ReplayError(str(path), 1, f"duplicate column names in header {header}")
        step_i = cols.index("step")
        value_cols = [i for i in range(len(cols)) if i != step_i]
        names = tuple(CSV_ALIASES.get(cols[i], _NAME_OK.sub("_", cols[i])[:64] or f"col{i}") for i in value_cols)
        last = None
        try:
            for row in reader:
                lineno = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(cols):
                    raise ReplayError(str(path), lineno, f"{len(row)} fields, the header has {len(cols)}")
                try:
                    step = int(float(row[step_i]))
                    if step < 0 or str(step) != row[step_i].strip() and float(row[step_i]) != step:
                        raise ValueError
                except ValueError:
                    raise ReplayError(
                        str(path), lineno, f"column 'step': {row[step_i]!r} is not a step number"
                    ) from None
                if last is not None and step <= last:
                    raise ReplayError(str(path), lineno, f"step {step} does not increase (previous {last})")
                last = step
                values = np.empty(len(value_cols))
                sent = np.ones(len(value_cols), bool)
                for j, i in enumerate(value_cols):
                    cell = row[i].strip()
                    if not cell:
                        values[j], sent[j] = math.nan, False
                        continue
                    try:
                        values[j] = float(cell)
                    except ValueError:
                        raise ReplayError(str(path), lineno, f"column {cols[i]!r}: {cell!r} is not a number") from None
                yield StepFrame.single(run, step, names, values, sent)
        except csv.Error as exc:
            raise ReplayError(str(path), reader.line_num, f"bad CSV: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ReplayError(str(path), reader.line_num + 1, f"not UTF-8 text: {exc.reason}") from None


def replay(path: str | Path, settings: PipelineSettings | None = None, **pipeline_kw) -> list[Incident]:
    """Every incident the detectors raise over the file, in order of opening."""
    path = Path(path)
    if not path.is_file():
        raise ReplayError(str(path), 0, "no such file")
    pipe = DetectionPipeline(settings, **pipeline_kw)
    pipe.book.history = []
    if _is_jsonl(path):
        batch: list[Record] = []
        for rec in read_records(path, names=True):
            batch.append(rec)
            if len(batch) >= 4096:
                pipe.process(batch)
                batch = []
        pipe.process(batch)
        pipe.flush()
        pipe.expire()  # runs whose every rank sent its end marker close: their open incidents resolve, as live
    else:
        for frame in read_csv_frames(path):
            pipe.process_frame(frame)
    return list(pipe.book.history)


def format_table(incidents: Sequence[Incident]) -> str:
    """A readable fixed-width table, one incident per line."""
    if not incidents:
        return "no incidents"
    rows = [("SEVERITY", "KIND", "STEPS", "RANKS", "METRIC", "MESSAGE")]
    for i in incidents:
        steps = f"{i.first_step}" + (f"-{i.last_step}" if i.last_step != i.first_step else "")
        ranks = ",".join(map(str, i.ranks[:8])) + ("..." if len(i.ranks) > 8 else "") or "-"
        metric = i.metric + (f"[{i.layer}]" if i.layer is not None else "") or "-"
        rows.append((i.severity.value, i.kind, steps, ranks, metric, i.message))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    return "\n".join("  ".join(r[c].ljust(widths[c]) for c in range(5)) + "  " + r[5] for r in rows)


def replay_main(argv: Sequence[str] | None = None) -> int:
    """``sdcwatch replay PATH [--json]``; returns the exit code (0 done, 2 bad input)."""
    ap = argparse.ArgumentParser(prog="sdcwatch replay", description="Run the detectors over a telemetry or loss log.")
    ap.add_argument("path", help="JSON-lines records or a CSV with step,loss[,grad_norm,lr,...]")
    ap.add_argument("--json", action="store_true", help="one JSON object per incident instead of a table")
    args = ap.parse_args(argv)
    try:
        incidents = replay(args.path)
    except ReplayError as exc:
        print(f"sdcwatch replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for inc in incidents:
            print(json.dumps(inc.to_dict(), allow_nan=False))
    else:
        print(format_table(incidents))
    return 0
