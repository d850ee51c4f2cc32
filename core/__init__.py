"""The shared leaf: concepts every layer of sdcwatch uses, defined once.

- :mod:`~sdcwatch.core.errors`: the exception tree;
- :mod:`~sdcwatch.core.validate`: the validators (each names the dotted key of a bad value);
- :mod:`~sdcwatch.core.jsonsafe`: one JSON codec for NaN/Inf and numpy arrays;
- :mod:`~sdcwatch.core.vocabulary`: topic names and metric-name lists;
- :mod:`~sdcwatch.core.kinds`: :class:`IncidentKind` and its sets.

This package imports nothing of the project (and nothing heavier than numpy), so the in-rank
telemetry, the detectors, the exporters and the CLI may all import it.
"""

from sdcwatch.core.errors import (
    BrokerError,
    ConfigError,
    DeliveryError,
    FaultSpecError,
    RecordError,
    ReplayError,
    SdcwatchError,
    SummaryError,
    TransportError,
    UnknownVersionError,
)
from sdcwatch.core.kinds import IncidentKind

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
    "IncidentKind",
]
