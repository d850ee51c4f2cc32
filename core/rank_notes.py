"""What a rank says besides its records: the layer names their indices point at (:class:`LayerNames`)
the checkpoints it saved (:class:`CheckpointNote`) and its GPU (:class:`RankDevice`), one codec for all, and the service's
marking of a checkpoint (:class:`CheckpointMark`). Layouts and bounds: docs/messages.md; decoding
bounds every length and refuses control characters (LimitError reason ``names``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from sdcwatch.core.errors import RecordError, UnknownVersionError
from sdcwatch.core.limits import MAX_NAME_BYTES, LimitError, RecordLimits
from sdcwatch.core.record import ByteReader

__all__ = [
    "NAMES_MAGIC",
    "CKPT_MAGIC",
    "GPU_MAGIC",
    "NOTE_VERSION",
    "MAX_FAMILIES",
    "MAX_FAMILY_NAMES",
    "MAX_LAYER_NAME_BYTES",
    "MAX_TEXT_BYTES",
    "MAX_PATH_BYTES",
    "MAX_GPU_BYTES",
    "MARKS",
    "LayerNames",
    "CheckpointNote",
    "RankDevice",
    "CheckpointMark",
    "check_names",
    "clean_names",
    "clean_text",
    "encode_names",
    "decode_names",
    "encode_note",
    "decode_note",
    "names_from_dict",
    "note_from_dict",
    "encode_device",
    "decode_device",
    "device_from_dict",
]

NAMES_MAGIC = b"SDCN"
CKPT_MAGIC = b"SDCK"
GPU_MAGIC = b"SDCG"
NOTE_VERSION = 1
#: Most families in one message (sdcwatch's probes send 5).
MAX_FAMILIES = 16
#: Most names in one family: 16384 fits the largest mixture-of-experts models' leaf modules.
MAX_FAMILY_NAMES = 16384
#: Longest layer name, in UTF-8 bytes (module paths are a few tens of bytes).
MAX_LAYER_NAME_BYTES = 256
#: Longest names JSON once inflated: bounds what a small compressed message can make the service hold.
MAX_TEXT_BYTES = 2 << 20
#: Longest checkpoint path, in UTF-8 bytes (a path on a cluster file system or an object store URL).
MAX_PATH_BYTES = 1024
#: Longest GPU label, in UTF-8 bytes (an index, a colon and a UUID: ``"5:GPU-<36 characters>"``).
MAX_GPU_BYTES = 96
#: A checkpoint's marking, from safest to least safe.
MARKS = ("clean", "suspect", "after-fault")
_FAMILY_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_HEAD = struct.Struct("<4sBQII")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_FIELDS = {"v", "kind", "run", "rank", "world", "step"}


def _utf8_len(s: str) -> int:
    """UTF-8 length of ``s``; a lone surrogate (JSON allows ``"\\ud800"``) counts as too long."""
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError:
        return 1 << 30


def clean_text(text: Any, max_bytes: int) -> str:
    """What a rank can send of a name or path: ``str(text)``, control characters replaced, cut to
    ``max_bytes``. Never raises."""
    out = _CONTROL.sub("?", str(text)).encode("utf-8", "replace").decode("utf-8")
    while _utf8_len(out) > max_bytes:
        out = out[: len(out) * 3 // 4]
    return out


def _check_identity(run: Any, rank: Any, world: Any, step: Any, limits: RecordLimits | None) -> None:
    for field, v in (("rank", rank), ("world", world), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise RecordError(field, f"must be a non-negative integer, got {v!r}")
    if step >= 1 << 63:
        raise RecordError("step", f"{step} out of range [0, 2**63)")
    if not isinstance(run, str) or not run or _utf8_len(run) > MAX_NAME_BYTES or _CONTROL.search(run):
        raise RecordError("run", f"must be a non-empty string of at most {MAX_NAME_BYTES} bytes, no control character")
    if not 0 <= rank < world:
        raise RecordError("rank", f"{rank} out of range [0, {world})")
    if limits is not None and world > limits.max_world:
        raise LimitError("world", f"{world} ranks claimed, the limit is {limits.max_world} (limits.max_world)", "world")


def _fail(field: str, problem: str) -> LimitError:
    return LimitError(field, problem, "names")


def check_names(names: Any) -> dict[str, tuple[str, ...]]:
    """``{family: (name, ...)}`` checked against the bounds above; raises LimitError (reason names)."""
    if not isinstance(names, dict):
        raise _fail("names", f"must be an object of families, got {type(names).__name__}")
    if len(names) > MAX_FAMILIES:
        raise _fail("names", f"{len(names)} families, at most {MAX_FAMILIES}")
    out: dict[str, tuple[str, ...]] = {}
    for fam, lst in names.items():
        if not isinstance(fam, str) or not _FAMILY_NAME.match(fam):
            raise _fail("names", f"family {str(fam)[:40]!r} is not a lowercase identifier of at most 32 characters")
        if not isinstance(lst, (list, tuple)):
            raise _fail(f"names.{fam}", "must be a list of names")
        if len(lst) > MAX_FAMILY_NAMES:
            raise _fail(f"names.{fam}", f"{len(lst)} names, at most {MAX_FAMILY_NAMES}")
        for i, name in enumerate(lst):
            if not isinstance(name, str):
                raise _fail(f"names.{fam}[{i}]", f"must be a string, got {type(name).__name__}")
            if _utf8_len(name) > MAX_LAYER_NAME_BYTES:
                raise _fail(f"names.{fam}[{i}]", f"longer than {MAX_LAYER_NAME_BYTES} bytes: {name[:40]!r}...")
            if _CONTROL.search(name):
                raise _fail(f"names.{fam}[{i}]", f"holds a control character: {name[:40]!r}")
        out[fam] = tuple(lst)
    return out


def clean_names(names: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """What an emitter can send of its probes' lists: names cleaned (:func:`clean_text`), long lists
    cut (a position past the cut stays unnamed). Never raises on strings."""
    return check_names(
        {
            str(fam): tuple(clean_text(n, MAX_LAYER_NAME_BYTES) for n in list(lst)[:MAX_FAMILY_NAMES])
            for fam, lst in list(names.items())[:MAX_FAMILIES]
        }
    )


def _digest(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _names_text(names: Mapping[str, tuple[str, ...]]) -> bytes:
    return json.dumps(dict(names), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True)
class LayerNames:
    """One rank's name lists, stamped with the step it was sent at (which picks the partition key)."""

    run: str
    rank: int
    world: int
    step: int
    names: dict[str, tuple[str, ...]]
    digest: int = 0
    payload: bytes = b""  # the compressed JSON, computed once per list (the emitter resends it)

    @classmethod
    def build(cls, run: str, rank: int, world: int, step: int, names: Mapping[str, Sequence[str]]) -> "LayerNames":
        """The message for checked ``names`` (raises LimitError when they break a bound)."""
        checked = check_names(dict(names) if isinstance(names, Mapping) else names)
        text = _names_text(checked)
        return cls(run, rank, world, step, checked, _digest(text), zlib.compress(text, 6))

    def at(self, step: int) -> "LayerNames":
        """The same names, sent at ``step`` (no new encoding)."""
        return LayerNames(self.run, self.rank, self.world, step, self.names, self.digest, self.payload)

    def to_dict(self) -> dict[str, Any]:
        """The JSON wire's form, tagged ``"kind": "layer_names"``."""
        return {**_head_dict(self, "layer_names"), "names": {k: list(v) for k, v in self.names.items()}}


