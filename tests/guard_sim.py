"""The guard tests' simulated job: a small GPT on every rank of one process, and its parameters flat.

Importable from every test folder (``pythonpath = ["tests"]`` in pyproject.toml); torch is imported
here, so import it after ``pytest.importorskip("torch")``.
"""

from __future__ import annotations

import torch
from sdcwatch.core.spike_baseline import SeriesSettings
from sdcwatch.telemetry.guard.config import GuardConfig
from sdcwatch.testbed.faultspec import FaultSpec
from sdcwatch.testbed.model import GPTConfig
from sdcwatch.testbed.simulated import SimulatedRun, shared_corpus

SMALL = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4)
ACT = GuardConfig(mode="act")
#: A tighter spike rule than the default (4 robust deviations, a loss 1.5 times its baseline), for
#: bad data early in training, when the loss still falls fast and random bytes are not yet twice it.
TIGHT = {"loss": SeriesSettings(z_on=4.0, min_ratio=1.5), "grad_norm": SeriesSettings(z_on=4.0, min_ratio=10.0)}


def sim(faults=(), guard=ACT, world=4, **kw) -> SimulatedRun:
    """A 4-rank simulated run of :data:`SMALL` with ``faults`` (FaultSpec dicts) and ``guard``."""
    return SimulatedRun(
        world=world,
        seed=1,
        model=SMALL,
        batch_size=2,
        corpus=shared_corpus(1 << 18),
        faults=[FaultSpec.from_dict(f) for f in faults],
        guard=guard,
        **kw,
    )


def flat(run) -> torch.Tensor:
    """Every parameter of the run's model, flattened into one tensor (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in run.params]).clone()
