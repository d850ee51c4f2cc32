"""The record's JSON codec (the file transport, offline replay, the report): one strict-JSON
object per record, tagged with the version; non-finite floats are written as the strings "NaN",
"Infinity" and "-Infinity" (:mod:`sdcwatch.core.jsonsafe`) so every line is strict JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any

from sdcwatch.core.errors import RecordError, UnknownVersionError
from sdcwatch.core.jsonsafe import json_float
from sdcwatch.core.record import VERSION
from sdcwatch.core.record_type import Record, validate

__all__ = ["to_dict", "from_dict", "to_json", "from_json"]


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
