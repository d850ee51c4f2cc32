"""The one protocol every detector follows, and the small helpers they share.

A detector is fed aligned steps (:class:`~sdcwatch.detectors.frame.StepFrame`) of one run in step
order and answers with findings. Its whole state is explicit: ``snapshot()`` returns a JSON-safe
dict and ``restore()`` takes it back, so a restarted service resumes without a new warm-up.
During its warm-up a detector learns and stays silent.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable


__all__ = ["Detector", "SplitDetector", "StepContext", "DETECTORS", "register"]


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
