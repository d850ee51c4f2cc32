"""The wire record's codecs: versioned binary (v1: one record or a batch) with its partition key,
and strict JSON (the file transport, replay, the report; NaN and Inf as the strings of
:mod:`sdcwatch.core.jsonsafe`). Layout: docs/messages.md. Decoding never guesses: a bad field or an
unknown version raises :class:`~sdcwatch.core.errors.RecordError` naming the field.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from typing import Any, NoReturn, Sequence

from sdcwatch.core.errors import RecordError, UnknownVersionError
from sdcwatch.core.jsonsafe import json_float
from sdcwatch.core.limits import MAX_NAME_BYTES, LimitError, RecordLimits
from sdcwatch.core.mesh import DIMS, MAX_COORD
from sdcwatch.core.record_type import Record, check_name, validate

__all__ = [
    "VERSION",
    "MAGIC",
    "encode",
    "decode",
    "encode_batch",
    "decode_records",
    "KEY_WINDOW",
    "record_key",
    "ByteReader",
    "to_dict",
    "from_dict",
    "to_json",
    "from_json",
]

VERSION = 1
#: The record layout of a record that carries parallel coordinates.
VERSION_COORDS = 2
MAGIC = b"SDCW"
BATCH_MAGIC = b"SDCB"
_BATCH_HEAD = struct.Struct("<4sBI")
_U32 = struct.Struct("<I")

_HEAD = struct.Struct("<4sBQIIId")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_F64 = struct.Struct("<d")
_U64S = struct.Struct("<Q")
_COORD = struct.Struct("<BI")
_DIM_INDEX = {d: i for i, d in enumerate(DIMS)}  # a dim's number on the wire


@functools.lru_cache(maxsize=None)
def _f32s(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}f")


def _put_str(out: list[bytes], s: str, wide: bool) -> None:
    b = s.encode("utf-8")
    out.append((_U16 if wide else _U8).pack(len(b)))
    out.append(b)


def encode(rec: Record) -> bytes:
    """Encode a (trusted valid) record into the compact binary form; a value ``struct`` refuses is a RecordError."""
    try:
        coords = rec.coords
        out: list[bytes] = [
            _HEAD.pack(
                MAGIC,
                VERSION_COORDS if coords else VERSION,
                rec.step,
                rec.rank,
                rec.world,
                rec.local_rank,
                float(rec.time),
            )
        ]
        _put_str(out, rec.run, True)
        _put_str(out, rec.host, True)
        out.append(_U8.pack(len(rec.scalars)))
        for name, value in rec.scalars.items():
            _put_str(out, name, False)
            out.append(_F64.pack(float(value)))
        out.append(_U8.pack(len(rec.fingerprints)))
        for name, value in rec.fingerprints.items():
            _put_str(out, name, False)
            out.append(_U64S.pack(int(value)))
        out.append(_U8.pack(len(rec.layers)))
        for name, values in rec.layers.items():
            _put_str(out, name, False)
            n = len(values)
            out.append(_U16.pack(n))
            out.append(_f32s(n).pack(*values))
        if coords:
            out.append(_U8.pack(len(coords)))
            for dim, value in coords.items():
                out.append(_COORD.pack(_DIM_INDEX[dim], value))
        return b"".join(out)
    except (struct.error, OverflowError, TypeError, ValueError, AttributeError, KeyError) as exc:
        raise RecordError("record", f"cannot encode: {exc!r}") from None


class ByteReader:
    """Reads a binary message front to back; every shortfall is a RecordError naming the field."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def _short(self, n: int, what: tuple[str, ...]) -> NoReturn:
        """Raise: ``n`` bytes of the field ``what`` (its dotted name, in parts) are not there."""
        left = len(self.buf) - self.pos
        raise RecordError(".".join(what), f"truncated: needs {n} bytes at offset {self.pos}, {left} left")

    def take(self, n: int, *what: str) -> bytes:
        p = self.pos
        if p + n > len(self.buf):
            self._short(n, what)
        self.pos = p + n
        return self.buf[p : p + n]

    def unpack(self, st: struct.Struct, *what: str) -> tuple:
        p = self.pos
        if p + st.size > len(self.buf):
            self._short(st.size, what)
        self.pos = p + st.size
        return st.unpack_from(self.buf, p)

    def string(self, what: str, wide: bool) -> str:
        (n,) = self.unpack(_U16 if wide else _U8, what)
        try:
            return str(self.take(n, what), "utf-8")
        except UnicodeDecodeError:
            raise RecordError(what, "is not valid UTF-8") from None

    def name(self, group: str) -> str:
        """A metric name of ``group``: one seen before costs a lookup, a new one is checked first."""
        buf, p = self.buf, self.pos
        k = buf[p] if p < len(buf) else 0
        end = p + 1 + k
        name = _NAMES.get(buf[p + 1 : end]) if end <= len(buf) else None
        if name is not None:
            self.pos = end
            return name
        name = self.string(f"{group} name", False)
        check_name(f"{group} name", name)
        if len(_NAMES) < 4096:
            _NAMES[name.encode()] = name
        return name

    def group(self, group: str, st: struct.Struct) -> dict:
        """A counted group of (name, fixed-size value)."""
        out = {}
        for _ in range(self.unpack(_U8, group)[0]):
            name = self.name(group)
            (out[name],) = self.unpack(st, group, name)
        return out


