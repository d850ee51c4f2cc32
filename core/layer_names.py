"""Layer names: which module each index of an indexed metric is, sent by a rank once per key window.

A record's indexed metrics name modules by position: ``gemm_*`` index the checked matrix
products, ``stream_max`` the transformer blocks, the attention statistics the attention layers,
the ``act_max_module`` scalar every leaf module. The positions mean something only with the lists
the rank's probes built (``watch.checksums.names``, the block names, ``watch.layer_names``,
``watch.leaf_names``). A :class:`LayerNames` message carries those lists, one per *family*
(:data:`FAMILIES`), so the service can say ``gemm_out of model.layers.1.mlp.gate_proj (product 11)``
instead of ``gemm_out (product 11)``.

Where the names travel, and why: as a message of their own on the telemetry topic, under the
same partition key as the rank's records (run and 16-step window, ``record_key``), sent by the
emitter ahead of the first record of every key window and whenever the lists grow. That is how
the v2 schema travels (:mod:`sdcwatch.core.columnar`), and for the same reasons: Kafka orders a
partition, so the names reach a consumer before the records of their window; a service that
starts mid-run learns them within one window; no second topic, no ordering between topics. A
message of its own (rather than a field of the v2 schema or of v1 records) works unchanged on
all three wires (v1, v2 and the JSON lines of the file transport), costs nothing in the records,
and keeps the schema id a hash of the record layout alone: a new name does not make a new layout.

Binary layout (little-endian)::

    b"SDCN" | u8 version (1) | u64 step | u32 rank | u32 world | u64 digest | str16 run
    | u32 n | zlib(names JSON), n bytes

``names JSON`` is ``{family: [name, ...]}``, canonical (sorted keys, no spaces); ``digest`` is
its 64-bit BLAKE2b hash: the service keeps one copy of each distinct list (every data-parallel
replica sends the same) and checks the digest, so a digest cannot be re-bound to other names.
Module paths repeat (``model.layers.N.mlp.gate_proj``), so zlib shrinks them about tenfold.
The JSON wire writes the same message as one line, ``{"v": 1, "kind": "layer_names", ...}``.

Anyone can write to the topic: decoding bounds the message, the inflated text
(:data:`MAX_TEXT_BYTES`), the families (:data:`MAX_FAMILIES`), the names a family holds
(:data:`MAX_FAMILY_NAMES`) and a name's length (:data:`MAX_LAYER_NAME_BYTES`), and refuses a
name with a control character (it would break a log line) with :class:`LimitError` reason
``names``; the service dead-letters such a message. This module imports only the standard library.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from sdcwatch.core.errors import RecordError, UnknownVersionError
from sdcwatch.core.limits import MAX_NAME_BYTES, LimitError, RecordLimits
from sdcwatch.core.record import KEY_WINDOW
from sdcwatch.core.vocabulary import GEMM_METRICS, LAYER_METRICS

__all__ = [
    "NAMES_MAGIC",
    "NAMES_VERSION",
    "FAMILIES",
    "NOUNS",
    "MAX_FAMILIES",
    "MAX_FAMILY_NAMES",
    "MAX_LAYER_NAME_BYTES",
    "MAX_TEXT_BYTES",
    "LayerNames",
    "family_of",
    "check_names",
    "clean_names",
    "NamesOutbox",
    "encode_names",
    "decode_names",
    "names_to_dict",
    "names_from_dict",
    "names_to_json",
    "names_from_json",
    "is_names_line",
]

NAMES_MAGIC = b"SDCN"
NAMES_VERSION = 1
#: Family -> the metrics whose index is a position in that family's list. ``act_max`` carries the
#: attention layer of its module (``act_max_layer``), so it is named from the layers.
FAMILIES: dict[str, tuple[str, ...]] = {
    "products": GEMM_METRICS,
    "blocks": ("stream_max",),
    "layers": (*LAYER_METRICS, "attn_logit_min", "act_max"),
    "modules": ("act_max_module",),
    "canary_products": ("gemm_canary_fp",),  # the per-product canary's rotation (gemm_canary_product)
}
#: What one index of a family is called in a message (``product 11``, ``block 3``).
NOUNS = {"products": "product", "blocks": "block", "layers": "layer", "modules": "module", "canary_products": "product"}
_FAMILY_OF = {m: fam for fam, metrics in FAMILIES.items() for m in metrics}

#: Most families in one message (sdcwatch's probes send 4; a newer emitter may send more).
MAX_FAMILIES = 16
#: Most names in one family: a family indexes a vector (at most 65535 long on the wire) or a
#: module list; 16384 fits the largest mixture-of-experts models' leaf modules.
MAX_FAMILY_NAMES = 16384
#: Longest name, in UTF-8 bytes (module paths are a few tens of bytes).
MAX_LAYER_NAME_BYTES = 256
#: Longest names JSON once inflated: bounds what a small compressed message can make the service hold.
MAX_TEXT_BYTES = 2 << 20
_FAMILY_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_HEAD = struct.Struct("<4sBQIIQ")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


def family_of(metric: str) -> str | None:
    """The family whose list a ``metric``'s index points into (None: not an indexed metric)."""
    return _FAMILY_OF.get(metric)