class _TextNote:
    """A rank's note whose body is one string; ``WIRE``: its magic, its kind and the string's field."""

    WIRE: ClassVar[tuple[bytes, str, str]]

    def to_dict(self) -> dict[str, Any]:
        """The JSON wire's form, tagged with the note's kind (``"checkpoint"``, ``"gpu"``)."""
        _, kind, field = self.WIRE
        return {**_head_dict(self, kind), field: getattr(self, field)}


@dataclass(frozen=True)
class CheckpointNote(_TextNote):
    """One rank's word that the job saved a checkpoint after ``step`` at ``path`` ("" when the
    framework names none)."""

    run: str
    rank: int
    world: int
    step: int
    path: str = ""
    WIRE: ClassVar[tuple[bytes, str, str]] = (CKPT_MAGIC, "checkpoint", "path")

    def __post_init__(self) -> None:
        _check_identity(self.run, self.rank, self.world, self.step, None)
        if not isinstance(self.path, str):
            raise RecordError("path", f"must be a string, got {type(self.path).__name__}")
        if _utf8_len(self.path) > MAX_PATH_BYTES:
            raise RecordError("path", f"checkpoint path longer than {MAX_PATH_BYTES} bytes: {self.path[:40]!r}...")
        if _CONTROL.search(self.path):
            raise RecordError("path", f"checkpoint path holds a control character: {self.path[:60]!r}")


