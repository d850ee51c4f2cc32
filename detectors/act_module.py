"""The module of an ``act_max`` value: where a rank's largest leaf-module output came from.

A record's ``act_max`` is the largest |output| of every leaf module on a sampled step; two
scalars beside it say where it was made: ``act_max_module``, an index into the rank's leaf-module
names (the ``modules`` family of its names message, :mod:`sdcwatch.core.rank_notes`), and
``act_max_layer``, the attention layer whose block holds that module. A non-finite ``act_max``
is placed in its layer and carries its module, so the service can name the very module whose
output went bad (``act_max of model.layers.1.mlp.down_proj (layer 1)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sdcwatch.detectors.frame import StepFrame

__all__ = ["act_layer", "act_modules", "listed_hit"]

MODULE = "act_max_module"


def act_layer(frame: StepFrame, S: np.ndarray, rank: int, column: int) -> int | None:
    """The layer of an ``act_max`` hit, from the rank's ``act_max_layer`` (None for other scalars)."""
    names = frame.scalar_names
    if names[column] != "act_max" or "act_max_layer" not in names:
        return None
    layer = S[rank, names.index("act_max_layer")]
    return int(layer) if np.isfinite(layer) and layer >= 0 else None


def act_modules(frame: StepFrame, ranks: set[int]) -> list[list[int]]:
    """[[rank, module]] of ``ranks``: the leaf module (an index into the rank's module names) whose
    output was the rank's ``act_max``, from its ``act_max_module`` (ranks without one are left out)."""
    return [[r, int(v)] for r, v in frame.sent_positions(MODULE, ranks, 1 << 31)]


def listed_hit(h: tuple[int, str, int | None, float], modules: dict[int, int]) -> dict[str, Any]:
    """A listed hit; an ``act_max`` hit carries the leaf module it came from, when the rank sent it."""
    module = modules.get(h[0]) if h[1] == "act_max" else None
    return {
        "rank": h[0],
        "metric": h[1],
        "layer": h[2],
        "value": h[3],
        **({"module": module} if module is not None else {}),
    }