_NAMES: dict[bytes, str] = {}  # encoded metric name -> name, for names already validated


def decode(data: bytes | bytearray | memoryview) -> Record:
    """Decode one binary record; raises RecordError (never anything else) when it is bad."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError("record", f"expected bytes, got {type(data).__name__}")
    buf = bytes(data)
    if len(buf) < 5:
        raise RecordError("magic", f"record too short ({len(buf)} bytes)")
    if buf[:4] != MAGIC:
        raise RecordError("magic", f"not an sdcwatch record (starts with {buf[:4]!r})")
    version = buf[4]
    if version != VERSION and version != VERSION_COORDS:
        raise UnknownVersionError(version)
    r = ByteReader(buf)
    _, _, step, rank, world, local_rank, time = r.unpack(_HEAD, "header")
    run = r.string("run", True)
    host = r.string("host", True)
    for name, value in (("run", run), ("host", host)):
        if len(value.encode()) > MAX_NAME_BYTES:
            raise LimitError(name, f"{len(value.encode())} bytes, longer than {MAX_NAME_BYTES}", "name")
    scalars = r.group("scalars", _F64)
    fps = r.group("fingerprints", _U64S)
    layers: dict[str, tuple[float, ...]] = {}
    for _ in range(r.unpack(_U8, "layers")[0]):
        name = r.name("layers")
        (count,) = r.unpack(_U16, "layers", name)
        layers[name] = r.unpack(_f32s(count), "layers", name)
    coords: dict[str, int] = {}
    if version == VERSION_COORDS:
        (n,) = r.unpack(_U8, "coords")
        if not n:
            raise RecordError("coords", "a version-2 record must carry coordinates")
        for _ in range(n):
            d, value = r.unpack(_COORD, "coords")
            if d >= len(DIMS):
                raise RecordError("coords", f"unknown mesh dim index {d} (0..{len(DIMS) - 1})")
            if DIMS[d] in coords:
                raise RecordError(f"coords.{DIMS[d]}", "given twice")
            if value >= MAX_COORD:
                raise RecordError(f"coords.{DIMS[d]}", f"{value} out of range [0, {MAX_COORD})")
            coords[DIMS[d]] = value
    if r.pos != len(buf):
        raise RecordError("record", f"{len(buf) - r.pos} trailing bytes after the record")
    if not run:
        raise RecordError("run", "must not be empty")
    if world < 1:
        raise RecordError("world", f"{world} out of range [1, {1 << 32})")
    if rank >= world:
        raise RecordError("rank", f"{rank} out of range [0, {world})")
    if not math.isfinite(time):
        raise RecordError("time", f"must be a finite number, got {time!r}")
    return Record(run, step, rank, world, host, time, local_rank, scalars, fps, layers, coords)


def encode_batch(records: Sequence[Record]) -> bytes:
    """Encode several records into one bus message (see the module docstring)."""
    out = [_BATCH_HEAD.pack(BATCH_MAGIC, VERSION, len(records))]
    for rec in records:
        b = encode(rec)
        out.append(_U32.pack(len(b)))
        out.append(b)
    return b"".join(out)


def decode_records(data: bytes | bytearray | memoryview, limits: RecordLimits | None = None) -> list[Record]:
    """Decode a v1 bus message: a single record or a batch; RecordError when any part is bad, LimitError
    (with ``limits``) for a message or record past a limit, before anything is sized by its claims."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError("record", f"expected bytes, got {type(data).__name__}")
    if limits is not None and len(data) > limits.max_message_bytes:
        raise LimitError(
            "message",
            f"{len(data)} bytes, the limit is {limits.max_message_bytes} (limits.max_message_bytes)",
            "oversize",
        )
    records = _decode_message(bytes(data))
    if limits is not None:
        for rec in records:
            limits.check(rec)
    return records


