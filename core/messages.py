"""Every message sdcwatch writes, declared once (:data:`KINDS`: prefix or JSON kind, topic, codec);
one :func:`decode_message` for bus messages and one :func:`decode_line` for JSON lines, which every
reader uses (docs/messages.md). A bad message raises RecordError naming what is wrong, a signed one
that does not verify AuthError (reason ``auth``) naming why.
"""

from __future__ import annotations

import json
import time as _time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

from sdcwatch.core.columnar import MAGIC_V2, encode_message, parse_header, rows_of
from sdcwatch.core.control import START_MAGIC, JobStart, decode_decision
from sdcwatch.core.errors import ControlError, RecordError
from sdcwatch.core.incident import Incident
from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.rank_notes import (
    CKPT_MAGIC,
    GPU_MAGIC,
    NAMES_MAGIC,
    CheckpointMark,
    CheckpointNote,
    LayerNames,
    RankDevice,
    decode_device,
    decode_names,
    decode_note,
    device_from_dict,
    encode_device,
    encode_names,
    encode_note,
    names_from_dict,
    note_from_dict,
)
from sdcwatch.core.record import BATCH_MAGIC, MAGIC, decode_records, encode, encode_batch, from_dict, to_json
from sdcwatch.core.record_layout import PackedRecord, Schema
from sdcwatch.core.record_type import Record
from sdcwatch.core.signing import SIGNED_MAGIC, AuthError, Keyring
from sdcwatch.core.vocabulary import ANOMALY_TOPIC, CONTROL_TOPIC, RUN_END, SUMMARY_TOPIC, TELEMETRY_TOPIC

__all__ = [
    "MessageKind",
    "KINDS",
    "SUMMARY_MAGIC",
    "Message",
    "decode_message",
    "decode_stream",
    "open_signed",
    "decode_object",
    "decode_line",
    "encode_items",
    "encode_line",
    "end_marker",
    "is_end_marker",
]

#: The step summary's prefix (its codec is the service's: ``sdcwatch.service.summary``).
SUMMARY_MAGIC = b"SDCY"
#: What a telemetry message decodes to.
Message = Union[Record, LayerNames, CheckpointNote, RankDevice]
_NOTES = (LayerNames, CheckpointNote, RankDevice)  # what a rank says besides its records: one message each
_ENCODE_NOTE = {LayerNames: encode_names, CheckpointNote: encode_note, RankDevice: encode_device}


@dataclass(frozen=True)
class MessageKind:
    """One kind of message: its binary prefix or JSON ``kind``, its topic, its codec."""

    name: str
    topic: str
    prefix: bytes | None = None
    json_kind: str | None = None
    encode: Callable[..., Any] | None = None
    decode: Callable[..., Any] | None = None


#: Every kind, once. A JSON line without ``kind`` or ``change`` is a record.
KINDS: tuple[MessageKind, ...] = (
    MessageKind("record", TELEMETRY_TOPIC, MAGIC, None, encode, decode_records),
    MessageKind("record batch", TELEMETRY_TOPIC, BATCH_MAGIC, None, encode_batch, decode_records),
    MessageKind("records v2", TELEMETRY_TOPIC, MAGIC_V2, None, encode_message, rows_of),
    MessageKind("end-of-run marker", TELEMETRY_TOPIC, MAGIC, None, None, None),  # a record: see end_marker
    MessageKind("layer names", TELEMETRY_TOPIC, NAMES_MAGIC, "layer_names", encode_names, decode_names),
    MessageKind("checkpoint note", TELEMETRY_TOPIC, CKPT_MAGIC, "checkpoint", encode_note, decode_note),
    MessageKind("rank device", TELEMETRY_TOPIC, GPU_MAGIC, "gpu", encode_device, decode_device),
    MessageKind("job start", TELEMETRY_TOPIC, START_MAGIC, None, JobStart.encode, JobStart.decode),
    MessageKind("signed envelope", TELEMETRY_TOPIC, SIGNED_MAGIC, None, None, Keyring.verify),
    MessageKind("step summary", SUMMARY_TOPIC, SUMMARY_MAGIC),
    MessageKind("incident change", ANOMALY_TOPIC, None, "opened|updated|resolved", None, Incident.from_dict),
    MessageKind("checkpoint mark", ANOMALY_TOPIC, None, "checkpoint", CheckpointMark.to_dict, CheckpointMark.from_dict),
    MessageKind("decision", CONTROL_TOPIC, None, None, None, decode_decision),
)


