"""Checkpoint notes: a rank tells the service it saved a checkpoint (step, path); the service's marking.

A :class:`CheckpointNote` travels on the telemetry topic as a message of its own, under the same
partition key as the rank's records (run and 16-step window, ``record_key``), so it is ordered with
them, and signed like every message when the job holds a key. The service marks each checkpoint
``clean``, ``suspect`` or ``after-fault`` from its incidents (:data:`MARKS`) and publishes each
marking as a :class:`CheckpointMark` on the anomalies topic (``"change": "checkpoint"``).

Binary layout (little-endian)::

    b"SDCK" | u8 version (1) | u64 step | u32 rank | u32 world | str16 run | str16 path

The JSON wire writes ``{"v": 1, "kind": "checkpoint", "run", "rank", "world", "step", "path"}``.
Anyone can write to the topic: decoding bounds the path (:data:`MAX_PATH_BYTES`) and refuses a
control character in it (it would break a log line or a terminal) with a RecordError naming the field.
This module imports only the standard library and the record's identity rules.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import struct
import time
from dataclasses import dataclass
from typing import Any

from sdcwatch.core.errors import RecordError, TransportError, UnknownVersionError
from sdcwatch.core.limits import MAX_NAME_BYTES, LimitError, RecordLimits

__all__ = [
    "CKPT_MAGIC",
    "CKPT_VERSION",
    "MAX_PATH_BYTES",
    "MARKS",
    "CheckpointNote",
    "CheckpointMark",
    "clean_path",
    "encode_note",
    "decode_note",
    "note_to_json",
    "note_from_dict",
    "is_note_line",
    "MAX_NOTES",
    "NoteOutbox",
]

CKPT_MAGIC = b"SDCK"
CKPT_VERSION = 1
#: Longest checkpoint path, in UTF-8 bytes (a path on a cluster file system or an object store URL).
MAX_PATH_BYTES = 1024
#: A checkpoint's marking, from safest to least safe.
MARKS = ("clean", "suspect", "after-fault")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_HEAD = struct.Struct("<4sBQII")
_U16 = struct.Struct("<H")


def _utf8_len(s: str) -> int:
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return 1 << 30


def _check(run: Any, rank: Any, world: Any, step: Any, path: Any, limits: RecordLimits | None) -> None:
    for name, v in (("rank", rank), ("world", world), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise RecordError(name, f"must be a non-negative integer, got {v!r}")
    if step >= 1 << 63:
        raise RecordError("step", f"{step} out of range [0, 2**63)")
    if not isinstance(run, str) or not run or _utf8_len(run) > MAX_NAME_BYTES or _CONTROL.search(run):
        raise RecordError("run", f"must be a non-empty string of at most {MAX_NAME_BYTES} bytes, no control character")
    if not 0 <= rank < world:
        raise RecordError("rank", f"{rank} out of range [0, {world})")
    if limits is not None and world > limits.max_world:
        raise LimitError("world", f"{world} ranks claimed, the limit is {limits.max_world} (limits.max_world)", "world")
    if not isinstance(path, str):
        raise RecordError("path", f"must be a string, got {type(path).__name__}")
    if _utf8_len(path) > MAX_PATH_BYTES:
        raise RecordError("path", f"checkpoint path longer than {MAX_PATH_BYTES} bytes: {path[:40]!r}...")
    if _CONTROL.search(path):
        raise RecordError("path", f"checkpoint path holds a control character: {path[:60]!r}")


def clean_path(path: Any) -> str:
    """What a rank can send of a path: ``str(path)``, control characters replaced, cut to the bound.
    Never raises."""
    text = _CONTROL.sub("?", str(path)).encode("utf-8", "replace").decode("utf-8")
    while _utf8_len(text) > MAX_PATH_BYTES:
        text = text[: len(text) * 3 // 4]
    return text


@dataclass(frozen=True)
class CheckpointNote:
    """One rank's word that the job saved a checkpoint after ``step`` at ``path`` ("" when the
    framework names none)."""

    run: str
    rank: int
    world: int
    step: int
    path: str = ""

    def __post_init__(self) -> None:
        _check(self.run, self.rank, self.world, self.step, self.path, None)


def encode_note(note: CheckpointNote) -> bytes:
    """The bus message of ``note`` (see the module docstring)."""
    run, path = note.run.encode("utf-8"), note.path.encode("utf-8")
    head = _HEAD.pack(CKPT_MAGIC, CKPT_VERSION, note.step, note.rank, note.world)
    return b"".join((head, _U16.pack(len(run)), run, _U16.pack(len(path)), path))


def _text(buf: bytes, p: int, field_name: str) -> tuple[str, int]:
    if p + 2 > len(buf):
        raise RecordError(field_name, "truncated")
    (k,) = _U16.unpack_from(buf, p)
    p += 2
    if p + k > len(buf):
        raise RecordError(field_name, "truncated")
    try:
        return buf[p : p + k].decode("utf-8"), p + k
    except UnicodeDecodeError:
        raise RecordError(field_name, "is not valid UTF-8") from None


def decode_note(buf: bytes | bytearray | memoryview, limits: RecordLimits | None = None) -> CheckpointNote:
    """Inverse of :func:`encode_note`; raises RecordError (LimitError) naming the fault."""
    buf = bytes(buf)
    if limits is not None and len(buf) > limits.max_message_bytes:
        raise LimitError("message", f"{len(buf)} bytes, the limit is {limits.max_message_bytes}", "oversize")
    if len(buf) < _HEAD.size:
        raise RecordError("checkpoint", f"truncated checkpoint note ({len(buf)} bytes)")
    magic, version, step, rank, world = _HEAD.unpack_from(buf)
    if magic != CKPT_MAGIC:
        raise RecordError("magic", f"not a checkpoint note (starts with {magic!r})")
    if version != CKPT_VERSION:
        raise UnknownVersionError(version)
    run, p = _text(buf, _HEAD.size, "run")
    path, p = _text(buf, p, "path")
    if p != len(buf):
        raise RecordError("checkpoint", f"{len(buf) - p} trailing bytes")
    _check(run, rank, world, step, path, limits)
    return CheckpointNote(run, rank, world, step, path)


def note_to_json(note: CheckpointNote) -> str:
    """One line of strict JSON (the file transport, captures)."""
    d = {"v": CKPT_VERSION, "kind": "checkpoint", "run": note.run, "rank": note.rank, "world": note.world}
    return json.dumps({**d, "step": note.step, "path": note.path}, separators=(",", ":"), ensure_ascii=False)


def is_note_line(line: str | bytes) -> bool:
    """Whether a JSON line is a checkpoint note (a record never holds this key and value)."""
    return (b'"kind":"checkpoint"' if isinstance(line, bytes) else '"kind":"checkpoint"') in line


def note_from_dict(d: Any, limits: RecordLimits | None = None) -> CheckpointNote:
    """Inverse of :func:`note_to_json`'s object; raises RecordError naming the bad field."""
    if not isinstance(d, dict) or d.get("kind") != "checkpoint":
        raise RecordError("kind", "not a checkpoint note")
    if d.get("v") != CKPT_VERSION:
        raise UnknownVersionError(d.get("v"))
    unknown = set(d) - {"v", "kind", "run", "rank", "world", "step", "path"}
    if unknown:
        raise RecordError(sorted(unknown)[0], "unknown field")
    run, rank, world, step, path = (d.get(k) for k in ("run", "rank", "world", "step", "path"))
    _check(run, rank, world, step, "" if path is None else path, limits)
    return CheckpointNote(run, rank, world, step, path or "")


