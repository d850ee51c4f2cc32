"""The guard: acts on a detection at the step boundary, on every rank alike, without stopping the job
(``Guard``; docs/guard.md), and the skip decided on the device (``DeviceSkip``). The public names are
re-exported (lazily) here and by :mod:`sdcwatch.telemetry`.
"""

from sdcwatch.core.lazy import lazy_attributes

_LAZY = {
    "Guard": "sdcwatch.telemetry.guard.guard",
    "GuardConfig": "sdcwatch.telemetry.guard.config",
    "GuardPlace": "sdcwatch.telemetry.guard.config",
    "GuardState": "sdcwatch.telemetry.guard.state",
    "GuardOutcome": "sdcwatch.telemetry.guard.config",
    "MicroBatches": "sdcwatch.telemetry.guard.micro_batches",
    "GuardEviction": "sdcwatch.telemetry.guard.config",
    "EXIT_CODE_EVICT": "sdcwatch.telemetry.guard.config",
    "DeviceSkip": "sdcwatch.telemetry.guard.device_skip",
    "DeviceSkipConfig": "sdcwatch.telemetry.guard.device_skip",
    "ReplicaMembership": "sdcwatch.telemetry.guard.elastic",
    "TorchFTMembership": "sdcwatch.telemetry.guard.elastic",
    "TorchFTAgreement": "sdcwatch.telemetry.guard.elastic",
}

__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