def decode_message(
    value: bytes | bytearray | memoryview,
    limits: RecordLimits | None = None,
    *,
    schemas: dict[int, Schema] | None = None,
    keyring: Keyring | None = None,
    names_cache: dict | None = None,
) -> list[Message]:
    """What one bus message holds: records, layer names, a checkpoint note or a rank's GPU. A signed one is
    verified with ``keyring`` first; a v2 one needs its schema inline or in ``schemas`` (updated
    here); ``limits`` raise LimitError before anything is sized by its claims."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise RecordError("record", f"expected bytes, got {type(value).__name__}")
    value = bytes(value)
    prefix = value[:4]
    if prefix == SIGNED_MAGIC:
        return decode_message(open_signed(value, keyring), limits, schemas=schemas, names_cache=names_cache)
    if prefix == NAMES_MAGIC:
        return [decode_names(value, limits, names_cache)]
    if prefix == CKPT_MAGIC:
        return [decode_note(value, limits)]
    if prefix == GPU_MAGIC:
        return [decode_device(value, limits)]
    if prefix == START_MAGIC:  # a guard's start: the service's authenticator reads it, nothing else
        return []
    if prefix == MAGIC_V2:
        return rows_of(value, parse_header(value), schemas if schemas is not None else {}, limits)
    if prefix == SUMMARY_MAGIC:
        raise RecordError("magic", "a step summary (the service's summaries topic), not telemetry")
    return decode_records(value, limits)


def open_signed(value: bytes | None, keyring: Keyring | None) -> bytes | None:
    """The message inside a signed ``value``, verified with ``keyring``; an unsigned one as it is.
    AuthError naming why a signed one is refused (no keyring, an unknown key, a wrong tag)."""
    if value is None or value[:4] != SIGNED_MAGIC:
        return value
    if keyring is None:
        raise AuthError("signature", "a signed message, and no keyring to verify it (--auth-key-file)")
    return keyring.verify(value)[1]


def decode_stream(
    values: Iterable[bytes], limits: RecordLimits | None = None, *, keyring: Keyring | None = None
) -> list[Record]:
    """The records of a sequence of bus messages, in order (layer names, notes and devices left
    out; the v2 schemas learnt along the way): tests and tools."""
    schemas: dict[int, Schema] = {}
    msgs = (m for v in values for m in decode_message(v, limits, schemas=schemas, keyring=keyring))
    return [m for m in msgs if isinstance(m, Record)]


def decode_object(obj: Any, limits: RecordLimits | None = None) -> Any:
    """The message a JSON object is: a record, layer names, a checkpoint note or a GPU (telemetry), an
    :class:`~sdcwatch.core.incident.Incident` or a :class:`CheckpointMark` (anomalies), a
    :class:`~sdcwatch.core.control.Decision` (control). RecordError names the bad field."""
    if not isinstance(obj, dict):
        raise RecordError("record", f"expected a JSON object, got {type(obj).__name__}")
    change, kind = obj.get("change"), obj.get("kind")
    try:
        if change == "checkpoint":
            return CheckpointMark.from_dict(obj)
        if change is not None:
            return Incident.from_dict(obj)
        if kind == "layer_names":
            return names_from_dict(obj, limits)
        if kind == "checkpoint":
            return note_from_dict(obj, limits)
        if kind == "gpu":
            return device_from_dict(obj, limits)
        if "action" in obj and "v" not in obj:
            return decode_decision(obj)
    except (ValueError, TypeError, KeyError) as exc:
        if isinstance(exc, RecordError):
            raise
        raise RecordError(exc.key if isinstance(exc, ControlError) else "message", str(exc)) from None
    rec = from_dict(obj)
    if limits is not None:
        limits.check(rec)
    return rec


def decode_line(line: str | bytes, limits: RecordLimits | None = None) -> Any:
    """The message one JSON line holds (:func:`decode_object`); RecordError on bad JSON or a bad field."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError("record", f"not valid JSON: {exc}") from None
    return decode_object(obj, limits)


def encode_line(item: Message | PackedRecord) -> str:
    """One strict-JSON line (no newline) of what an emitter sends: the file transport's, a capture's."""
    if isinstance(item, _NOTES):
        return json.dumps(item.to_dict(), separators=(",", ":"), ensure_ascii=False)
    return to_json(item.to_record() if isinstance(item, PackedRecord) else item)


def encode_items(
    items: Sequence[Any], key_of: Callable[[Any], bytes], max_per_message: int, schemas_sent: set | None = None
) -> list[tuple[bytes, bytes, list]]:
    """Bus messages ``(key, value, items)`` in the order the items were made under each key: records
    travel together (v2 ones of one schema and host), at most ``max_per_message`` a message; layer
    names, checkpoint notes and devices alone, between the records made before and after them.
    ``schemas_sent``: ``(key, schema id)`` pairs whose schema was sent inline already (updated here)."""
    groups: dict[tuple, list] = {}
    epoch: dict[bytes, int] = {}  # per key: rank messages seen so far (records after one start anew)
    for it in items:
        key = key_of(it)
        if isinstance(it, _NOTES):
            epoch[key] = epoch.get(key, 0) + 1
            groups[(key, "note", id(it), 0)] = [it]
        elif isinstance(it, PackedRecord):
            groups.setdefault((key, it.schema, it.host, epoch.get(key, 0)), []).append(it)
        else:
            groups.setdefault((key, None, None, epoch.get(key, 0)), []).append(it)
    out = []
    for (key, schema, _, _), its in groups.items():
        for i in range(0, len(its), max_per_message):
            part = its[i : i + max_per_message]
            if schema == "note":
                value = _ENCODE_NOTE[type(part[0])](part[0])
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


def end_marker(
    run: str,
    step: int,
    rank: int,
    world: int,
    *,
    host: str = "",
    local_rank: int = 0,
    time: float | None = None,
    dropped: float = 0.0,
) -> Record:
    """The end-of-run marker rank ``rank`` sends after its last record (``step``: the last it emitted):
    a v1 record carrying ``sdcwatch.run_end = 1`` and ``emitter_dropped``."""
    scalars = {RUN_END: 1.0, "emitter_dropped": float(dropped)}
    stamp = _time.time() if time is None else time
    return Record.make(
        run=run, step=step, rank=rank, world=world, host=host, local_rank=local_rank, time=stamp, scalars=scalars
    )


def is_end_marker(rec: Record) -> bool:
    """Whether ``rec`` is an end-of-run marker rather than a step's telemetry."""
    return RUN_END in rec.scalars