def _digest(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _text(names: Mapping[str, tuple[str, ...]]) -> bytes:
    return json.dumps(dict(names), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _utf8_len(s: str) -> int:
    """UTF-8 length of ``s``; a lone surrogate (JSON allows ``"\\ud800"``) counts as too long."""
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError:
        return 1 << 30


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
    """What an emitter can send of its probes' lists: control characters replaced, long names cut,
    long lists cut (a position past the cut stays unnamed). Never raises on strings."""
    out: dict[str, tuple[str, ...]] = {}
    for fam, lst in list(names.items())[:MAX_FAMILIES]:
        kept = []
        for name in list(lst)[:MAX_FAMILY_NAMES]:
            name = _CONTROL.sub("?", str(name))
            name = name.encode("utf-8", "replace").decode("utf-8")
            while len(name.encode("utf-8")) > MAX_LAYER_NAME_BYTES:
                name = name[: len(name) * 3 // 4]
            kept.append(name)
        out[str(fam)] = tuple(kept)
    return check_names(out)


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
        text = _text(checked)
        return cls(run, rank, world, step, checked, _digest(text), zlib.compress(text, 6))

    def at(self, step: int) -> "LayerNames":
        """The same names, sent at ``step`` (no new encoding)."""
        return LayerNames(self.run, self.rank, self.world, step, self.names, self.digest, self.payload)

    def name(self, metric: str, index: int) -> str | None:
        """The module ``metric``'s position ``index`` is, when this rank named it."""
        fam = family_of(metric)
        lst = self.names.get(fam, ()) if fam is not None else ()
        return lst[index] or None if 0 <= index < len(lst) else None


def encode_names(msg: LayerNames) -> bytes:
    """The bus message of ``msg`` (see the module docstring)."""
    run = msg.run.encode("utf-8")
    payload = msg.payload or zlib.compress(_text(msg.names), 6)
    head = _HEAD.pack(NAMES_MAGIC, NAMES_VERSION, msg.step, msg.rank, msg.world, msg.digest)
    return b"".join((head, _U16.pack(len(run)), run, _U32.pack(len(payload)), payload))


def _check_identity(run: Any, rank: Any, world: Any, step: Any, limits: RecordLimits | None) -> None:
    for field, v in (("rank", rank), ("world", world), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise RecordError(field, f"must be a non-negative integer, got {v!r}")
    if not isinstance(run, str) or not run or _utf8_len(run) > MAX_NAME_BYTES:
        raise RecordError("run", f"must be a non-empty string of at most {MAX_NAME_BYTES} bytes")
    if not 0 <= rank < world:
        raise RecordError("rank", f"{rank} out of range [0, {world})")
    if limits is not None and world > limits.max_world:
        raise LimitError("world", f"{world} ranks claimed, the limit is {limits.max_world} (limits.max_world)", "world")


def decode_names(
    buf: bytes | bytearray | memoryview, limits: RecordLimits | None = None, cache: dict | None = None
) -> LayerNames:
    """Inverse of :func:`encode_names`; raises RecordError (LimitError: reason names) naming the fault.

    ``cache`` (a dict the caller keeps) maps payloads already checked to their names: every
    replica resends the same payload each window, and a hit costs a hash instead of an inflate.
    """
    buf = bytes(buf)
    n = len(buf)
    if limits is not None and n > limits.max_message_bytes:
        raise LimitError("message", f"{n} bytes, the limit is {limits.max_message_bytes}", "oversize")
    if n < _HEAD.size + 2:
        raise RecordError("names", f"truncated layer-names message ({n} bytes)")
    magic, version, step, rank, world, digest = _HEAD.unpack_from(buf)
    if magic != NAMES_MAGIC:
        raise RecordError("magic", f"not a layer-names message (starts with {magic!r})")
    if version != NAMES_VERSION:
        raise UnknownVersionError(version)
    p = _HEAD.size
    (k,) = _U16.unpack_from(buf, p)
    p += 2
    if p + k + 4 > n:
        raise RecordError("run", "truncated")
    try:
        run = buf[p : p + k].decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError("run", "is not valid UTF-8") from None
    p += k
    (k,) = _U32.unpack_from(buf, p)
    p += 4
    if p + k != n:
        raise RecordError("names", f"the payload says {k} bytes, the message holds {n - p}")
    _check_identity(run, rank, world, step, limits)
    payload = buf[p:]
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


def names_to_dict(msg: LayerNames) -> dict[str, Any]:
    """The JSON wire's form: one object, tagged ``"kind": "layer_names"``."""
    return {
        "v": NAMES_VERSION,
        "kind": "layer_names",
        "run": msg.run,
        "rank": msg.rank,
        "world": msg.world,
        "step": msg.step,
        "names": {k: list(v) for k, v in msg.names.items()},
    }


def names_to_json(msg: LayerNames) -> str:
    """One line of strict JSON (the file transport, captures)."""
    return json.dumps(names_to_dict(msg), separators=(",", ":"), ensure_ascii=False)


def is_names_line(line: str | bytes) -> bool:
    """Whether a JSON line is a layer-names object (a record never holds this key and value)."""
    return (b'"kind":"layer_names"' if isinstance(line, bytes) else '"kind":"layer_names"') in line


def names_from_json(line: str | bytes, limits: RecordLimits | None = None) -> LayerNames:
    """Parse one JSON line of :func:`names_to_json`; raises RecordError naming the fault."""
    if len(line) > MAX_TEXT_BYTES:
        raise _fail("names", f"a line of {len(line)} bytes, at most {MAX_TEXT_BYTES}")
    try:
        d = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError("names", f"not valid JSON: {exc}") from None
    return names_from_dict(d, limits)


def names_from_dict(d: Any, limits: RecordLimits | None = None) -> LayerNames:
    """Inverse of :func:`names_to_dict`; raises RecordError naming the bad field."""
    if not isinstance(d, dict) or d.get("kind") != "layer_names":
        raise RecordError("kind", "not a layer-names object")
    if d.get("v") != NAMES_VERSION:
        raise UnknownVersionError(d.get("v"))
    unknown = set(d) - {"v", "kind", "run", "rank", "world", "step", "names"}
    if unknown:
        raise RecordError(sorted(unknown)[0], "unknown field")
    _check_identity(d.get("run"), d.get("rank"), d.get("world"), d.get("step", 0), limits)
    return LayerNames.build(d["run"], d["rank"], d["world"], d.get("step", 0), d.get("names"))


# ---------------------------------------------------------------------------------------------
# the sending side: a rank's names go ahead of the first record of every key window

log = logging.getLogger("sdcwatch.telemetry")


class NamesOutbox:
    """One rank's layer names and the copies due on the bus (the emitter's: :meth:`Emitter.set_names`).

    The probes hand the emitter their name lists; the outbox packs them once into a
    :class:`LayerNames` message and, on the sender thread, queues a copy stamped with the step of the
    first record of each key window, sent before the records in a send of their own. A refused send
    is not retried: the names go again with the next batch. Nothing here raises into the sender.
    """

    def __init__(self, run: str, rank: int, world: int) -> None:
        self.run, self.rank, self.world = run, rank, world
        self.names: LayerNames | None = None
        self._window: int | None = None  # the key window the names last went out in
        self._due: list[LayerNames] = []
        self.sent = 0  # layer-names messages the transport took

    def set(self, names: Mapping[str, Sequence[str]]) -> None:
        """New lists (they grow as the probes discover modules); sent from the next record on."""
        try:
            self.names = LayerNames.build(self.run, self.rank, self.world, 0, clean_names(names))
            self._window = None
        except Exception as exc:  # a bound the lists break: the records still go, unnamed
            log.warning("sdcwatch emitter (rank %s): layer names not sent: %s", self.rank, exc)

    def note(self, step: int) -> None:
        """A record of ``step`` is about to go: the names go first if its window has not had them."""
        names = self.names
        if names is not None and step // KEY_WINDOW != self._window:
            self._window = step // KEY_WINDOW
            self._due.append(names.at(step))

    def send(self, transport: Any) -> None:
        """Send the copies due (call before the records they precede)."""
        if not self._due:
            return
        due, self._due = self._due, []
        try:
            transport.send(due)
            self.sent += len(due)
        except Exception:
            self._window = None
