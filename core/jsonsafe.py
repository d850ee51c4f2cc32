"""One JSON codec for the numbers JSON cannot hold, used by incidents, the state file and the report:
NaN and +/-Infinity travel as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, numpy
arrays as their exact bytes.

>>> json_safe({"loss": float("nan"), "ranks": (3,)})
{'loss': 'NaN', 'ranks': [3]}
>>> parse_float("Infinity")
inf
"""

from __future__ import annotations

import base64
import enum
import math
from typing import Any

import numpy as np

__all__ = ["json_float", "json_safe", "parse_float", "encode_array", "decode_array"]

_SPECIAL = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}


def json_float(v: float | None) -> float | str | None:
    """A float as JSON allows it: finite as it is, NaN/Inf as a string (None stays None)."""
    if v is None:
        return None
    v = float(v)
    if math.isfinite(v):
        return v
    return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")


def json_safe(obj: Any) -> Any:
    """``obj`` with every float made JSON-safe, numpy scalars and arrays made plain, enums by value."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [json_safe(v) for v in obj.tolist()]
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return json_float(float(obj))
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def parse_float(v: Any) -> float:
    """Inverse of :func:`json_float` (and plain numbers): ``"NaN"`` -> nan."""
    return float(_SPECIAL.get(v, v)) if isinstance(v, str) else float(v)


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """A numpy array as a JSON-safe dict (exact: the raw bytes in base64, so NaN and uint64 survive)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_array(d: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_array` (returns a writable copy)."""
    raw = base64.b64decode(d["data"])
    return np.frombuffer(raw, dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()
