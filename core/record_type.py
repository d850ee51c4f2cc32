"""The wire record: one rank's telemetry for one step (:class:`Record`: identity, scalars, exact
fingerprints, per-layer vectors, mesh coordinates), and :func:`validate`, what every codec may
assume of one (RecordError naming the first bad field). The codecs import it; it imports none.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from sdcwatch.core.errors import RecordError
from sdcwatch.core.limits import MAX_NAME_BYTES, LimitError
from sdcwatch.core.mesh import DIMS, MAX_COORD

__all__ = ["Record", "validate", "check_name"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,63}$")
_U64 = 1 << 64


@dataclass(frozen=True, slots=True)
class Record:
    """One rank's telemetry for one step. Build with :meth:`make` to validate."""

    run: str
    step: int
    rank: int
    world: int
    host: str = ""
    time: float = 0.0
    local_rank: int = 0
    scalars: Mapping[str, float] = field(default_factory=dict)
    fingerprints: Mapping[str, int] = field(default_factory=dict)
    layers: Mapping[str, Sequence[float]] = field(default_factory=dict)
    #: {mesh dim: index} over :data:`sdcwatch.core.mesh.DIMS`; empty: one data-parallel group.
    coords: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def make(cls, **kw: Any) -> "Record":
        """Build and validate a record; raises RecordError naming the bad field."""
        rec = cls(**kw)
        validate(rec)
        return rec

    @property
    def key(self) -> tuple[str, int, int]:
        """The identity used for de-duplication: (run, step, rank)."""
        return (self.run, self.step, self.rank)


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(name, f"must be an integer, got {type(value).__name__}")
    if not lo <= value < hi:
        raise RecordError(name, f"{value} out of range [{lo}, {hi})")


def _check_str(name: str, value: Any, *, empty_ok: bool) -> None:
    if not isinstance(value, str):
        raise RecordError(name, f"must be a string, got {type(value).__name__}")
    if not value and not empty_ok:
        raise RecordError(name, "must not be empty")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise LimitError(name, f"longer than {MAX_NAME_BYTES} bytes", "name")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RecordError(name, "is not valid UTF-8") from None


_GOOD_NAMES: set[str] = set()  # names already checked: the same few dozen recur in every record


def check_name(where: str, name: Any) -> None:
    if name in _GOOD_NAMES:
        return
    if not isinstance(name, str) or not _NAME.match(name):
        raise RecordError(where, f"bad metric name {name!r} (letters, digits, _.:-; at most 64)")
    if len(_GOOD_NAMES) < 4096:
        _GOOD_NAMES.add(name)


def validate(rec: Record) -> None:
    """Raise RecordError naming the first invalid field of ``rec``."""
    _check_str("run", rec.run, empty_ok=False)
    _check_int("step", rec.step, 0, _U64)
    _check_int("world", rec.world, 1, 1 << 32)
    _check_int("rank", rec.rank, 0, rec.world)
    _check_int("local_rank", rec.local_rank, 0, 1 << 32)
    _check_str("host", rec.host, empty_ok=True)
    if not isinstance(rec.time, (int, float)) or isinstance(rec.time, bool) or not math.isfinite(rec.time):
        raise RecordError("time", f"must be a finite number, got {rec.time!r}")
    for group, limit in (("scalars", 255), ("fingerprints", 255), ("layers", 255)):
        mapping = getattr(rec, group)
        if not isinstance(mapping, Mapping):
            raise RecordError(group, "must be a mapping")
        if len(mapping) > limit:
            raise RecordError(group, f"more than {limit} entries")
    for name, value in rec.scalars.items():
        if name not in _GOOD_NAMES:
            check_name(f"scalars.{name}", name)
        if type(value) is not float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RecordError(f"scalars.{name}", f"must be a number, got {type(value).__name__}")
    for name, value in rec.fingerprints.items():
        check_name(f"fingerprints.{name}", name)
        _check_int(f"fingerprints.{name}", value, 0, _U64)
    for name, values in rec.layers.items():
        check_name(f"layers.{name}", name)
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise RecordError(f"layers.{name}", "must be a sequence of numbers")
        if len(values) > 0xFFFF:
            raise RecordError(f"layers.{name}", "more than 65535 layers")
        for v in values:
            if type(v) is not float and (isinstance(v, bool) or not isinstance(v, (int, float))):
                try:
                    float(v)  # numpy scalars
                except (TypeError, ValueError):
                    raise RecordError(f"layers.{name}", f"element {v!r} is not a number") from None
    coords = rec.coords or {}  # none given (empty, None) is nothing to check
    if not isinstance(coords, Mapping):
        raise RecordError("coords", "must be a mapping of mesh dim to index")
    for dim, value in coords.items():
        if dim not in DIMS:
            raise RecordError(f"coords.{dim}", f"unknown mesh dim (one of {', '.join(DIMS)})")
        _check_int(f"coords.{dim}", value, 0, MAX_COORD)
