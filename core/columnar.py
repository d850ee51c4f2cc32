"""Wire format v2: a record layout (schema) sent inline once per key window, records as packed rows in its order.

The messages that carry the rows of :mod:`sdcwatch.core.record_layout`: encoding, the header, the
rows of one message (layout and why the schema travels in-band: docs/messages.md). Standard library only.
"""

from __future__ import annotations

import struct
from typing import Any, Iterable, Sequence

from sdcwatch.core.errors import RecordError, UnknownVersionError
from sdcwatch.core.record import ByteReader
from sdcwatch.core.record_layout import MAX_SCHEMA_BYTES, PackedRecord, Schema, row_to_record

__all__ = [
    "MAGIC_V2",
    "VERSION_V2",
    "encode_rows",
    "encode_message",
    "parse_header",
    "MessageHeader",
    "WIRES",
    "rows_of",
    "check_rows",
]

MAGIC_V2 = b"SDC2"
VERSION_V2 = 2
#: The wire formats an emitter can send: ``v2`` (this module) or ``v1`` (``record.py``).
WIRES = ("v1", "v2")
FLAG_SCHEMA = 1
_MSG_HEAD = struct.Struct("<4sBBIQI")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


def _str16(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > 1024:
        raise RecordError("string", f"longer than 1024 bytes: {s[:40]!r}...")
    return _U16.pack(len(b)) + b


def encode_rows(
    schema: Schema, run: str, hosts: Sequence[str], rows: bytes | Iterable[bytes], count: int, *, with_schema: bool
) -> bytes:
    """One v2 message: ``count`` rows already packed in ``schema``'s layout (bytes or an iterable of
    rows, e.g. numpy rows of ``schema.dtype``), their host indices pointing into ``hosts``."""
    if len(hosts) > 0xFFFF:
        raise RecordError("hosts", "more than 65535 hosts in one message")
    table = "\n".join(hosts).encode("utf-8")
    if any("\n" in h or len(h) > 1024 for h in hosts):
        raise RecordError("host", "a host name holds a newline or is longer than 1024 bytes")
    tail = [_str16(run), _U16.pack(len(hosts)), _U32.pack(len(table)), table]
    if with_schema:
        tail += [_U32.pack(len(schema.text)), schema.text]
    size = _MSG_HEAD.size + sum(map(len, tail))
    out = [_MSG_HEAD.pack(MAGIC_V2, VERSION_V2, FLAG_SCHEMA if with_schema else 0, size, schema.id, count), *tail]
    if isinstance(rows, (bytes, bytearray, memoryview)):
        out.append(bytes(rows))
    else:
        out += rows
    return b"".join(out)


def encode_message(records: Sequence[PackedRecord], *, with_schema: bool) -> bytes:
    """One v2 message from packed records that share run, host and schema."""
    first = records[0]
    return encode_rows(
        first.schema, first.run, (first.host,), [r.row for r in records], len(records), with_schema=with_schema
    )


_HOST_TABLES: dict[bytes, tuple[str, ...]] = {}  # host tables seen before: the same few recur


class MessageHeader:
    """The parsed head of a v2 message: where its rows start and what describes them."""

    __slots__ = ("schema_id", "count", "run", "hosts", "schema_text", "rows_at", "group")

    def __init__(
        self, schema_id: int, count: int, run: str, hosts: tuple[str, ...], schema_text: bytes | None, rows_at: int
    ) -> None:
        self.schema_id, self.count, self.run, self.hosts = schema_id, count, run, hosts
        self.schema_text, self.rows_at = schema_text, rows_at
        self.group = (schema_id, run)  # messages of one group decode together


#: Headers parsed before, by their bytes: one emitter's messages repeat the same header, so most
#: messages cost a slice and a lookup (headers that carry a schema are not kept: they are rare).
_HEADERS: dict[bytes, MessageHeader] = {}


def parse_header(buf: bytes) -> MessageHeader:
    """Parse the head of a v2 message; raises RecordError naming the bad field."""
    n = len(buf)
    if n >= 10 and not buf[5] & FLAG_SCHEMA:
        size = buf[6] | buf[7] << 8 | buf[8] << 16 | buf[9] << 24
        if size <= n:
            head = _HEADERS.get(buf[:size])
            if head is not None:
                return head
    head = _parse_header(buf)
    if head.schema_text is None:
        if len(_HEADERS) >= 4096:
            _HEADERS.clear()
        _HEADERS[bytes(buf[: head.rows_at])] = head
    return head


def _parse_header(buf: bytes) -> MessageHeader:
    if len(buf) < _MSG_HEAD.size:
        raise RecordError("header", f"truncated v2 message ({len(buf)} bytes)")
    r = ByteReader(buf)
    magic, version, flags, size, schema_id, count = r.unpack(_MSG_HEAD, "header")
    if magic != MAGIC_V2:
        raise RecordError("magic", f"not an sdcwatch v2 message (starts with {magic!r})")
    if version != VERSION_V2:
        raise UnknownVersionError(version)
    if flags & ~FLAG_SCHEMA:
        raise RecordError("flags", f"unknown flags {flags:#x}")
    run = r.string("run", True)
    if not run:
        raise RecordError("run", "must not be empty")
    if len(run.encode()) > 1024:
        raise RecordError("run", "longer than 1024 bytes")
    (n_hosts,) = r.unpack(_U16, "hosts")
    (k,) = r.unpack(_U32, "hosts")
    raw = r.take(k, "hosts")
    hosts = _HOST_TABLES.get(raw)
    if hosts is None:
        try:
            hosts = tuple(raw.decode("utf-8").split("\n")) if n_hosts else ()
        except UnicodeDecodeError:
            raise RecordError("hosts", "is not valid UTF-8") from None
        if len(hosts) != n_hosts or any(len(h) > 1024 for h in hosts):
            raise RecordError(
                "hosts", f"the table holds {len(hosts)} names (at most 1024 bytes each), the header says {n_hosts}"
            )
        if len(_HOST_TABLES) >= 4096:
            _HOST_TABLES.clear()
        _HOST_TABLES[raw] = hosts
    text = None
    if flags & FLAG_SCHEMA:
        (k,) = r.unpack(_U32, "schema")
        if k > MAX_SCHEMA_BYTES or r.pos + k > len(buf):
            raise RecordError("schema", f"length {k} beyond the message or the {MAX_SCHEMA_BYTES}-byte limit")
        text = r.take(k, "schema")
    if size != r.pos:
        raise RecordError("header length", f"says {size} bytes, the header has {r.pos}")
    return MessageHeader(schema_id, count, run, hosts, text, r.pos)


def rows_of(value: bytes, head: MessageHeader, schemas: dict[int, Schema], limits: Any = None) -> list[Any]:
    """The records of one v2 message, its schema inline (learnt into ``schemas``) or from ``schemas``;
    RecordError on an unknown schema or rows that do not fill the message."""
    if head.schema_text is not None:
        sch = Schema.from_text(head.schema_text)
        if sch.id != head.schema_id:
            raise RecordError("schema id", f"{head.schema_id:#018x} is not the hash of the schema sent with it")
        schemas[sch.id] = sch
    sch = schemas.get(head.schema_id)
    if sch is None:
        raise RecordError("schema id", f"unknown schema {head.schema_id:#018x}")
    body = memoryview(value)[head.rows_at :]
    check_rows(len(body), head, sch)
    out = [row_to_record(sch, head.run, head.hosts, vals) for vals in sch.struct.iter_unpack(body)]
    if limits is not None:
        for rec in out:
            limits.check(rec)
    return out


def check_rows(size: int, head: MessageHeader, schema: Schema) -> None:
    """RecordError unless ``size`` bytes are exactly the header's count of ``schema``'s rows."""
    if size != head.count * schema.row_size:
        raise RecordError(
            "records", f"{size} bytes of records, the header says {head.count} of {schema.row_size} bytes"
        )
