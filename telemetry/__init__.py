"""In-rank telemetry: the wire record, the emitter and its transports, torch probes, the guard and
the fault injector (the reference training run is in :mod:`sdcwatch.testbed`).

Importing this package is cheap: torch and kafka-python are imported only when a name that
needs them is first used (``attach``, ``FaultInjector``, ``KafkaTransport``'s first send ...).
"""

from __future__ import annotations

import importlib
from typing import Any

from sdcwatch.telemetry.emitter import Emitter, NullEmitter, identity_from_env
from sdcwatch.telemetry.lifecycle import RUN_END, end_marker, is_end_marker
from sdcwatch.core.record import FINGERPRINTS, LAYER_METRICS, SCALARS, Record, decode, encode
from sdcwatch.core.record_json import from_json, to_json
from sdcwatch.telemetry.transports import (
    TELEMETRY_TOPIC,
    FileTransport,
    KafkaTransport,
    MemoryBus,
    MemoryTransport,
    Transport,
)

# names whose modules import torch: resolved on first access (PEP 562)
_LAZY = {
    "attach": "sdcwatch.telemetry.probes",
    "Watch": "sdcwatch.telemetry.probes",
    "coords_from_mesh": "sdcwatch.telemetry.mesh_torch",
    "observe_attention": "sdcwatch.telemetry.attention",
    "ProbeConfig": "sdcwatch.telemetry.probe_config",
    "attention_stats": "sdcwatch.telemetry.attention",
    "canary_fingerprint": "sdcwatch.telemetry.canary",
    "FaultSpec": "sdcwatch.telemetry.faultspec",
    "FaultInjector": "sdcwatch.telemetry.faults",
    "load_faults": "sdcwatch.telemetry.faultspec",
    "parse_faults": "sdcwatch.telemetry.faultspec",
    # the guard and its control decisions import no torch, but stay off the emitter's import path
    "Guard": "sdcwatch.telemetry.guard",
    "GuardConfig": "sdcwatch.telemetry.guard_config",
    "GuardEviction": "sdcwatch.telemetry.guard_config",
    "GuardOutcome": "sdcwatch.telemetry.guard_config",
    "EXIT_CODE_EVICT": "sdcwatch.telemetry.guard_config",
    "Decision": "sdcwatch.telemetry.control",
    "KafkaControl": "sdcwatch.telemetry.control",
    "MemoryControl": "sdcwatch.telemetry.control",
    "GemmChecks": "sdcwatch.telemetry.gemm_checks",
    "check_linear": "sdcwatch.telemetry.checksum",
    "check_matmul": "sdcwatch.telemetry.checksum",
    "check_weight_grad": "sdcwatch.telemetry.checksum",
    "observe_gemm": "sdcwatch.telemetry.gemm_checks",
    "ResidualStream": "sdcwatch.telemetry.extremes",
    "PROBE_PRESETS": "sdcwatch.telemetry.presets",
    "probe_config": "sdcwatch.telemetry.presets",
}

__all__ = [
    "Record",
    "encode",
    "decode",
    "to_json",
    "from_json",
    "SCALARS",
    "LAYER_METRICS",
    "FINGERPRINTS",
    "Emitter",
    "NullEmitter",
    "identity_from_env",
    "RUN_END",
    "end_marker",
    "is_end_marker",
    "Transport",
    "KafkaTransport",
    "FileTransport",
    "MemoryTransport",
    "MemoryBus",
    "TELEMETRY_TOPIC",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sdcwatch.telemetry' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