@dataclass(frozen=True)
class RankDevice(_TextNote):
    """One rank's GPU, said once: ``gpu`` is its physical index on the host (the CUDA_VISIBLE_DEVICES
    entry), then ``:`` and the GPU's UUID where the rank could read it (``"5:GPU-8f2e..."``)."""

    run: str
    rank: int
    world: int
    step: int
    gpu: str
    WIRE: ClassVar[tuple[bytes, str, str]] = (GPU_MAGIC, "gpu", "gpu")

    def __post_init__(self) -> None:
        _check_identity(self.run, self.rank, self.world, self.step, None)
        if not isinstance(self.gpu, str) or not self.gpu or _utf8_len(self.gpu) > MAX_GPU_BYTES:
            raise RecordError("gpu", f"must be a non-empty string of at most {MAX_GPU_BYTES} bytes")
        if _CONTROL.search(self.gpu):
            raise RecordError("gpu", f"holds a control character: {self.gpu[:40]!r}")


def _head_dict(msg: Any, kind: str) -> dict[str, Any]:
    return {"v": NOTE_VERSION, "kind": kind, "run": msg.run, "rank": msg.rank, "world": msg.world, "step": msg.step}


def _str16(b: bytes) -> bytes:
    return _U16.pack(len(b)) + b


def _encode(magic: bytes, msg: Any, fixed: bytes, body: bytes) -> bytes:
    head = _HEAD.pack(magic, NOTE_VERSION, msg.step, msg.rank, msg.world)
    return b"".join((head, fixed, _str16(msg.run.encode("utf-8")), body))


def encode_names(msg: LayerNames) -> bytes:
    """The bus message of ``msg`` (see the module docstring)."""
    payload = msg.payload or zlib.compress(_names_text(msg.names), 6)
    return _encode(NAMES_MAGIC, msg, _U64.pack(msg.digest), _U32.pack(len(payload)) + payload)


def _encode_text(msg: _TextNote) -> bytes:
    """The bus message of a note whose body is one string (a checkpoint's path, a rank's GPU)."""
    magic, _, field = msg.WIRE
    return _encode(magic, msg, b"", _str16(getattr(msg, field).encode("utf-8")))


encode_note = encode_device = _encode_text


def _open(buf: Any, magic: bytes, what: str, fixed: int, limits: RecordLimits | None) -> tuple[Any, ...]:
    """(cursor after the run, step, rank, world, fixed bytes, run) of a rank message (``what``:
    ``names`` or ``checkpoint``, the field a truncated one names)."""
    buf = bytes(buf)
    if limits is not None and len(buf) > limits.max_message_bytes:
        raise LimitError("message", f"{len(buf)} bytes, the limit is {limits.max_message_bytes}", "oversize")
    cur = ByteReader(buf)
    got, version, step, rank, world = cur.unpack(_HEAD, what)
    if got != magic:
        kind = {"names": "layer-names message", "gpu": "rank device message"}.get(what, "checkpoint note")
        raise RecordError("magic", f"not a {kind} (starts with {got!r})")
    if version != NOTE_VERSION:
        raise UnknownVersionError(version)
    extra = cur.take(fixed, what)
    run = cur.string("run", True)
    _check_identity(run, rank, world, step, limits)
    return cur, step, rank, world, extra, run


def _decode_text(cls: type, buf: bytes | bytearray | memoryview, limits: RecordLimits | None = None) -> Any:
    """Inverse of :func:`_encode_text` for notes of type ``cls``; RecordError (LimitError) naming the fault."""
    magic, what, field = cls.WIRE
    cur, step, rank, world, _, run = _open(buf, magic, what, 0, limits)
    text = cur.string(field, True)
    if cur.pos != len(cur.buf):
        raise RecordError(what, f"{len(cur.buf) - cur.pos} trailing bytes")
    return cls(run, rank, world, step, text)


decode_note = functools.partial(_decode_text, CheckpointNote)
decode_device = functools.partial(_decode_text, RankDevice)


