"""Wire format v2: a record layout (schema) sent once, records as packed numbers in its order.

The names of a rank's metrics and the length of its layer vectors are fixed for a run (a few
layouts at most: sampled steps add attention statistics). Version 1 spells every name in every
record and is decoded one record at a time; version 2 names a :class:`Schema` by a 64-bit id and
packs each record as fixed-size numbers, so the service reads thousands of records with one
``numpy.frombuffer`` (``sdcwatch.service.ingest``) and the emitter packs one ``struct``.

Message layout, version 2 (little-endian)::

    b"SDC2" | u8 version (2) | u8 flags | u32 header length | u64 schema id | u32 count | str16 run
    | u16 n_hosts | u32 n | host names joined by "\n", n bytes | [flags & 1: u32 n | schema JSON, n bytes]
    | count x row
    row = u64 step | u32 rank | u32 world | u32 local_rank | u32 host index | f64 time
          | u32 x len(coords) | f64 x len(scalars) | u64 x len(fingerprints) | f32 x sum(layer lengths)

The layout and its rows (:class:`Schema`, :func:`schema_for`, :class:`PackedRecord`,
:func:`row_to_record`) are :mod:`sdcwatch.core.record_layout`'s and are re-exported here; this module
owns the messages that carry them: encoding, the header, decoding a stream.

Where the schema travels, and why: in-band, inline in the first message a sender sends under
each partition key (run and 16-step window) and whenever a new layout appears; every other
message names it by id. Kafka orders a partition, and a key maps to one partition, so a schema
always reaches a consumer ahead of the records it describes, in the partition they share: no
second topic, no registry service, no ordering between topics, and a consumer that joins
mid-run learns every layout within one window (the service also keeps the schemas it learnt in
its saved state). The id is a hash of the schema's text, so an id cannot be re-bound to another
layout by anyone who can write to the topic; the decoder checks it. The cost: one schema
(a few hundred bytes) per rank per 16 steps.

This module imports only the standard library: it runs in every training rank.
"""

from __future__ import annotations

import struct
from typing import Any, Iterable, Sequence

from sdcwatch.core.checkpoints import CKPT_MAGIC, CheckpointNote, encode_note
from sdcwatch.core.errors import RecordError
from sdcwatch.core.layer_names import NAMES_MAGIC, LayerNames, encode_names
from sdcwatch.core.record_layout import MAX_SCHEMA_BYTES, PackedRecord, Schema, row_to_record

