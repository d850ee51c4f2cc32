"""sdcwatch in the training frameworks people use: one callback each, a few lines for the user.

    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback          # transformers.Trainer
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback   # lightning.Trainer

Each module imports its framework when it is imported, never before: install the extras
``sdcwatch[hf]`` or ``sdcwatch[lightning]``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["open_emitter"]


def open_emitter(emitter: Any, rank: int, world: int) -> tuple[Any, bool]:
    """The emitter a callback reports to, and whether the callback owns it (closes it at the end).

    ``None`` builds the default :class:`~sdcwatch.telemetry.Emitter` (Kafka at
    ``$SDCWATCH_BOOTSTRAP``, run ``$SDCWATCH_RUN``) with the framework's rank and world size.
    """
    if emitter is not None:
        return emitter, False
    from sdcwatch.telemetry.emitter import Emitter

    return Emitter(rank=rank, world=world), True
