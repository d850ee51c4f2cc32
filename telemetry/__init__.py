"""In-rank telemetry: what runs inside every training rank. :mod:`~sdcwatch.telemetry.wire` (the
emitter, its transports; no torch), :mod:`~sdcwatch.telemetry.probes` (the watch and its checks),
:mod:`~sdcwatch.telemetry.guard` (acting at the step boundary), :mod:`~sdcwatch.telemetry.integrations`
(Hugging Face and Lightning callbacks). Importing it is cheap: torch and kafka-python are imported
only when a name that needs them is first used.
"""

from __future__ import annotations

from sdcwatch.core.lazy import lazy_attributes
from sdcwatch.core.record import decode, encode, from_json, to_json
from sdcwatch.core.record_type import Record
from sdcwatch.core.signing import JobKey
from sdcwatch.core.vocabulary import FINGERPRINTS, LAYER_METRICS, RUN_END, SCALARS, TELEMETRY_TOPIC
from sdcwatch.telemetry.wire.emitter import Emitter, NullEmitter
from sdcwatch.core.messages import end_marker, is_end_marker
from sdcwatch.telemetry.wire.environment import identity_from_env
from sdcwatch.telemetry.wire.transports import FileTransport, KafkaTransport, MemoryBus, MemoryTransport, Transport

# names whose modules import torch: resolved on first access (PEP 562)
_LAZY = {
    "attach": "sdcwatch.telemetry.probes.watch",
    "Watch": "sdcwatch.telemetry.probes.watch",
    "coords_from_mesh": "sdcwatch.telemetry.probes.mesh_torch",
    "observe_attention": "sdcwatch.telemetry.probes.attention",
    "ProbeConfig": "sdcwatch.telemetry.probes.config",
    "attention_stats": "sdcwatch.telemetry.probes.attention",
    "canary_fingerprint": "sdcwatch.telemetry.probes.canary",
    # the guard and its control decisions import no torch, but stay off the emitter's import path
    "Guard": "sdcwatch.telemetry.guard.guard",
    "GuardConfig": "sdcwatch.telemetry.guard.config",
    "GuardPlace": "sdcwatch.telemetry.guard.config",
    "GuardEviction": "sdcwatch.telemetry.guard.config",
    "GuardOutcome": "sdcwatch.telemetry.guard.config",
    "MicroBatches": "sdcwatch.telemetry.guard.micro_batches",
    "EXIT_CODE_EVICT": "sdcwatch.telemetry.guard.config",
    "DeviceSkip": "sdcwatch.telemetry.guard.device_skip",
    "DeviceSkipConfig": "sdcwatch.telemetry.guard.device_skip",
    "Decision": "sdcwatch.core.control",
    "KafkaControl": "sdcwatch.telemetry.guard.control_topic",
    "MemoryControl": "sdcwatch.telemetry.guard.control_topic",
    "GemmChecks": "sdcwatch.telemetry.probes.gemm_checks",
    "check_linear": "sdcwatch.telemetry.probes.checksum_bounds",
    "check_matmul": "sdcwatch.telemetry.probes.checksum_bounds",
    "check_weight_grad": "sdcwatch.telemetry.probes.checksum_bounds",
    "observe_gemm": "sdcwatch.telemetry.probes.gemm_state",
    "ResidualStream": "sdcwatch.telemetry.probes.residual_stream",
    "PROBE_PRESETS": "sdcwatch.telemetry.probes.presets",
    "probe_config": "sdcwatch.telemetry.probes.presets",
}

__all__ = [
    "Record",
    "JobKey",
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


__getattr__ = lazy_attributes(__name__, _LAZY)
