"""The detector: the one plug-in unit of sdcwatch, and what every detector shares.

A detector is fed aligned steps (:class:`~sdcwatch.detectors.frame.StepFrame`) of one run in step
order and answers with findings. Its settings are its own ``Config`` dataclass (each field with one
default and one doc line; ``sdcwatch serve`` sets them as ``[detectors.<name>]``), stored on the
detector under their names. Its whole state is explicit: ``snapshot()`` returns a JSON-safe dict and
``restore()`` takes it back, so a restarted service resumes without a new warm-up. During its
warm-up a detector learns and stays silent. ``metrics`` declares the numbers it shows on
``/metrics`` (:class:`~sdcwatch.core.metric_spec.MetricSpec`, each read off its state).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import check_known

__all__ = ["Detector", "SplitDetector", "StepContext", "NoSettings"]


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The settings of a detector that has none."""


class StepContext(Protocol):
    """Which step a judgement is about: a :class:`~sdcwatch.detectors.frame.StepFrame` or a
    :class:`~sdcwatch.service.summary.StepSummary` (hosts indexed by rank)."""

    run: str
    step: int
    world: int
    hosts: tuple[str, ...]


class Detector:
    """A detector that reads whole steps: ``update(frame) -> findings``.

    ``name`` is the stable detector label (used in findings, metrics and the ``[detectors.<name>]``
    config section); ``fault`` names the fault family the detector exists to find (the contract
    test injects exactly that family). Build one with its ``Config`` or with keyword settings
    (``SpikeDetector(warmup=20)``), which are checked by the ``Config``; the settings are stored
    on the detector under their names, and a name the ``Config`` does not have is refused:

    >>> from sdcwatch.detectors.spike import SpikeDetector
    >>> SpikeDetector(warmup=20).warmup
    20
    >>> SpikeDetector(warmpu=20)
    Traceback (most recent call last):
    ...
    sdcwatch.core.errors.ConfigError: spike.warmpu: unknown setting (did you mean warmup?) (known: ..., warmup, window)
    """

    name: ClassVar[str]
    fault: ClassVar[str]
    Config: ClassVar[type] = NoSettings
    warmup_steps: int = 0
    """Steps (with data) during which the detector only learns."""
    sparse: bool = False
    """Set on the scale-out's spatial stage: observations may drop what cannot matter much."""
    metrics: ClassVar[tuple] = ()
    """The metric families it owns (:class:`~sdcwatch.core.metric_spec.MetricSpec` with ``read``)."""

    def __init__(self, config: Any = None, /, **settings: Any) -> None:
        cfg = self.Config() if config is None else config
        if not isinstance(cfg, self.Config):
            raise ConfigError(self.name, f"expects a {type(self).__name__}.Config, got {type(cfg).__name__}")
        if settings:
            check_known(self.name, settings, (f.name for f in dataclasses.fields(cfg)))
            cfg = dataclasses.replace(cfg, **settings)
        self.config = cfg
        for f in dataclasses.fields(cfg):
            setattr(self, f.name, getattr(cfg, f.name))

    def update(self, frame: Any) -> list:
        """The findings of one whole step."""
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        """The detector's state, JSON-safe."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """Take back a :meth:`snapshot`."""


class SplitDetector(Detector):
    """A detector in two halves, so the work can be split across processes.

    ``observe(frame)`` is the cross-rank half: it reads one whole step and returns a compact,
    JSON-safe observation (numpy arrays allowed; None when there is nothing to say). It may keep
    only state that any instance can rebuild from the steps it sees. ``judge(at, observation)``
    is the temporal half: it folds observations, in step order, into the detector's history and
    returns findings. ``update(frame)`` is ``judge(frame, observe(frame))``. With ``sparse`` set,
    ``observe`` may drop the part of an observation that cannot matter much (the scale-out
    summaries do; one process keeps it whole).
    """

    def observe(self, frame: Any) -> Any:
        raise NotImplementedError

    def judge(self, at: StepContext, observation: Any) -> list:
        raise NotImplementedError

    def update(self, frame: Any) -> list:
        return self.judge(frame, self.observe(frame))
