"""The one protocol every detector follows, and the small helpers they share.

A detector is fed aligned steps (:class:`~sdcwatch.detectors.frame.StepFrame`) of one run in step
order and answers with findings. Its whole state is explicit: ``snapshot()`` returns a JSON-safe
dict and ``restore()`` takes it back, so a restarted service resumes without a new warm-up.
During its warm-up a detector learns and stays silent.
"""

from __future__ import annotations

import base64
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from sdcwatch.errors import ConfigError

__all__ = ["Detector", "SplitDetector", "StepContext", "DETECTORS", "register", "encode_array", "decode_array", "check_positive"]


@runtime_checkable
class Detector(Protocol):
    """What the pipeline needs from a detector.

    ``name`` is the stable detector label (used in findings and metrics); ``fault`` names the
    fault family the detector exists to find (the contract test injects exactly that family).
    """

    name: ClassVar[str]
    fault: ClassVar[str]

    def update(self, frame: Any) -> list: ...

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


class StepContext(Protocol):
    """Which step a judgement is about: a :class:`~sdcwatch.detectors.frame.StepFrame` or a
    :class:`~sdcwatch.detectors.summary.StepSummary` (hosts indexed by rank)."""

    run: str
    step: int
    world: int
    hosts: tuple[str, ...]


@runtime_checkable
class SplitDetector(Detector, Protocol):
    """A detector in two halves, so the work can be split across processes.

    ``observe(frame)`` is the cross-rank half: it reads one whole step and returns a compact,
    JSON-safe observation (numpy arrays allowed; None when there is nothing to say). It may keep
    only state that any instance can rebuild from the steps it sees. ``judge(at, observation)``
    is the temporal half: it folds observations, in step order, into the detector's history and
    returns findings. ``update(frame)`` is ``judge(frame, observe(frame))``. With ``sparse`` set,
    ``observe`` may drop the part of an observation that cannot matter much (the scale-out
    summaries do; one process keeps it whole).
    """

    sparse: bool

    def observe(self, frame: Any) -> Any: ...

    def judge(self, at: Any, observation: Any) -> list: ...


#: Every detector class, in the order the pipeline runs them (filled by :func:`register`).
DETECTORS: list[type] = []


def register(cls: type) -> type:
    """Class decorator: add a detector class to :data:`DETECTORS` (the contract test runs on all)."""
    if cls not in DETECTORS:
        DETECTORS.append(cls)
    return cls


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """A numpy array as a JSON-safe dict (exact: the raw bytes in base64, so NaN and uint64 survive)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_array(d: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_array` (returns a writable copy)."""
    raw = base64.b64decode(d["data"])
    return np.frombuffer(raw, dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def check_positive(owner: str, **values: float) -> None:
    """Raise ConfigError('<owner>.<key>') for any setting that is not a positive number."""
    for key, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"{owner}.{key}", f"must be a positive number, got {v!r}")
