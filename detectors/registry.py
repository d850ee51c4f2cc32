"""The one registry of detectors: it feeds the default pipeline, the ``[detectors.<name>]`` config
sections, the campaign's baselines, ``/metrics`` and the contract test. A detector joins with
``@register(...)`` in its own module; the registry imports every module of the package to find it.

>>> [cls.name for cls in default_classes()]
['nonfinite', 'checksum', 'spike', 'lr_jump', 'rank_outlier', 'replica', 'straggler', 'missing_rank', 'guard']
>>> list(baseline_classes())
['river_hst']
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = [
    "register",
    "detector_classes",
    "default_classes",
    "default_detectors",
    "baseline_classes",
    "detector_class",
    "detector_metrics",
]

_PACKAGE = "sdcwatch.detectors"  # every module of it (sub-packages included) is imported


@dataclass(frozen=True)
class _Entry:
    cls: type
    order: int
    default: bool
    baseline: bool
    own: bool


_ENTRIES: dict[str, _Entry] = {}  # "module.qualname" -> entry (a re-imported module replaces its own)
_loaded = False


def register(*, order: int, default: bool = False, baseline: bool = False, own: bool = True) -> Callable[[type], type]:
    """Class decorator: add a detector to the registry.

    ``order``: where the pipeline runs it (unique; it fixes the order of findings within a step).
    Today's: ``nonfinite`` 10, ``checksum`` 20, ``spike`` 30, ``lr_jump`` 40, ``rank_outlier`` 50,
    ``replica`` 60, ``straggler`` 70, ``missing_rank`` 80, ``guard`` 90; ``river_hst`` 140 (110-130
    are the campaign's own baselines, not registered). ``default``: in the set every run gets;
    ``baseline``: scored by the campaign; ``own``: one of sdcwatch's (the contract test runs on it).
    A second detector with the same ``order`` or ``name`` is refused:

    >>> detector_class("nonfinite").__name__
    'NonFiniteDetector'
    >>> @register(order=10)
    ... class Twin:
    ...     name = "twin"
    Traceback (most recent call last):
    ...
    ValueError: detector twin: order 10 is taken by nonfinite (...NonFiniteDetector)
    """

    def add(cls: type) -> type:
        key = f"{cls.__module__}.{cls.__qualname__}"
        for other_key, other in _ENTRIES.items():
            if other_key == key:
                continue
            if other.order == order:
                raise ValueError(f"detector {cls.name}: order {order} is taken by {other.cls.name} ({other_key})")
            if other.cls.name == cls.name:
                raise ValueError(f"detector {cls.name}: the name is taken by {other_key}")
        _ENTRIES[key] = _Entry(cls, order, default, baseline, own)
        return cls

    return add


def _load() -> None:
    """Import every module of the package once (each registers its detectors as it is imported)."""
    global _loaded
    if _loaded:
        return
    package = importlib.import_module(_PACKAGE)
    for module in pkgutil.walk_packages(package.__path__, _PACKAGE + "."):
        importlib.import_module(module.name)
    _loaded = True  # not before: a module that failed to import is tried again, and raises again


def _classes(keep: Callable[[_Entry], bool]) -> list[type]:
    """The registered classes ``keep`` selects, in pipeline order."""
    _load()
    return [e.cls for e in sorted(_ENTRIES.values(), key=lambda e: e.order) if keep(e)]


def detector_classes() -> list[type]:
    """sdcwatch's own detector classes, in the order the pipeline runs them."""
    return _classes(lambda e: e.own)


def default_classes() -> list[type]:
    """The detector classes a run gets by default (river's HalfSpaceTrees is opt-in: it is slow)."""
    return _classes(lambda e: e.default)


def baseline_classes() -> dict[str, type]:
    """Baseline name -> class; the campaign scores each next to sdcwatch on the same trials."""
    return {cls.name: cls for cls in _classes(lambda e: e.baseline)}


def detector_class(name: str) -> type:
    """The registered detector (own or baseline) called ``name``."""
    for cls in _classes(lambda e: e.own or e.baseline):
        if cls.name == name:
            return cls
    raise KeyError(name)


def default_detectors(configs: Mapping[str, Any] | None = None) -> list:
    """A fresh instance of every default detector, built from ``configs[name]`` (its ``Config``) if given."""
    configs = configs or {}
    return [cls(configs.get(cls.name)) for cls in default_classes()]


def detector_metrics() -> list:
    """Every metric family a registered detector declares, in pipeline order (shared specs once).

    >>> [spec.name for spec in detector_metrics()][:3]
    ['sdcwatch_training_loss', 'sdcwatch_training_grad_norm', 'sdcwatch_detector_spike_score']
    """
    specs: dict[str, Any] = {}
    for cls in _classes(lambda e: True):
        for spec in cls.metrics:
            if specs.setdefault(spec.name, spec) is not spec:
                raise ValueError(f"detector {cls.name}: metric {spec.name} is declared otherwise by another detector")
    return list(specs.values())