def _decode_message(buf: bytes) -> list[Record]:
    if buf[:4] != BATCH_MAGIC:
        return [decode(buf)]
    if len(buf) < _BATCH_HEAD.size:
        raise RecordError("batch", f"truncated batch header ({len(buf)} bytes)")
    _, version, count = _BATCH_HEAD.unpack_from(buf)
    if version != VERSION:
        raise UnknownVersionError(version)
    pos = _BATCH_HEAD.size
    out = []
    for i in range(count):
        if pos + 4 > len(buf):
            raise RecordError("batch", f"truncated: record {i} of {count} missing")
        (n,) = _U32.unpack_from(buf, pos)
        pos += 4
        if pos + n > len(buf):
            raise RecordError("batch", f"truncated: record {i} of {count} needs {n} bytes, {len(buf) - pos} left")
        out.append(decode(buf[pos : pos + n]))
        pos += n
    if pos != len(buf):
        raise RecordError("batch", f"{len(buf) - pos} trailing bytes after {count} records")
    return out


#: Steps per partition key: every rank of a step lands in one partition (a detector instance sees
#: whole steps), and one rank's consecutive steps can travel in one message.
KEY_WINDOW = 16


def record_key(rec: Any) -> bytes:
    """Partition key of a record (or a packed one): run and step window, so every rank of one step lands in one partition."""
    return f"{rec.run}/{rec.step // KEY_WINDOW}".encode()


_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_FIELDS = frozenset("v run step rank world local_rank host time scalars fingerprints layers coords".split())


def _pfloat(where: str, v: Any) -> float:
    if isinstance(v, str) and v in _SPECIAL:
        return _SPECIAL[v]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RecordError(where, f"must be a number, got {v!r}")
    return float(v)


def to_dict(rec: Record) -> dict[str, Any]:
    """A plain, strict-JSON-safe dict of the record (tagged with the version)."""
    return {
        "v": VERSION,
        "run": rec.run,
        "step": rec.step,
        "rank": rec.rank,
        "world": rec.world,
        "local_rank": rec.local_rank,
        "host": rec.host,
        "time": rec.time,
        "scalars": {k: json_float(v) for k, v in rec.scalars.items()},
        "fingerprints": {k: int(v) for k, v in rec.fingerprints.items()},
        "layers": {k: [json_float(x) for x in v] for k, v in rec.layers.items()},
        **({"coords": dict(rec.coords)} if rec.coords else {}),
    }


def from_dict(d: Any) -> Record:
    """Inverse of :func:`to_dict`; raises RecordError naming the bad field."""
    if not isinstance(d, dict):
        raise RecordError("record", f"expected a JSON object, got {type(d).__name__}")
    if "v" not in d:
        raise RecordError("v", "missing version tag")
    if d["v"] != VERSION:
        raise UnknownVersionError(d["v"])
    for key in ("run", "step", "rank", "world"):
        if key not in d:
            raise RecordError(key, "missing")
    unknown = set(d) - _FIELDS
    if unknown:
        raise RecordError(sorted(unknown)[0], "unknown field")
    groups = {}
    for g in ("scalars", "fingerprints", "layers", "coords"):
        val = d.get(g, {})
        if not isinstance(val, dict):
            raise RecordError(g, "must be a JSON object")
        groups[g] = val
    rec = Record(
        run=d["run"],
        step=d["step"],
        rank=d["rank"],
        world=d["world"],
        host=d.get("host", ""),
        time=_pfloat("time", d.get("time", 0.0)),
        local_rank=d.get("local_rank", 0),
        scalars={k: _pfloat(f"scalars.{k}", v) for k, v in groups["scalars"].items()},
        fingerprints=dict(groups["fingerprints"]),
        layers={
            k: tuple(_pfloat(f"layers.{k}", x) for x in (v if isinstance(v, list) else _not_list(k)))
            for k, v in groups["layers"].items()
        },
        coords=dict(groups["coords"]),
    )
    validate(rec)
    return rec


def _not_list(name: str) -> list:
    raise RecordError(f"layers.{name}", "must be a JSON array")


def to_json(rec: Record) -> str:
    """One line of strict JSON."""
    return json.dumps(to_dict(rec), separators=(",", ":"), allow_nan=False)


def from_json(line: str | bytes) -> Record:
    """Parse one JSON line; raises RecordError on bad JSON or a bad field."""
    try:
        d = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError("record", f"not valid JSON: {exc}") from None
    return from_dict(d)
