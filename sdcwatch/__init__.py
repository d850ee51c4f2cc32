"""sdcwatch: catch silent data corruption and loss spikes in large-model training.

``sdcwatch.telemetry`` runs inside every training rank (probes and the emitter),
``sdcwatch.detectors`` is the online detector service, ``sdcwatch.exporters`` feeds Prometheus
and Alertmanager. This package itself is the composition root (CLI, config, embedded broker,
demo) and stays import-light: importing it pulls in none of the heavy dependencies. The base
install is what a training rank needs; the service, the embedded broker and torch are the extras
``service``, ``broker`` and ``torch`` (``all`` for the three).
"""

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
