"""The telemetry of a simulated ``tp x pp x dp`` job: :class:`ShardProbe` measures one replica's
forward pass as each (stage, tensor shard) sees it (see :mod:`sdcwatch.testbed.parallel3d`,
"Telemetry of a rank").
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from sdcwatch.telemetry.probes.canary import canary_running
from sdcwatch.telemetry.probes.checksum_bounds import abs_max, check_linear, check_matmul
from sdcwatch.telemetry.probes.residual_stream import peak
from sdcwatch.telemetry.probes.forward_order import NEAR_INF
from sdcwatch.testbed.shard_injector import ShardInjector
from sdcwatch.testbed.shard_plan import BLOCK as _BLOCK
from sdcwatch.testbed.shard_plan import ShardPlan
from torch import nn
from torch.nn import functional as F

__all__ = ["ShardProbe", "first_bad"]


def _tensor_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def first_bad(order: Sequence[tuple[int, torch.Tensor]]) -> int | None:
    """The smallest forward ordinal whose value is NaN, Inf or near-INF (None when none is): what a
    rank's probes send as ``nonfinite_first`` (:mod:`sdcwatch.telemetry.probes.forward_order`)."""
    bad = [n for n, v in order if not abs(float(v)) < NEAR_INF]
    return min(bad) if bad else None


