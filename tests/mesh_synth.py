"""A synthetic 3D-parallel run for detector tests: ``tp x pp x dp`` ranks as plain records.

Ranks are numbered as :class:`~sdcwatch.core.mesh.Layout` numbers them (pipeline outermost, tensor
parallel fastest), and each record carries its rank's coordinates. What each rank reports differs by its tensor and pipeline coordinates the way a real
job's does: only the last stage has the loss, gradient norms and attention statistics are those
of the rank's own shard and layers, the last stage is slower, checksum residuals depend on the
shard's matrix sizes, parameter fingerprints are those of the shard (equal across data-parallel
replicas). Healthy data-parallel replicas of one piece agree in distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from sdcwatch.core.mesh import DIMS, Layout
from sdcwatch.core.record_type import Record
from sdcwatch.detectors.frame import StepFrame

SCALARS = ("loss", "grad_norm_local", "grad_norm_global", "grad_cosine", "step_time", "nonfinite", "lr")
LAYERS = ("attn_entropy", "q_norm_mean", "q_norm_max", "k_norm_mean", "attn_logit_max", "gemm_fwd")
FPS = ("param_fp", "grad_fp")


@dataclass
class MeshFault:
    family: str  # rank_shift, nonfinite, replica, straggler, missing, checksum_outlier
    step: int
    rank: int
    layer: int = 1


@dataclass
class MeshRun:
    tp: int = 2
    pp: int = 2
    dp: int = 4
    n_layers: int = 2  # layers per pipeline stage
    seed: int = 0
    run: str = "mesh"
    ranks_per_host: int = 4
    faults: list[MeshFault] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout(self) -> Layout:
        return Layout({"tp": self.tp, "pp": self.pp, "dp": self.dp})

    def coords(self, rank: int) -> dict[str, int]:
        """{dim: index} of ``rank``."""
        return self.layout.coords(rank)

    def rank_of(self, *, tp: int, pp: int, dp: int) -> int:
        return self.layout.rank_of({"tp": tp, "pp": pp, "dp_replicate": dp})

    def coord_array(self) -> np.ndarray:
        """(world, mesh dims) coordinates, -1 for the dims this layout does not have."""
        a = np.full((self.world, len(DIMS)), -1, np.int64)
        for r in range(self.world):
            for d, v in self.coords(r).items():
                a[r, DIMS.index(d)] = v
        return a

    def host(self, rank: int) -> str:
        return f"node{rank // self.ranks_per_host}"

    def records(self, step: int) -> list[Record]:
        rng = np.random.default_rng([self.seed, step])
        W, L = self.world, self.n_layers
        c = self.coord_array()
        tp, pp = c[:, DIMS.index("tp")], c[:, DIMS.index("pp")]
        dp = c[:, DIMS.index("dp_replicate")]
        last = pp == self.pp - 1
        g = 1.0 + 0.1 * abs(rng.standard_normal())
        level = 2.5 + 8.0 * np.exp(-step / 300.0)
        loss = level * (1 + 0.02 * rng.standard_normal(W))
        shard = 0.5 + 0.3 * tp + 0.6 * pp  # each shard's share of the gradient
        gl = g * shard * (1 + 0.05 * rng.standard_normal(W))
        cosine = 0.7 + 0.1 * pp + 0.01 * rng.standard_normal(W)
        step_time = 0.5 * (1 + 0.4 * last) * (1 + 0.02 * rng.standard_normal(W))
        base = np.array([3.0, 12.0, 30.0, 11.0, 8.0])[None, :, None] * (1 + 0.5 * pp + 0.25 * tp)[:, None, None]
        lay = base * (1 + 0.01 * rng.standard_normal((W, 5, L)))
        # checksum residuals: the shard's matrix sizes set their scale (tp 0 ~1e-9, tp 1 ~1e-5)
        gemm = (1e-9 * 1e4**tp)[:, None] * np.exp(0.5 * rng.standard_normal((W, L)))
        fp = np.array(
            [
                [(step * 0x9E3779B97F4A7C15 + 1000 * int(t) + 7 * int(p) + k) % (1 << 64) for k in range(2)]
                for t, p in zip(tp, pp)
            ],
            dtype=np.uint64,
        )
        glob = np.full(W, g)
        present = np.ones(W, bool)
        nonfinite = np.zeros(W)
        for f in self.faults:
            if f.family in ("nonfinite", "replica", "checksum_outlier") and step != f.step:
                continue
            if step < f.step:
                continue
            r = f.rank
            if f.family == "rank_shift":  # an unhealthy rank: its q norms drift by ~3 sigma
                lay[r, 1:3, f.layer] *= 1.03
            elif f.family == "nonfinite":  # a NaN in one rank's attention: the later stages of its
                lay[r, 4, f.layer] = np.inf  # pipeline receive it forward, every stage's gradients
                for q in np.flatnonzero(dp == dp[r]):  # backward, the all-reduce spreads it
                    gl[q] = np.nan
                    if pp[q] > pp[r]:
                        lay[q, :, :] = np.nan
                        loss[q] = np.nan
                glob[:] = np.nan
                nonfinite[:] = 1.0
            elif f.family == "replica":
                fp[r, 0] ^= np.uint64(1 << 17)
            elif f.family == "straggler":
                step_time[r] *= 2.5
            elif f.family == "missing":
                present[r] = False
            elif f.family == "checksum_outlier":  # far above its peers, under the rounding bound
                gemm[r, f.layer] = 5e-2
        out = []
        for r in np.flatnonzero(present).tolist():
            scalars = {
                "grad_norm_local": float(gl[r]),
                "grad_norm_global": float(glob[r]),
                "grad_cosine": float(cosine[r]),
                "step_time": float(step_time[r]),
                "nonfinite": float(nonfinite[r]),
                "lr": 3e-4,
            }
            if last[r]:
                scalars = {"loss": float(loss[r]), **scalars}
            layers = {n: tuple(float(x) for x in lay[r, i]) for i, n in enumerate(LAYERS[:5])}
            layers["gemm_fwd"] = tuple(float(x) for x in gemm[r])
            out.append(
                Record(
                    run=self.run,
                    step=step,
                    rank=r,
                    world=W,
                    host=self.host(r),
                    time=1e9 + step,
                    local_rank=r % self.ranks_per_host,
                    scalars=scalars,
                    fingerprints={n: int(v) for n, v in zip(FPS, fp[r])},
                    layers=layers,
                    coords=self.coords(r),
                )
            )
        return out

    def frame(self, step: int) -> StepFrame:
        """The step's frame (the ranks' coordinates come with their records)."""
        return StepFrame.from_records(self.run, step, self.world, self.records(step))
