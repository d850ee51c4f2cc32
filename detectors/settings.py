"""The base of a detector's ``Config`` dataclass: the checks every detector's settings share.

A ``Config`` names its ``[detectors.<section>]`` and the fields that must be positive numbers in
its class line (names apart by spaces); the checks run when it is built (a field's own rule is its ``__post_init__``'s).
"""

from __future__ import annotations

from typing import Any, ClassVar

from sdcwatch.core.validate import check_positive

__all__ = ["DetectorSettings"]


class DetectorSettings:
    """Base of a detector's frozen ``Config`` dataclass, declared with its section and its positive fields:

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
    """The detector's name: ``[detectors.<section>]`` and the prefix of every error's key."""
    positive: ClassVar[tuple[str, ...]] = ()
    """Fields that must be positive numbers, checked in this order."""

    def __init_subclass__(cls, section: str = "", positive: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.section = section or cls.section
        cls.positive = tuple(positive.split())

    def __post_init__(self) -> None:
        check_positive(self.section, **{name: getattr(self, name) for name in self.positive})
