"""The guard tests' simulated job: a small GPT on every rank of one process, and its parameters flat.

Importable from every test folder (``pythonpath = ["tests"]`` in pyproject.toml); torch is imported
here, so import it after ``pytest.importorskip("torch")``.
"""

from __future__ import annotations

import torch
from sdcwatch.telemetry.guard.config import GuardConfig
from sdcwatch.testbed.faultspec import FaultSpec
from sdcwatch.testbed.model import GPTConfig
from sdcwatch.testbed.simulated import SimulatedRun, shared_corpus

SMALL = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4)
ACT = GuardConfig(mode="act")


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