__all__ = [
    "MAGIC_V2",
    "VERSION_V2",
    "encode_rows",
    "encode_message",
    "encode_items",
    "parse_header",
    "MessageHeader",
    "WIRES",
    "decode_stream",
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
    """One v2 message: ``count`` rows already packed in ``schema``'s layout (bytes or an iterable of rows).

    ``hosts`` is the message's host table; each row's host index points into it. Producers that
    hold many ranks as numpy arrays pack the rows with ``schema.dtype`` and call this directly.
    """
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


def encode_items(
    items: Sequence[Any], key_of: Any, max_per_message: int, schemas_sent: set | None = None
) -> list[tuple[bytes, bytes, list]]:
    """Bus messages for a transport: ``(key, value, items)``, v1 records and v2 packed records alike
    (and :class:`~sdcwatch.core.layer_names.LayerNames`, each a message of its own).

    Items sharing a key travel together (at most ``max_per_message`` each); v2 items also share
    schema and host per message. ``schemas_sent`` holds ``(key, schema id)`` pairs already sent
    inline under that key: a schema rides with the first message of each key (it is updated here;
    the transport forgets it when it reconnects).
    """
    from sdcwatch.core.record import encode, encode_batch

    groups: dict[tuple, list] = {}
    for it in items:
        if isinstance(it, LayerNames):  # a message of its own, ahead of its window's records
            groups[(key_of(it), "names", id(it))] = [it]
        elif isinstance(it, CheckpointNote):  # a message of its own, ordered with its window's records
            groups[(key_of(it), "checkpoint", id(it))] = [it]
        elif isinstance(it, PackedRecord):
            groups.setdefault((key_of(it), it.schema, it.host), []).append(it)
        else:
            groups.setdefault((key_of(it), None, None), []).append(it)
    out = []
    for (key, schema, _), its in groups.items():
        for i in range(0, len(its), max_per_message):
            part = its[i : i + max_per_message]
            if isinstance(schema, str):  # "names" or "checkpoint"
                value = encode_names(part[0]) if schema == "names" else encode_note(part[0])
            elif schema is None:
                value = encode(part[0]) if len(part) == 1 else encode_batch(part)
            else:
                inline = schemas_sent is None or (key, schema.id) not in schemas_sent
                value = encode_message(part, with_schema=inline)
                if inline and schemas_sent is not None:
                    if len(schemas_sent) > 4096:
                        schemas_sent.clear()
                    schemas_sent.add((key, schema.id))
            out.append((key, value, part))
    return out


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
    n = len(buf)
    if n < _MSG_HEAD.size:
        raise RecordError("header", f"truncated v2 message ({n} bytes)")
    magic, version, flags, size, schema_id, count = _MSG_HEAD.unpack_from(buf)
    if magic != MAGIC_V2:
        raise RecordError("magic", f"not an sdcwatch v2 message (starts with {magic!r})")
    if version != VERSION_V2:
        from sdcwatch.core.errors import UnknownVersionError

        raise UnknownVersionError(version)
    if flags & ~FLAG_SCHEMA:
        raise RecordError("flags", f"unknown flags {flags:#x}")
    p = _MSG_HEAD.size

    def string(what: str) -> str:
        nonlocal p
        if p + 2 > n:
            raise RecordError(what, "truncated")
        k = buf[p] | buf[p + 1] << 8
        p += 2
        if p + k > n:
            raise RecordError(what, f"truncated: needs {k} bytes, {n - p} left")
        if k > 1024:
            raise RecordError(what, "longer than 1024 bytes")
        try:
            s = buf[p : p + k].decode("utf-8")
        except UnicodeDecodeError:
            raise RecordError(what, "is not valid UTF-8") from None
        p += k
        return s

    run = string("run")
    if not run:
        raise RecordError("run", "must not be empty")
    if p + 6 > n:
        raise RecordError("hosts", "truncated")
    n_hosts = buf[p] | buf[p + 1] << 8
    (k,) = _U32.unpack_from(buf, p + 2)
    p += 6
    if p + k > n:
        raise RecordError("hosts", f"truncated: needs {k} bytes, {n - p} left")
    raw = bytes(buf[p : p + k])
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
    p += k
    text = None
    if flags & FLAG_SCHEMA:
        if p + 4 > n:
            raise RecordError("schema", "truncated")
        (k,) = _U32.unpack_from(buf, p)
        p += 4
        if k > MAX_SCHEMA_BYTES or p + k > n:
            raise RecordError("schema", f"length {k} beyond the message or the {MAX_SCHEMA_BYTES}-byte limit")
        text = bytes(buf[p : p + k])
        p += k
    if size != p:
        raise RecordError("header length", f"says {size} bytes, the header has {p}")
    return MessageHeader(schema_id, count, run, hosts, text, p)


def decode_stream(values: Iterable[bytes], schemas: dict[int, Schema] | None = None) -> list[Any]:
    """Records of a sequence of bus messages, in order, one at a time (tests, small tools).

    v1 messages decode as ever; a v2 message needs its schema inline or in an earlier message of
    the sequence (``schemas`` holds what was learnt). The service reads v2 in bulk with
    ``sdcwatch.service.ingest`` instead. Raises RecordError on a bad message or an unknown schema.
    """
    from sdcwatch.core.record import decode_message

    schemas = {} if schemas is None else schemas
    out: list[Any] = []
    for value in values:
        if bytes(value[:4]) in (NAMES_MAGIC, CKPT_MAGIC):  # layer names, checkpoint notes: not records
            continue
        if bytes(value[:4]) != MAGIC_V2:
            out.extend(decode_message(value))
            continue
        head = parse_header(value)
        if head.schema_text is not None:
            sch = Schema.from_text(head.schema_text)
            if sch.id != head.schema_id:
                raise RecordError("schema id", f"{head.schema_id:#018x} is not the hash of the schema sent with it")
            schemas[sch.id] = sch
        sch = schemas.get(head.schema_id)
        if sch is None:
            raise RecordError("schema id", f"unknown schema {head.schema_id:#018x}")
        body = memoryview(value)[head.rows_at :]
        if len(body) != head.count * sch.row_size:
            raise RecordError(
                "records", f"{len(body)} bytes of records, the header says {head.count} of {sch.row_size} bytes"
            )
        for vals in sch.struct.iter_unpack(body):
            out.append(row_to_record(sch, head.run, head.hosts, vals))
    return out