class ShardProbe:
    """Per-rank metrics of one replica's forward pass, as each (stage, tensor shard) sees it.

    Hooks every module of the model. Before the injectors' hooks a module's clean output is kept;
    after them the probe knows whether a fault changed it and whose fault it was (the injectors'
    :class:`~sdcwatch.testbed.faults.Injection` log), and gives each piece its own view: its
    share of a sharded output; for a replicated output, the corrupted copy only to the rank whose
    fault it was; for a row-parallel product, its partial sum for the checksum.
    """

    def __init__(self, model: nn.Module, plan: ShardPlan, injectors: Sequence[ShardInjector]) -> None:
        self.plan = plan
        self.injectors = injectors
        self.layout = plan.layout
        self.tp, self.pp = plan.tp, plan.pp
        self.stage_leaves: list[list[str]] = [[] for _ in range(self.pp)]
        self.stage_products: list[list[str]] = [[] for _ in range(self.pp)]
        self._handles: list[Any] = []
        self._clean: dict[str, torch.Tensor] = {}
        products_mix: list[list[str]] = [[] for _ in range(self.pp)]
        for name, m in plan.modules.items():
            stage = plan.stage_of(name)
            if not name or stage is None:
                continue
            leaf = not any(True for _ in m.children())
            if leaf:
                self.stage_leaves[stage].append(name)
            if isinstance(m, nn.Linear):
                self.stage_products[stage].append(name)
            elif getattr(m, "_sdcwatch_gemm", False):
                products_mix[stage].append(name)  # after the linear layers, as the watch orders them
            self._handles.append(m.register_forward_hook(self._before(name), prepend=True))
            self._handles.append(m.register_forward_hook(self._after(name, stage, leaf)))
        for s in range(self.pp):
            self.stage_products[s] += products_mix[s]
        self._leaf_index = [{n: i for i, n in enumerate(ls)} for ls in self.stage_leaves]
        self._product_index = [{n: i for i, n in enumerate(ps)} for ps in self.stage_products]
        self.replica = 0
        self.checks = self.activations = False
        self._cursor = [0] * len(injectors)
        self.results: dict[int, list[dict[str, Any]]] = {}
        self._ordinal = 0
        self._private: tuple[int, set[int]] | None = None

    def begin(self, replica: int, *, checks: bool, activations: bool) -> None:
        """Start observing ``replica``'s pass (``checks``: checksum step; ``activations``: act_max step)."""
        self.replica, self.checks, self.activations = replica, checks, activations
        self._cursor = [len(inj.injections) for inj in self.injectors]
        tp = self.tp
        self.results[replica] = [
            {
                "stream": [None] * len(self.plan.stage_blocks[k // tp]),
                "logit": [None] * len(self.plan.stage_blocks[k // tp]),
                "logit_low": [None] * len(self.plan.stage_blocks[k // tp]),
                "out": [None] * len(self.stage_products[k // tp]),
                "fwd": [None] * len(self.stage_products[k // tp]),
                "in": [None] * len(self.stage_products[k // tp]),
                "act": [],
                "order": [],  # (forward ordinal, value) of every every-step observation
            }
            for k in range(self.pp * tp)
        ]
        self._ordinal = 0
        self._private: tuple[int, set[int]] | None = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _before(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            t = _tensor_of(output)
            if t is not None and not canary_running():
                self._clean[name] = t
            return None

        return hook

    def _culprits(self, name: str) -> set[int]:
        """Tensor shards whose injector changed ``name``'s output in this pass."""
        out = set()
        for i, inj in enumerate(self.injectors):
            for rec in inj.injections[self._cursor[i] :]:
                if rec.target == name and rec.where == "output":
                    out.add(inj.shard)
        return out

    def _after(self, name: str, stage: int, leaf: bool) -> Callable:
        plan, tp = self.plan, self.tp

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            y = _tensor_of(output)
            if y is None or not y.is_floating_point() or not self.results or canary_running():
                return None
            clean = self._clean.pop(name, y)
            culprits = self._culprits(name) if clean is not y else set()
            res = self.results[self.replica]
            owner = plan.output_owner(name)
            row = plan.row_parallel(name)
            layer = plan.local_layer(name)
            scores = name.endswith("attn.scores") and layer >= 0
            block = bool(_BLOCK.match(name)) and name.count(".") == 1
            product = name in self._product_index[stage]
            if scores or block or product:  # an every-step observation: the next forward ordinal
                ordinal, self._ordinal = self._ordinal, self._ordinal + 1
            # shards whose own copy of the stream is still clean although the one simulated copy
            # carries another shard's fault on a replicated output (until the next all-reduce)
            private = self._private
            clean_copy = set(range(tp)) - private[1] if private is not None and private[0] == stage else set()
            with torch.no_grad():
                for t in range(tp):
                    r = res[stage * tp + t]
                    order = r["order"] if t not in clean_copy else []  # no bad value of its own yet
                    # what this rank holds of the output
                    if owner is not None and tp > 1:
                        dim, own = owner
                        mine = y.detach().index_select(dim % y.dim(), (own == t).nonzero().reshape(-1))
                    elif t in culprits or not culprits or row is not None:
                        mine = y.detach()  # its own copy, or the all-reduced output everyone holds
                    else:
                        mine = clean.detach()  # another rank's copy was hit, not this one
                    if leaf and self.activations:
                        v = mine.nan_to_num(nan=math.nan, posinf=math.inf, neginf=0.0).abs().amax().float()
                        r["act"].append((self._leaf_index[stage][name], layer, v))
                    if scores:  # its own heads' logits
                        m = mine.amax().float()
                        old = r["logit"][layer]
                        r["logit"][layer] = m if old is None else torch.maximum(old, m)
                        low = mine.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amin().float()
                        old = r["logit_low"][layer]
                        r["logit_low"][layer] = low if old is None else torch.minimum(old, low)
                        order.append((ordinal, torch.maximum(m.abs(), low.abs())))
                    if block:  # a block's output: the residual stream
                        m = peak(mine)
                        old = r["stream"][layer]
                        r["stream"][layer] = m if old is None else torch.maximum(old, m)
                        order.append((ordinal, m))
                    if product:  # its share of the product, before any all-reduce
                        order.append((ordinal, self._product(r, stage, name, module, args, y, clean, t, t in culprits)))
            if culprits and owner is None and row is None:
                self._private = (stage, culprits)  # a replicated output hit in its culprits' copy only
            elif private is not None and (private[0] != stage or (row is not None and not peak(y) < NEAR_INF)):
                # a row-parallel all-reduce that carries a bad value hands it to every shard's copy of the
                # residual stream (one that carries none leaves the culprits' copies bad and the others
                # clean: nothing else joins them), and the next stage starts from what it is sent
                self._private = None
            return None

        return hook

    def _product(
        self,
        r: dict,
        stage: int,
        name: str,
        module: nn.Module,
        args: Any,
        y: torch.Tensor,
        clean: torch.Tensor,
        t: int,
        culprit: bool,
    ) -> torch.Tensor:
        """Shard ``t``'s share of product ``name``: the largest |row sum| of its output every step
        (``gemm_out``, returned for this call), the forward checksum and the largest |input| on
        checked steps."""
        plan = self.plan
        i = self._product_index[stage][name]
        share = plan.share(name, t)
        if isinstance(module, nn.Linear):
            b = None if module.bias is None else module.bias.detach()
            x, w, b = share.linear(args[0].detach(), module.weight.detach(), b)
            if share.cols is not None:  # its partial sum, before the all-reduce (bias added after)
                out = F.linear(x, w)
                if culprit:  # this rank's partial sum is where the fault was
                    out = out + (y.detach() - clean.detach())
            else:  # its output features (all of a replicated layer's)
                out = share.outputs(y.detach())
            check = (lambda: check_linear(x, w, out, b)) if self.checks else None
        else:  # the attention mix: probs @ v, heads split
            a, v = share.matmul(args[0].detach(), args[1].detach())
            out = share.outputs(y.detach())
            x = a
            check = (lambda: check_matmul(a, v, out)) if self.checks else None
        values = {"out": out.sum(-1).abs().amax().float()}
        if check is not None:
            values["fwd"], values["in"] = check().float(), abs_max(x).float()
        for key, value in values.items():
            old = r[key][i]
            r[key][i] = value if old is None else torch.maximum(old, value)
        return values["out"]
