"""Synthetic data-parallel steps without training: every rank's statistics of one step drawn at once
(same distribution on every rank, replicated values identical), so detector tests and the fleet
campaign cost a millisecond a step; callers inject their faults into the arrays before framing them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from sdcwatch.core.vocabulary import STEP_SCALARS
from sdcwatch.detectors.frame import StepFrame

__all__ = ["FPS", "LAYERS", "draw_step", "step_frame"]

#: The per-layer statistics of a synthetic step: attention statistics, then two checksum ratios.
LAYERS = ("attn_entropy", "q_norm_mean", "q_norm_max", "k_norm_mean", "attn_logit_max", "gemm_fwd", "gemm_bwd")
FPS = ("param_fp", "grad_fp")
_LAYER_BASE = np.array([3.0, 12.0, 30.0, 11.0, 8.0, 1.0, 1.0])


def draw_step(rng: np.random.Generator, step: int, world: int, n_layers: int) -> tuple[np.ndarray, ...]:
    """One clean step: the ranks' scalars (``STEP_SCALARS`` columns: loss decaying with ``step``, one
    global gradient norm, ...), layer statistics (world, ``LAYERS``, layers; checksum ratios are rounding
    residuals over their bound, log-normal around 1e-4) and fingerprints (the same on every rank)."""
    loss = (2.5 + 8.0 * np.exp(-step / 300.0)) * (1 + 0.02 * rng.standard_normal(world))
    g = 1.0 + 0.1 * abs(rng.standard_normal())
    scalars = np.empty((world, len(STEP_SCALARS)))
    scalars[:, 0], scalars[:, 1], scalars[:, 2] = loss, g * (1 + 0.05 * rng.standard_normal(world)), g
    scalars[:, 3] = 0.9 + 0.01 * rng.standard_normal(world)
    scalars[:, 4] = 0.5 * (1 + 0.02 * rng.standard_normal(world))
    scalars[:, 5], scalars[:, 6], scalars[:, 7] = 0.0, 3e-4, 0.0
    layers = _LAYER_BASE[None, :, None] * (1 + 0.01 * rng.standard_normal((world, len(LAYERS), n_layers)))
    layers[:, 5:7, :] = 1e-4 * np.exp(rng.standard_normal((world, 2, n_layers)))
    fingerprints = np.full((world, len(FPS)), (step * 0x9E3779B97F4A7C15 + 12345) % (1 << 64), dtype=np.uint64)
    return scalars, layers, fingerprints


def step_frame(
    run: str,
    step: int,
    hosts: Sequence[str],
    scalars: np.ndarray,
    layers: np.ndarray,
    fingerprints: np.ndarray,
    present: np.ndarray | None = None,
    scalar_names: Sequence[str] = STEP_SCALARS,
) -> StepFrame:
    """The frame of a drawn (and faulted) step; ``present``: the ranks that sent it (default all)."""
    world = len(hosts)
    present = np.ones(world, bool) if present is None else present
    return StepFrame(
        run=run,
        step=step,
        world=world,
        hosts=tuple(hosts),
        present=present,
        scalar_names=tuple(scalar_names),
        scalars=scalars,
        layer_names=LAYERS,
        layers=layers,
        fp_names=FPS,
        fingerprints=fingerprints,
        fp_present=np.broadcast_to(present[:, None], fingerprints.shape).copy(),
        complete=bool(present.all()),
    )
