"""Healthy synthetic steps for the detector and ingest benchmarks (and the split benchmark, through
``bench_detectors``): what W ranks' probes report at one step, as arrays.

A rank reports 8 scalars and 4 per-layer metrics x L layers (32 metric values at L = 6, the size
the targets name) and 2 fingerprints. The values are those of a healthy data-parallel job: the
global gradient norm and the fingerprints are the same on every rank, the rest vary a little
with each rank's data. The detector tests have their own generator
(``tests/detector_synth.py``): a decaying loss, checksum ratios and seeded faults,
which a throughput benchmark does not need.
"""

from __future__ import annotations

import numpy as np
from sdcwatch.core.vocabulary import STEP_SCALARS

__all__ = ["FPS", "LAYERS", "SCALARS", "fingerprints", "healthy_values"]

LAYERS = ("attn_entropy", "q_norm_mean", "k_norm_mean", "attn_logit_max")
FPS = ("param_fp", "grad_fp")
SCALARS = STEP_SCALARS


def healthy_values(rng: np.random.Generator, world: int, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """One step's (scalars, layers) of every rank, drawn from ``rng``: float64 arrays of shape
    (world, len(SCALARS)) and (world, len(LAYERS), n_layers)."""
    g = 1.0 + 0.1 * abs(rng.standard_normal())
    scalars = np.column_stack(
        [
            3.0 * (1 + 0.02 * rng.standard_normal(world)),
            g * (1 + 0.05 * rng.standard_normal(world)),
            np.full(world, g),
            0.9 + 0.01 * rng.standard_normal(world),
            0.5 * (1 + 0.02 * rng.standard_normal(world)),
            np.zeros(world),
            np.full(world, 3e-4),
            np.zeros(world),
        ]
    )
    layers = np.array([3.0, 12.0, 11.0, 8.0])[None, :, None] * (
        1 + 0.01 * rng.standard_normal((world, len(LAYERS), n_layers))
    )
    return scalars, layers


def fingerprints(world: int, step: int) -> np.ndarray:
    """The step's fingerprints, identical on every rank (healthy replicas): (world, len(FPS)) uint64."""
    return np.full((world, len(FPS)), step * 7919 + 1, np.uint64)
