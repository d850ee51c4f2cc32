"""Synthetic data-parallel runs for detector tests: the testbed's synthetic steps
(:mod:`sdcwatch.testbed.synthetic_steps`) with seeded faults injected by family; the families match
the detectors' ``fault`` attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import STEP_SCALARS
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.testbed.synthetic_steps import FPS, LAYERS, draw_step, step_frame

SCALARS = STEP_SCALARS
FAMILIES = (
    "nonfinite",
    "loss_spike",
    "grad_spike",
    "rank_shift",
    "rank_gross",
    "replica",
    "straggler",
    "missing",
    "guard_action",
    "checksum",
    "lr_jump",
)


@dataclass
class Fault:
    family: str
    step: int
    rank: int = 3
    layer: int = 1
    length: int = 1_000_000  # steps the fault lasts (persistent families); spikes are one step

    def active(self, step: int) -> bool:
        return self.step <= step < self.step + self.length


@dataclass
class SyntheticRun:
    world: int = 8
    n_layers: int = 4
    seed: int = 0
    run: str = "synth"
    ranks_per_host: int = 4
    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hosts = tuple(f"node{r // self.ranks_per_host}" for r in range(self.world))

    def frame(self, step: int) -> StepFrame:
        S, lay, fp = draw_step(np.random.default_rng([self.seed, step]), step, self.world, self.n_layers)
        present = np.ones(self.world, bool)
        names = SCALARS
        for f in self.faults:
            if f.family in ("nonfinite", "loss_spike", "grad_spike", "guard_action", "checksum", "lr_jump"):
                if step != f.step:
                    continue
            elif not f.active(step):
                continue
            if f.family == "nonfinite":
                lay[f.rank, LAYERS.index("attn_logit_max"), f.layer] = np.inf
            elif f.family == "loss_spike":  # a bad batch on all ranks: optimisation/data
                S[:, 0] *= 1.8
                S[:, 1:3] *= 3.0
            elif f.family == "lr_jump":  # a one-step x10 learning rate on every rank
                S[:, SCALARS.index("lr")] *= 10.0
            elif f.family == "checksum":  # a flipped bit in one product of one rank: 40 x its rounding bound
                lay[f.rank, LAYERS.index("gemm_fwd"), f.layer] = 40.0
            elif f.family == "grad_spike":
                S[:, 1:3] *= 8.0
            elif f.family == "rank_shift":  # an unhealthy rank: its q norms drift by ~3 sigma
                lay[f.rank, LAYERS.index("q_norm_mean"), f.layer] *= 1.03
                lay[f.rank, LAYERS.index("q_norm_max"), f.layer] *= 1.03
            elif f.family == "rank_gross":  # a badly broken rank: attention statistics far off
                lay[f.rank, 1:4, :] *= 1.25
                lay[f.rank, 0, :] *= 0.8
            elif f.family == "replica":
                fp[f.rank, 0] ^= np.uint64(1 << 17)
            elif f.family == "straggler":
                S[f.rank, 4] *= 2.5
            elif f.family == "missing":
                present[f.rank] = False
            elif f.family == "guard_action":  # the job's guard skipped this step (rerun: data)
                names = (*names, "guard_action", "guard_reason", "guard_verdict", "guard_rank")
                S = np.column_stack([S, np.full((self.world, 4), (1.0, 2.0, 3.0, float(f.rank)))])
        S[~present] = np.nan
        lay[~present] = np.nan
        return step_frame(self.run, step, self.hosts, S, lay, fp, present, names)

    def records(self, step: int) -> list[Record]:
        f = self.frame(step)
        out = []
        for r in np.flatnonzero(f.present):
            out.append(
                Record(
                    run=self.run,
                    step=step,
                    rank=int(r),
                    world=self.world,
                    host=self.hosts[r],
                    time=1e9 + step,
                    local_rank=int(r) % self.ranks_per_host,
                    scalars={n: float(v) for n, v in zip(f.scalar_names, f.scalars[r])},
                    fingerprints={n: int(v) for n, v in zip(FPS, f.fingerprints[r])},
                    layers={n: tuple(float(x) for x in f.layers[r, i]) for i, n in enumerate(LAYERS)},
                )
            )
        return out


def findings_key(findings) -> list[tuple]:
    """A comparable form of findings (for determinism and snapshot tests)."""
    return [(f.detector, f.kind, f.step, f.ranks, f.metric, f.layer, round(float(f.score), 9)) for f in findings]