@dataclass
class CheckpointMark:
    """The service's marking of one checkpoint of a run, as the anomalies topic carries it.

    ``incidents`` are the ids of the incidents that made it ``suspect`` or ``after-fault``;
    ``was`` the marking it had before this one (None: its first), ``reason`` says why in words.
    """

    run: str
    step: int
    path: str
    mark: str
    incidents: tuple[str, ...] = ()
    reason: str = ""
    was: str | None = None
    marked_at: float = 0.0

    @property
    def id(self) -> str:
        """The message key and identity of the checkpoint on the anomalies topic."""
        return f"{self.run}:checkpoint:{self.step}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe; the anomalies topic adds ``"change": "checkpoint"``."""
        return {
            "id": self.id,
            "kind": "checkpoint",
            "run": self.run,
            "step": self.step,
            "path": self.path,
            "mark": self.mark,
            "incidents": list(self.incidents),
            "reason": self.reason,
            "was": self.was,
            "marked_at": self.marked_at,
        }


# ---------------------------------------------------------------------------------------------
# the sending side: a rank's notes wait for the emitter's sender thread

log = logging.getLogger("sdcwatch.telemetry")

#: Checkpoint notes a rank holds for its sender at most (a job saves one every few hundred steps).
MAX_NOTES = 64


class NoteOutbox:
    """One rank's checkpoint notes on their way to the bus (the emitter's: :meth:`Emitter.checkpoint`).

    :meth:`add` (the training loop) appends and returns; :meth:`send` (the sender thread) builds the
    notes and hands them to the transport in a send of their own. A refused send goes again a second
    later; a note that is invalid or that the transport cannot encode is dropped and counted. Nothing
    here raises.
    """

    def __init__(self, run: str, rank: int, world: int) -> None:
        self.run, self.rank, self.world = run, rank, world
        self._queue: collections.deque = collections.deque()
        self._retry_at = 0.0
        self.sent = 0  # notes the transport took
        self.dropped = 0  # notes past MAX_NOTES, invalid, not encodable, or unsent at close

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, step: Any, path: Any, open_: bool = True) -> None:
        """Queue a note (never raises); past :data:`MAX_NOTES`, or once closed, it is counted as dropped."""
        if open_ and len(self._queue) < MAX_NOTES:
            self._queue.append((step, path))
        else:
            self.dropped += 1

    def send(self, transport: Any) -> None:
        """Send the notes queued (sender thread)."""
        if not self._queue or time.monotonic() < self._retry_at:
            return
        notes = []
        while self._queue:
            step, path = self._queue.popleft()
            try:
                notes.append(CheckpointNote(self.run, self.rank, self.world, step, clean_path(path)))
            except (RecordError, TypeError, ValueError) as exc:
                self.dropped += 1
                log.warning("sdcwatch emitter (rank %s): checkpoint note at step %r not sent: %s", self.rank, step, exc)
        if not notes:
            return
        try:
            transport.send(notes)
            self.sent += len(notes)
        except TransportError:  # the bus is down: again in a second, oldest first
            self._queue.extendleft((n.step, n.path) for n in reversed(notes))
            self._retry_at = time.monotonic() + 1.0
        except Exception as exc:  # a transport that cannot carry a note: never kills the sender
            self.dropped += len(notes)
            log.warning("sdcwatch emitter (rank %s): checkpoint note not sent: %s", self.rank, exc)

    def drop(self) -> None:
        """Count what is left as dropped (the emitter closed before the bus took it)."""
        self.dropped += len(self._queue)
        self._queue.clear()
