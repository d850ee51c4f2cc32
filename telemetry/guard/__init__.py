"""The guard: acts on a detection at the step boundary, on every rank alike, without stopping the job.

:mod:`~sdcwatch.telemetry.guard.guard` (``Guard``) runs each step and agrees on an action;
its settings and outcome are :mod:`~sdcwatch.telemetry.guard.config`, its parts the deciding
:mod:`~sdcwatch.telemetry.guard.checks` and acting :mod:`~sdcwatch.telemetry.guard.acting`, sharing
:mod:`~sdcwatch.telemetry.guard.state`, rollback snapshots :mod:`~sdcwatch.telemetry.guard.snapshots`,
decisions read from the control topic :mod:`~sdcwatch.telemetry.guard.control_topic`, the skip decided
on the device with no host sync :mod:`~sdcwatch.telemetry.guard.device_skip` (``DeviceSkip``), a
replica group leaving the job while the others go on :mod:`~sdcwatch.telemetry.guard.elastic`. The
public names are re-exported (lazily) here and by :mod:`sdcwatch.telemetry`.
"""

from sdcwatch.core.lazy import lazy_attributes

_LAZY = {
    "Guard": "sdcwatch.telemetry.guard.guard",
    "GuardConfig": "sdcwatch.telemetry.guard.config",
    "GuardPlace": "sdcwatch.telemetry.guard.config",
    "GuardState": "sdcwatch.telemetry.guard.state",
    "GuardOutcome": "sdcwatch.telemetry.guard.config",
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
