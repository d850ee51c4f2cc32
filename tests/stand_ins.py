"""Stand-ins the tests hand the product where it takes an object: a clock the test moves, a sink
that keeps the incident events published to it, a detection pipeline on such a clock.

Importable from every test folder (``pythonpath = ["tests"]`` in pyproject.toml).
"""

from __future__ import annotations

from typing import Any

from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings

__all__ = ["Clock", "ListSink", "clocked_pipeline"]


class Clock:
    """A clock that stands at ``t`` until the test moves it (``clock.t += 5``)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class ListSink:
    """A sink keeping every incident event it is given, in order (``events``)."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.closed = False

    def publish(self, event: Any) -> None:
        self.events.append(event)

    @property
    def opened(self) -> list[Any]:
        """The incidents of the "opened" events."""
        return [e.incident for e in list(self.events) if e.change == "opened"]

    def close(self) -> None:
        self.closed = True


def clocked_pipeline(**settings: Any) -> tuple[DetectionPipeline, Clock]:
    """A detection pipeline of ``settings`` whose clock and wall clock are one :class:`Clock` at 1000 s."""
    clock = Clock(1000.0)
    return DetectionPipeline(PipelineSettings(**settings), clock=clock, wall=clock), clock
