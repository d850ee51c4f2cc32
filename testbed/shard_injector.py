"""The fault injector of one (pipeline stage, tensor shard) of a simulated ``tp x pp x dp`` job:
:class:`ShardInjector` (see :mod:`sdcwatch.testbed.parallel3d`, "Faults keep their meaning"), and
the campaigns' :class:`BoundedShardInjector`, whose one-element injections carry the bound of the
checksum that covers the tensor they hit in the rank's own share (:mod:`sdcwatch.testbed.fault_bounds`).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from sdcwatch.testbed.fault_bounds import BoundedInjector, Share
from sdcwatch.testbed.faults import FaultInjector
from sdcwatch.testbed.faultspec import FaultSpec
from sdcwatch.testbed.shard_plan import ShardPlan

__all__ = ["ShardInjector", "BoundedShardInjector"]


class ShardInjector(FaultInjector):
    """The injector of the ranks at one (stage, tensor shard): it hooks the stage's modules only
    and corrupts a sharded tensor only in the shard's part (one element drawn there; noise and
    scale on the shard's part alone)."""

    def __init__(self, faults: Iterable[FaultSpec], plan: ShardPlan, stage: int, shard: int) -> None:
        super().__init__(faults, rank=0)
        self.plan, self.stage, self.shard = plan, stage, shard

    def attach_stage(self) -> "ShardInjector":
        return self.attach(self.plan.stage_view(self.stage))  # type: ignore[arg-type]

    def _owner(self, name: str, where: str) -> tuple[int, torch.Tensor] | None:
        return self.plan.param_owner(name) if where in ("grad", "param") else self.plan.output_owner(name)

    def _transform(self, i: int, spec: FaultSpec, x: torch.Tensor, name: str, rng: Any):
        mask = self.plan.mask(self._owner(name, spec.where), tuple(x.shape), self.shard)
        if mask is None or spec.kind not in ("noise", "scale"):
            return super()._transform(i, spec, x, name, rng)
        changed = super()._transform(i, spec, x, name, rng)
        return torch.where(mask.to(x.device), changed, x)

    def _pick(self, spec: FaultSpec, t: torch.Tensor, name: str, rng: Any) -> int:
        """An element of the rank's own shard of ``t`` (any element of a replicated tensor)."""
        mask = self.plan.mask(self._owner(name, spec.where), tuple(t.shape), self.shard)
        if mask is None:
            return rng.randrange(t.numel())
        allowed = mask.reshape(-1).nonzero().reshape(-1)
        return int(allowed[rng.randrange(allowed.numel())])


class BoundedShardInjector(ShardInjector, BoundedInjector):
    """A :class:`ShardInjector` whose one-element injections are
    :class:`~sdcwatch.testbed.fault_bounds.CoveredInjection` s: the bound of the check of the
    rank's own share of the product (:meth:`ShardPlan.share`), as a tensor-parallel rank checks
    its part. Same faults, same elements, same values as :class:`ShardInjector`."""

    def _share(self, module: str) -> Share:
        return self.plan.share(module, self.shard)
