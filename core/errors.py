"""The exception tree of sdcwatch: one root, a few typed branches.

    SdcwatchError
    ├── ConfigError          a setting is missing or invalid (names the dotted key)
    ├── RecordError          a wire record is malformed (names the field)
    │   ├── UnknownVersionError
    │   └── SummaryError     a step-summary message is malformed (names the part)
    ├── TransportError       the bus refused or could not be reached (``unsent``: what was not sent)
    ├── DeliveryError        an alert receiver could not be reached (retried, never raised out of a sink)
    ├── BrokerError          the embedded broker could not start or stop
    ├── FaultSpecError       a fault-injection spec is invalid (names the key)
    └── ReplayError          an input file for replay is malformed (names the line)

Every error's context is declared in its constructor. This module imports nothing, so every
layer (even the in-rank emitter) can use it.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "SdcwatchError",
    "ConfigError",
    "RecordError",
    "UnknownVersionError",
    "SummaryError",
    "TransportError",
    "DeliveryError",
    "BrokerError",
    "FaultSpecError",
    "ReplayError",
    "ControlError",
]


class SdcwatchError(Exception):
    """Root of every error sdcwatch raises on purpose."""


class ConfigError(SdcwatchError, ValueError):
    """A configuration value is missing or invalid; ``key`` is its dotted name."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


class RecordError(SdcwatchError, ValueError):
    """A telemetry record could not be decoded or is invalid; ``field`` names the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"bad record field {field!r}: {problem}")


class UnknownVersionError(RecordError):
    """The record carries a version tag this decoder does not know; it is never guessed at."""

    def __init__(self, version: object) -> None:
        self.version = version
        super().__init__("version", f"unknown record version {version!r}")


class SummaryError(RecordError):
    """A step-summary message that cannot be decoded (names the part that is wrong)."""


class TransportError(SdcwatchError):
    """Sending to or reading from the message bus failed; ``unsent`` lists the records that were
    not confirmed (the emitter keeps them for the next attempt), None when not known."""

    def __init__(self, message: str, *, unsent: Sequence[Any] | None = None) -> None:
        self.unsent = None if unsent is None else list(unsent)
        super().__init__(message)


class DeliveryError(SdcwatchError):
    """A receiver could not be reached or answered with an error status (retried, never raised
    out of a sink)."""


class BrokerError(SdcwatchError):
    """The embedded broker could not be started, reached or stopped."""


class FaultSpecError(SdcwatchError, ValueError):
    """A fault-injection spec is invalid; ``key`` names the offending key."""

    def __init__(self, key: str, problem: str, *, where: str = "") -> None:
        self.key = key
        self.problem = problem
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}fault key {key!r}: {problem}")


class ControlError(SdcwatchError, ValueError):
    """A control message that is not a valid decision; names the field."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        super().__init__(f"control decision: {key}: {problem}")


class ReplayError(SdcwatchError, ValueError):
    """An input file for offline replay is malformed; ``line`` is 1-based (0 = whole file)."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        self.path = path
        self.line = line
        self.problem = problem
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {problem}")
