"""sdcwatch: catch silent data corruption and loss spikes in large-model training. This package is
the composition root (CLI, config, embedded broker, demo, report) and imports no heavy dependency."""

from sdcwatch.core.errors import (
    BrokerError,
    ConfigError,
    FaultSpecError,
    RecordError,
    ReplayError,
    SdcwatchError,
    TransportError,
    UnknownVersionError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "SdcwatchError",
    "ConfigError",
    "RecordError",
    "UnknownVersionError",
    "TransportError",
    "BrokerError",
    "FaultSpecError",
    "ReplayError",
]
