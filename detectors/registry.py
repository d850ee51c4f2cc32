"""The one registry of detectors: it feeds the default pipeline, the ``[detectors.<name>]`` config
sections, the campaign's baselines and the contract test.

A detector class joins with ``@register(...)`` in its own module; nothing else needs to know it.

- :func:`detector_classes`: sdcwatch's own detectors, in the order the pipeline runs them (the
  contract test runs on every one);
- :func:`default_detectors`: the set a run gets unless told otherwise;
- :func:`baseline_classes`: what teams use today, scored beside sdcwatch by the campaign.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

__all__ = ["register", "detector_classes", "default_classes", "default_detectors", "baseline_classes", "detector_class"]

#: The modules that define the built-in detectors (imported on first use of the registry).
_MODULES = (
    "sdcwatch.detectors.nonfinite",
    "sdcwatch.detectors.checksum",
    "sdcwatch.detectors.spike",
    "sdcwatch.detectors.lr_jump",
    "sdcwatch.detectors.rank_outlier",
    "sdcwatch.detectors.replica",
    "sdcwatch.detectors.straggler",
    "sdcwatch.detectors.guard_actions",
    "sdcwatch.detectors.baselines.rules",
    "sdcwatch.detectors.baselines.river_hst",
)

_OWN: list[type] = []  # sdcwatch's detectors, pipeline order
_DEFAULT: list[type] = []
_BASELINES: dict[str, type] = {}


def register(*, default: bool = False, baseline: bool = False, own: bool = True) -> Callable[[type], type]:
    """Class decorator: add a detector to the registry.

    ``default``: in the set every run gets; ``baseline``: scored by the campaign as a baseline;
    ``own``: one of sdcwatch's detectors (the contract test runs on it; False for a baseline that
    only mirrors another tool's rule).
    """

    def add(cls: type) -> type:
        if own and cls not in _OWN:
            _OWN.append(cls)
        if default and cls not in _DEFAULT:
            _DEFAULT.append(cls)
        if baseline:
            _BASELINES[cls.name] = cls
        return cls

    return add


def _load() -> None:
    for module in _MODULES:
        importlib.import_module(module)


def _ordered(classes: list[type]) -> list[type]:
    """In the order of :data:`_MODULES` (then of registration), however the modules were imported:
    the pipeline's order of detectors is the order of findings within a step."""
    rank = {m: i for i, m in enumerate(_MODULES)}
    return sorted(classes, key=lambda c: (rank.get(c.__module__, len(rank)), classes.index(c)))


def detector_classes() -> list[type]:
    """sdcwatch's own detector classes, in the order the pipeline runs them."""
    _load()
    return _ordered(_OWN)


def default_classes() -> list[type]:
    """The detector classes a run gets by default (river's HalfSpaceTrees is opt-in: it is slow)."""
    _load()
    return _ordered(_DEFAULT)


def baseline_classes() -> dict[str, type]:
    """Baseline name -> class; the campaign scores each next to sdcwatch on the same trials."""
    _load()
    return {cls.name: cls for cls in _ordered(list(_BASELINES.values()))}


def detector_class(name: str) -> type:
    """The registered detector (own or baseline) called ``name``."""
    _load()
    for cls in [*_OWN, *_BASELINES.values()]:
        if cls.name == name:
            return cls
    raise KeyError(name)


def default_detectors(configs: Mapping[str, Any] | None = None) -> list:
    """A fresh instance of every default detector, each built from ``configs[name]`` when given
    (its ``Config``), else with its defaults."""
    configs = configs or {}
    return [cls(configs.get(cls.name)) for cls in default_classes()]
