"""The v2 record layout: a :class:`Schema` (names and sizes; its id a hash of its text) and records packed in it.

One ``struct`` packs a row in the emitter, one ``numpy.frombuffer`` reads thousands in the service
(layout: docs/messages.md). Standard library only (numpy lazily, for :meth:`Schema.dtype`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from itertools import accumulate, chain
from typing import Any, Mapping, Sequence

from sdcwatch.core.errors import RecordError
from sdcwatch.core.mesh import DIMS
from sdcwatch.core.record_type import Record, check_name

__all__ = [
    "Schema",
    "PackedRecord",
    "ROW_HEAD",
    "MAX_NAMES",
    "MAX_LAYERS",
    "MAX_SCHEMA_BYTES",
    "schema_for",
    "row_to_record",
]

#: Fixed head of every row: step, rank, world, local_rank, host index, time.
ROW_HEAD = "QIIIId"
#: Layout limits the decoder enforces too (a schema is data anyone who can write the topic sends).
MAX_NAMES = 255
MAX_LAYERS = 65535
MAX_SCHEMA_BYTES = 1 << 16
_SCHEMA_KEYS = {"scalars", "fingerprints", "layers", "coords"}


class Schema:
    """One record layout: scalar names, fingerprint names, (layer metric, number of layers), and the
    mesh dims of each row's coordinates. Build with :func:`schema_for`; ``id`` is the first 8 bytes
    of the BLAKE2b hash of :attr:`text`, the canonical JSON the wire carries."""

    def __init__(
        self,
        scalars: Sequence[str],
        fingerprints: Sequence[str],
        layers: Sequence[tuple[str, int]],
        coords: Sequence[str] = (),
    ) -> None:
        self.coords = tuple(coords)
        if any(d not in DIMS for d in self.coords) or len(set(self.coords)) != len(self.coords):
            raise RecordError(
                "schema.coords", f"must be distinct mesh dims among {', '.join(DIMS)}, got {self.coords!r}"
            )
        self.scalars = tuple(scalars)
        self.fingerprints = tuple(fingerprints)
        self.layers = tuple((str(n), int(k)) for n, k in layers)
        for group, names in (
            ("scalars", self.scalars),
            ("fingerprints", self.fingerprints),
            ("layers", [n for n, _ in self.layers]),
        ):
            if len(names) > MAX_NAMES:
                raise RecordError(group, f"more than {MAX_NAMES} entries")
            if len(set(names)) != len(names):
                raise RecordError(group, "a name appears twice in the layout")
            for n in names:
                check_name(f"{group} name", n)
        for n, k in self.layers:
            if not 0 <= k <= MAX_LAYERS:
                raise RecordError(f"layers.{n}", f"{k} layers out of range [0, {MAX_LAYERS}]")
        text: dict[str, Any] = {
            "scalars": list(self.scalars),
            "fingerprints": list(self.fingerprints),
            "layers": [list(x) for x in self.layers],
        }
        if self.coords:
            text["coords"] = list(self.coords)
        self.text = json.dumps(text, separators=(",", ":")).encode()
        self.id = int.from_bytes(hashlib.blake2b(self.text, digest_size=8).digest(), "little")
        *offsets, self.n_layer_values = accumulate((k for _, k in self.layers), initial=0)
        self.layer_offsets = tuple(offsets)
        fmt = (
            "<"
            + ROW_HEAD
            + "I" * len(self.coords)
            + "d" * len(self.scalars)
            + "Q" * len(self.fingerprints)
            + "f" * self.n_layer_values
        )
        self.struct = struct.Struct(fmt)
        self.row_size = self.struct.size

    @classmethod
    def from_text(cls, text: bytes) -> "Schema":
        """Parse the wire form; raises RecordError naming what is wrong."""
        if len(text) > MAX_SCHEMA_BYTES:
            raise RecordError("schema", f"longer than {MAX_SCHEMA_BYTES} bytes")
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RecordError("schema", f"not valid JSON: {exc}") from None
        if not isinstance(d, dict) or not {"scalars", "fingerprints", "layers"} <= set(d) <= _SCHEMA_KEYS:
            raise RecordError("schema", "must be an object with scalars, fingerprints, layers and optionally coords")
        scalars, fps, layers, coords = d["scalars"], d["fingerprints"], d["layers"], d.get("coords", [])
        if not all(isinstance(x, list) for x in (scalars, fps, layers, coords)):
            raise RecordError("schema", "scalars, fingerprints, layers and coords must be arrays")
        for item in layers:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or not isinstance(item[0], str)
                or isinstance(item[1], bool)
                or not isinstance(item[1], int)
            ):
                raise RecordError("schema.layers", f"each entry must be [name, number of layers], got {item!r}")
        sch = cls(scalars, fps, [tuple(x) for x in layers], coords)
        if sch.text != bytes(text):
            raise RecordError("schema", "not in canonical form (compact JSON, keys in order)")
        return sch

    @functools.cached_property
    def dtype(self) -> Any:
        """The numpy structured dtype of one row (packed, no padding)."""
        import numpy as np

        fields = [
            ("step", "<u8"),
            ("rank", "<u4"),
            ("world", "<u4"),
            ("local_rank", "<u4"),
            ("host", "<u4"),
            ("time", "<f8"),
            ("coords", "<u4", (len(self.coords),)),
            ("scalars", "<f8", (len(self.scalars),)),
            ("fingerprints", "<u8", (len(self.fingerprints),)),
            ("layers", "<f4", (self.n_layer_values,)),
        ]
        dtype = np.dtype(fields)
        assert dtype.itemsize == self.row_size
        return dtype

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and other.text == self.text

    def __hash__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return (
            f"Schema(id={self.id:#018x}, scalars={len(self.scalars)}, fingerprints={len(self.fingerprints)}, "
            f"layers={self.layers}, coords={self.coords})"
        )


_SCHEMAS: dict[tuple, Schema] = {}


def schema_for(
    scalars: Sequence[str],
    fingerprints: Sequence[str] = (),
    layers: Sequence[tuple[str, int]] = (),
    coords: Sequence[str] = (),
) -> Schema:
    """The (cached) schema of a layout; raises RecordError on a bad name or size."""
    key = (tuple(scalars), tuple(fingerprints), tuple(layers), tuple(coords))
    sch = _SCHEMAS.get(key)
    if sch is None:
        sch = Schema(*key)
        if len(_SCHEMAS) < 4096:
            _SCHEMAS[key] = sch
    return sch


class PackedRecord:
    """One record packed in its schema's row layout (what a v2 emitter hands its transport), with
    what the message header needs (run, host) and what keys it (step)."""

    __slots__ = ("run", "host", "step", "schema", "row")

    def __init__(self, run: str, host: str, step: int, schema: Schema, row: bytes) -> None:
        self.run, self.host, self.step, self.schema, self.row = run, host, step, schema, row

    @classmethod
    def pack(
        cls,
        run: str,
        host: str,
        step: int,
        rank: int,
        world: int,
        local_rank: int,
        time: float,
        scalars: Mapping[str, float],
        fingerprints: Mapping[str, int] | None = None,
        layers: Mapping[str, Sequence[float]] | None = None,
        *,
        coords: Mapping[str, int] | None = None,
        schemas: dict | None = None,
    ) -> "PackedRecord":
        """Pack one record (``coords`` trusted canonical); RecordError (bad name) or struct/type errors."""
        fps = fingerprints or {}
        lay = layers or {}
        co = coords or {}
        layout = (tuple(scalars), tuple(fps), tuple((k, len(v)) for k, v in lay.items()), tuple(co))
        cache = _SCHEMAS if schemas is None else schemas
        sch = cache.get(layout)
        if sch is None:
            sch = schema_for(*layout)
            if schemas is not None:
                schemas[layout] = sch
        row = sch.struct.pack(
            step,
            rank,
            world,
            local_rank,
            0,
            time,
            *co.values(),
            *scalars.values(),
            *fps.values(),
            *chain.from_iterable(lay.values()),
        )
        return cls(run, host, step, sch, row)

    @classmethod
    def from_record(cls, rec: Any, *, schemas: dict | None = None) -> "PackedRecord":
        """Pack a :class:`~sdcwatch.core.record.Record` (tests, benchmarks, re-encoding)."""
        return cls.pack(
            rec.run,
            rec.host,
            rec.step,
            rec.rank,
            rec.world,
            rec.local_rank,
            rec.time,
            rec.scalars,
            rec.fingerprints,
            rec.layers,
            coords=rec.coords,
            schemas=schemas,
        )

    def to_record(self) -> Any:
        return row_to_record(self.schema, self.run, (self.host,), self.schema.struct.unpack(self.row))


def row_to_record(schema: Schema, run: str, hosts: Sequence[str], values: Sequence[Any]) -> Record:
    """A :class:`~sdcwatch.core.record_type.Record` from one unpacked row."""
    step, rank, world, local_rank, host, time = values[:6]
    nc = len(schema.coords)
    coords = dict(zip(schema.coords, values[6 : 6 + nc]))
    p = 6 + nc
    ns, nf = len(schema.scalars), len(schema.fingerprints)
    scalars = dict(zip(schema.scalars, values[p : p + ns]))
    p += ns
    fps = dict(zip(schema.fingerprints, values[p : p + nf]))
    p += nf
    layers = {}
    for name, k in schema.layers:
        layers[name] = tuple(values[p : p + k])
        p += k
    return Record(
        run, step, rank, world, hosts[host] if host < len(hosts) else "", time, local_rank, scalars, fps, layers, coords
    )
