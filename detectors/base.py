"""The detector: the one plug-in unit of sdcwatch, and what every detector shares (its settings'
checks, its explicit state). How to write one: docs/add-a-detector.md.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, ClassVar, Protocol

import numpy as np
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.jsonsafe import decode_array, encode_array
from sdcwatch.core.validate import check_known, check_positive

__all__ = ["Detector", "SplitDetector", "StepContext", "NoSettings", "DetectorSettings"]


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The settings of a detector that has none."""


class DetectorSettings:
    """Base of a detector's frozen ``Config`` dataclass, declared with its ``[detectors.<section>]``
    and its fields that must be positive numbers (checked in this order when it is built):

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class DemoConfig(DetectorSettings, section="demo", positive="window"):
    ...     window: int = 10
    >>> DemoConfig(window=0)
    Traceback (most recent call last):
    ...
    sdcwatch.core.errors.ConfigError: demo.window: must be a positive number, got 0
    """

    section: ClassVar[str] = ""
    positive: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, section: str = "", positive: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.section = section or cls.section
        cls.positive = tuple(positive.split())

    def __post_init__(self) -> None:
        check_positive(self.section, **{name: getattr(self, name) for name in self.positive})


class StepContext(Protocol):
    """Which step a judgement is about: a :class:`~sdcwatch.detectors.frame.StepFrame` or a
    :class:`~sdcwatch.service.summary.StepSummary` (hosts indexed by rank)."""

    run: str
    step: int
    world: int
    hosts: tuple[str, ...]


class Detector:
    """A detector that reads whole steps: ``update(frame) -> findings``.

    ``name`` labels its findings, metrics and ``[detectors.<name>]``; ``fault`` is the fault
    family the contract test injects. Keyword settings are checked by its ``Config`` and stored
    under their names:

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
    snapshot_fields: ClassVar[dict[str, str]] = {}
    """Snapshot key -> the attribute it holds: the default :meth:`snapshot` and :meth:`restore` carry these."""

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
        """The detector's state, JSON-safe (arrays by their bytes, queues and tuples as lists)."""
        out = {}
        for key, attr in self.snapshot_fields.items():
            value = getattr(self, attr)
            if isinstance(value, np.ndarray):
                value = encode_array(value)
            elif isinstance(value, (deque, tuple)):
                value = list(value)
            out[key] = value
        return out

    def restore(self, state: dict[str, Any]) -> None:
        """Take back a :meth:`snapshot` (lists as tuples). A key it lacks raises KeyError, which the
        state file's reader names: a damaged state is said, not half restored."""
        for key, attr in self.snapshot_fields.items():
            value, now = state[key], getattr(self, attr)
            if isinstance(value, dict):  # an array
                value = decode_array(value)
            elif isinstance(now, deque):
                value = deque(value, maxlen=now.maxlen)
            elif isinstance(value, list):
                value = tuple(value)
            setattr(self, attr, value)


class SplitDetector(Detector):
    """A detector in two halves, so the work can be split across processes: ``observe(frame)`` turns
    a whole step into a compact, JSON-safe observation (None: nothing to say; with ``sparse``, less),
    ``judge(at, observation)`` folds observations in step order into findings."""

    def observe(self, frame: Any) -> Any:
        raise NotImplementedError

    def judge(self, at: StepContext, observation: Any) -> list:
        raise NotImplementedError

    def update(self, frame: Any) -> list:
        return self.judge(frame, self.observe(frame))
