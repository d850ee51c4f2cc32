"""Limits on what one telemetry record may claim (one record with ``world = 10**9`` would make the service
allocate gigabytes), checked when the service decodes it: a record past one raises :class:`LimitError` naming
the field and the limit, its ``reason`` the dead-letter reason (docs/messages.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

from sdcwatch.core.errors import ConfigError, RecordError, UnknownVersionError
from sdcwatch.core.validate import check_number
from sdcwatch.core.vocabulary import CANARY_PRODUCT, FIRST_BAD

__all__ = ["RecordLimits", "LimitError", "MAX_NAME_BYTES", "COUNTER_SCALARS", "DEAD_LETTER_REASONS", "reason_of"]

#: Longest run or host name, in UTF-8 bytes: one rule for the codec, the validator and restore.
MAX_NAME_BYTES = 1024
#: Scalars that are counters (or, like ``nonfinite_first``, positions, and like
#: ``gemm_canary_product``, indexes): finite, >= 0, at most ``RecordLimits.max_counter``.
COUNTER_SCALARS = ("emitter_dropped", FIRST_BAD, CANARY_PRODUCT)
#: Why a message went to the dead-letter topic (the ``reason`` label; a small, fixed set).
DEAD_LETTER_REASONS = (
    "malformed",  # not a record: bad bytes, a bad field, trailing bytes
    "unknown_version",  # a record version this service does not know
    "empty",  # a message with no value
    "oversize",  # a message larger than max_message_bytes (not decoded)
    "world",  # world size past max_world
    "layers",  # a layer vector longer than max_layers
    "layer_metrics",  # more layer metrics in one record than max_layer_metrics
    "values",  # more values in one record than max_values
    "step_size",  # world x values of one step past max_step_values
    "counter",  # a counter scalar that is not finite, negative or past max_counter
    "name",  # a run or host name longer than MAX_NAME_BYTES
    "step_jump",  # a step implausibly far ahead of the run's recent steps
    "runs",  # a new run while the service keeps detectors.max_runs runs and none is stale
    "unknown_schema",  # a wire-v2 message whose schema did not arrive within the wait
    "names",  # a layer-names message past its bounds (names, families, lengths) or with a control character
    "auth",  # unsigned, badly signed, or signed with a key that may not speak for its run ([auth])
    "budget",  # a run past its record budget (detectors.run_record_budget)
)


class LimitError(RecordError):
    """A well-formed record claims more than the service accepts; ``reason`` is its dead-letter reason."""

    def __init__(self, field: str, problem: str, reason: str) -> None:
        super().__init__(field, problem)
        self.reason = reason


def reason_of(exc: BaseException) -> str:
    """The dead-letter reason of a decode error (one of :data:`DEAD_LETTER_REASONS`)."""
    if isinstance(exc, LimitError):
        return exc.reason
    if isinstance(exc, UnknownVersionError):
        return "unknown_version"
    return "malformed"


@dataclass(frozen=True)
class RecordLimits:
    """Bounds on one record's claims; the defaults fit a 100,000-rank job."""

    max_world: int = 131_072
    """Largest world size a record may claim (2**17: a 100,000-rank job fits)."""
    max_layer_metrics: int = 32
    """Most per-layer metrics in one record (sdcwatch's probes send 7)."""
    max_layers: int = 1024
    """Longest per-layer vector (layers of the model)."""
    max_values: int = 8192
    """Most values in one record: scalars plus every layer value."""
    max_step_values: int = 1 << 25
    """Most values one step may hold, world x values per rank (33.5 M: 100,000 ranks x 335 values);
    this bounds the memory of one step's frame (8 bytes a value) and of the detectors' work on it."""
    max_counter: float = 2.0**53
    """Largest value of a counter scalar (emitter_dropped); counters must also be finite and >= 0."""
    max_message_bytes: int = 16 << 20
    """Largest bus message decoded; a larger one is dead-lettered (truncated) without decoding."""
    max_step_jump: int = 100_000
    """Steps a record may lead its run's last closed step by; a step further ahead that no majority
    of the run's ranks confirms is dead-lettered (reason step_jump) instead of blinding the run."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check_number(f"limits.{f.name}", getattr(self, f.name), 0, lo_open=True)
        if self.max_world >= 1 << 32:
            raise ConfigError("limits.max_world", f"must be below 2**32 (the wire field), got {self.max_world}")
        if self.max_layers > 0xFFFF:
            raise ConfigError("limits.max_layers", f"must be at most 65535 (the wire field), got {self.max_layers}")

    def check_shape(self, layers: Sequence[tuple[str, int]], n_scalars: int) -> int:
        """The values of a record of this shape (``(layer metric, length)`` pairs and a number of
        scalars: a record's, or a v2 layout's); LimitError naming the first claim past a limit."""
        if len(layers) > self.max_layer_metrics:
            why = f"{len(layers)} layer metrics, the limit is {self.max_layer_metrics} (limits.max_layer_metrics)"
            raise LimitError("layers", why, "layer_metrics")
        for name, n in layers:
            if n > self.max_layers:
                why = f"{n} layers, the limit is {self.max_layers} (limits.max_layers)"
                raise LimitError(f"layers.{name}", why, "layers")
        values = n_scalars + sum(n for _, n in layers)
        if values > self.max_values:
            raise LimitError("record", f"{values} values, the limit is {self.max_values} (limits.max_values)", "values")
        return values

    def check(self, rec: Any) -> None:
        """Raise :class:`LimitError` naming the first claim of ``rec`` past a limit."""
        world = rec.world
        if world > self.max_world:
            raise LimitError(
                "world", f"{world} ranks claimed, the limit is {self.max_world} (limits.max_world)", "world"
            )
        values = self.check_shape([(name, len(vec)) for name, vec in rec.layers.items()], len(rec.scalars))
        if world * values > self.max_step_values:
            raise LimitError(
                "world",
                f"{world} ranks x {values} values = {world * values} values a step, the "
                f"limit is {self.max_step_values} (limits.max_step_values)",
                "step_size",
            )
        for dim, index in rec.coords.items():
            if index >= world:
                raise RecordError(
                    f"coords.{dim}", f"{index} out of range [0, {world}): no mesh dim outnumbers the ranks"
                )
        scalars = rec.scalars
        for name in COUNTER_SCALARS:
            v = scalars.get(name)
            if v is not None and not 0.0 <= v <= self.max_counter:  # NaN fails both comparisons
                raise LimitError(
                    f"scalars.{name}",
                    f"a counter must be finite, >= 0 and <= {self.max_counter:g}, got {v!r}",
                    "counter",
                )