def decode_names(
    buf: bytes | bytearray | memoryview, limits: RecordLimits | None = None, cache: dict | None = None
) -> LayerNames:
    """Inverse of :func:`encode_names`; RecordError (LimitError: reason names) naming the fault.
    ``cache`` maps payloads already checked to their names: replicas resend the same one."""
    cur, step, rank, world, extra, run = _open(buf, NAMES_MAGIC, "names", 8, limits)
    (digest,) = _U64.unpack(extra)
    (k,) = _U32.unpack(cur.take(4, "names"))
    if cur.pos + k != len(cur.buf):
        raise RecordError("names", f"the payload says {k} bytes, the message holds {len(cur.buf) - cur.pos}")
    payload = cur.buf[cur.pos :]
    hit = cache.get(payload) if cache is not None else None
    if hit is not None and hit[0] == digest:
        return LayerNames(run, rank, world, step, hit[1], digest, payload)
    inflate = zlib.decompressobj()
    try:
        text = inflate.decompress(payload, MAX_TEXT_BYTES)
    except zlib.error as exc:
        raise RecordError("names", f"the payload is not zlib data: {exc}") from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise _fail("names", f"the payload inflates past {MAX_TEXT_BYTES} bytes or is truncated")
    if _digest(text) != digest:
        raise RecordError("digest", f"{digest:#018x} is not the hash of the names sent with it")
    try:
        names = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError("names", f"not valid JSON: {exc}") from None
    msg = LayerNames(run, rank, world, step, check_names(names), digest, payload)
    if cache is not None:
        if len(cache) >= 64:
            cache.clear()
        cache[payload] = (digest, msg.names)
    return msg


def _from_dict(d: Any, kind: str, extra: str, limits: RecordLimits | None) -> tuple[Any, ...]:
    if not isinstance(d, dict) or d.get("kind") != kind:
        raise RecordError("kind", f"not a {kind} object")
    if d.get("v") != NOTE_VERSION:
        raise UnknownVersionError(d.get("v"))
    unknown = set(d) - _FIELDS - {extra}
    if unknown:
        raise RecordError(sorted(unknown)[0], "unknown field")
    run, rank, world, step = d.get("run"), d.get("rank"), d.get("world"), d.get("step", 0)
    _check_identity(run, rank, world, step, limits)
    return run, rank, world, step, d.get(extra)


def names_from_dict(d: Any, limits: RecordLimits | None = None) -> LayerNames:
    """Inverse of :meth:`LayerNames.to_dict`; raises RecordError naming the bad field."""
    return LayerNames.build(*_from_dict(d, "layer_names", "names", limits))


def note_from_dict(d: Any, limits: RecordLimits | None = None) -> CheckpointNote:
    """Inverse of :meth:`CheckpointNote.to_dict`; raises RecordError naming the bad field."""
    run, rank, world, step, path = _from_dict(d, "checkpoint", "path", limits)
    return CheckpointNote(run, rank, world, step, "" if path is None else path)


def device_from_dict(d: Any, limits: RecordLimits | None = None) -> RankDevice:
    """Inverse of :meth:`RankDevice.to_dict`; raises RecordError naming the bad field."""
    return RankDevice(*_from_dict(d, "gpu", "gpu", limits))


@dataclass
class CheckpointMark:
    """The service's marking of one checkpoint of a run, as the anomalies topic carries it: the
    ``incidents`` that made it so, the marking it ``was`` before (None: its first), ``reason``."""

    run: str
    step: int
    path: str
    mark: str
    incidents: tuple[str, ...] = ()
    reason: str = ""
    was: str | None = None
    marked_at: float = 0.0
    # what the marking rests on: per incident that covered its step, {"incident", "effect": the marking
    # it gave (after-fault, suspect, or none: the guard kept the weights clean, or its reach stayed within
    # the checks' bounds), "why"}; empty: no fault's incident covered it
    evidence: tuple[dict[str, Any], ...] = ()

    @property
    def id(self) -> str:
        """The message key and identity of the checkpoint on the anomalies topic."""
        return f"{self.run}:checkpoint:{self.step}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe; the anomalies topic adds ``"change": "checkpoint"``."""
        fields = {**vars(self), "incidents": list(self.incidents), "evidence": [dict(e) for e in self.evidence]}
        return {"id": self.id, "kind": "checkpoint", **fields}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CheckpointMark":
        """Inverse of :meth:`to_dict` (the anomalies topic's form too); RecordError naming a bad field."""
        step = d.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise RecordError("step", f"must be an integer, got {step!r:.40}")
        if d.get("mark") not in MARKS:
            raise RecordError("mark", f"must be one of {', '.join(MARKS)}, got {d.get('mark')!r:.40}")
        ids, evidence = d.get("incidents") or (), d.get("evidence") or ()  # an older marking: no evidence
        return cls(
            str(d.get("run", "")),
            step,
            str(d.get("path") or ""),
            d["mark"],
            tuple(i for i in ids if isinstance(i, str)) if isinstance(ids, list) else (),
            str(d.get("reason") or ""),
            d.get("was") if d.get("was") in MARKS else None,
            float(d["marked_at"]) if isinstance(d.get("marked_at"), (int, float)) else 0.0,
            tuple(dict(e) for e in evidence if isinstance(e, dict)) if isinstance(evidence, list) else (),
        )
