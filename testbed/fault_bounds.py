"""What a checksum could see of a fault: the injector of the campaigns, which records with each
one-element fault the rounding bound of the check that covers the tensor it hit.

A fault is *detectable* when its change exceeds that bound: a property of the fault alone, not of
the probes' sampling. :class:`BoundedInjector` computes the bound at injection time, from the
tensors its hooks see, with the bound functions below (as numbers, the bounds the checks of
:mod:`sdcwatch.telemetry.probes.checksum_bounds` hold their residuals to), on every step a fault
fires, checked by the probes or not:

* a linear layer's output (``nn.Linear``): :func:`linear_bound` of
  the call's input, weight and bias (the forward checksum, ``gemm_fwd``);
* a product module's output (``_sdcwatch_gemm``, ``forward(a, b) = a @ b``):
  :func:`matmul_bound` of ``a`` and ``b``;
* a linear layer's weight or bias gradient: :func:`weight_grad_bound`
  or :func:`bias_grad_bound` of the layer's input and output gradient
  in that backward (``gemm_bwd``; the injector keeps them for the fault's rank and step only);
* a linear layer's weight or bias in memory: :func:`memory_bound` of
  the tensor as it was before the fault (``gemm_weight``).

Any other tensor (a block's or a layer norm's output, the attention logits, an embedding, the
gradient of a weight shared by several modules, which is a sum over uses) is covered by no
checksum: its injections carry ``check=None``.

**A rank checks its own share.** Under tensor parallelism a rank computes a part of each product
(:class:`Share`: some output features of a column-parallel layer, a partial sum over some input
features of a row-parallel one, some attention heads), and its checksums cover that part only: the
bound is that of the check of the rank's share, from the same tensors restricted to it. An
injector says which share its rank holds of a module (:meth:`BoundedInjector._share`, all of it
here; the simulated 3D ranks' injector, :class:`~sdcwatch.testbed.shard_injector.BoundedShardInjector`,
asks the layout). The cost stays here: the training path's injector
(:class:`~sdcwatch.testbed.faults.FaultInjector`) computes nothing of this, and the time spent
counts as the fault's (``cpu_seconds``), not the rank's.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from sdcwatch.telemetry.probes.checksum_bounds import (
    TINY,
    accumulated_sum,
    accumulation_dtype,
    bias_grad_coefficient,
    grad_reference,
    linear_check_bound,
    matmul_check_bound,
    memory_bound_of,
    product_dtype,
    underflow_floor,
    weight_grad_check_bound,
)
from sdcwatch.testbed.faults import FaultInjector, Injection
from sdcwatch.testbed.faultspec import ELEMENT_KINDS, FaultSpec
from torch import nn

__all__ = [
    "BoundedInjector",
    "CoveredInjection",
    "Share",
    "WHOLE",
    "bias_grad_bound",
    "linear_bound",
    "matmul_bound",
    "memory_bound",
    "weight_grad_bound",
]


# -- the bounds as numbers: how large a change of one element each check is sure to see


@torch.no_grad()
def linear_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> float:
    """The absolute bound ``check_linear`` holds the row sums of ``y = x weight^T + bias`` to."""
    return float(linear_check_bound(x, weight, bias, out_dtype))


@torch.no_grad()
def matmul_bound(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> float:
    """The absolute bound ``check_matmul`` holds the row sums of ``a @ b (+ bias)`` to."""
    return float(matmul_check_bound(a, b, out_dtype, bias))


@torch.no_grad()
def weight_grad_bound(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> float:
    """The absolute bound ``check_weight_grad`` holds the column sums of ``dw = dy^T x`` to."""
    _, _, dy_norm, tokens = grad_reference(x, dy)
    return float(weight_grad_check_bound(x, dy, dy_norm, tokens, dw))


@torch.no_grad()
def bias_grad_bound(dy: torch.Tensor, db: torch.Tensor) -> float:
    """The absolute bound of the bias gradient's check ``Σ db = Σ dY`` (``Σ|dY| <= sqrt(N m) ||dY||_F``)."""
    m = dy.shape[-1]
    dy2 = dy.reshape(-1, m)
    tokens = dy2.shape[0]
    out = product_dtype(db.dtype, dy.dtype)
    coef = bias_grad_coefficient(tokens, db.numel(), out)
    bound = torch.linalg.vector_norm(dy2, dtype=accumulation_dtype(dy.dtype)) * math.sqrt(tokens * m) * coef
    floor = underflow_floor(db.numel(), out)
    return float((bound + floor if floor else bound).clamp_min(TINY))


@torch.no_grad()
def memory_bound(t: torch.Tensor) -> float:
    """The absolute bound of the weight check: ``γ_m Σ_j ||w_j||`` for a (m, n) weight, ``γ_m Σ|b|``
    for a bias of m values."""
    acc = accumulation_dtype(t.dtype)
    if t.dim() == 2:
        return float(memory_bound_of(torch.linalg.vector_norm(t, dim=1, dtype=acc).sum(), t.shape[0]))
    return float(memory_bound_of(accumulated_sum(t.abs(), None, acc), t.numel()))


@dataclass(frozen=True)
class Share:
    """The part of a product one rank computes, and so the part its checksums cover (module
    docstring): of a linear layer ``y = x W^T + b``, the output features ``rows`` (rows of ``W``
    and ``b``) and the input features ``cols`` (columns of ``x`` and ``W``: a partial sum, its bias
    added after the all-reduce); of a product module's ``a @ b``, the positions ``batch = (dim,
    indices)`` of a batch dimension of both operands and of the output (attention heads). None:
    all of them."""

    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    batch: tuple[int, torch.Tensor] | None = None

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The share's input features of a linear layer's input."""
        return x if self.cols is None else x.index_select(-1, self.cols)

    def outputs(self, y: torch.Tensor) -> torch.Tensor:
        """The share's part of a product's output (of a column-parallel layer or a batch split; a
        partial sum is no part of ``y``: compute it from :meth:`inputs` and :meth:`weight`)."""
        if self.rows is not None:
            y = y.index_select(-1, self.rows)
        if self.batch is not None:
            y = y.index_select(self.batch[0], self.batch[1])
        return y

    def weight(self, t: torch.Tensor) -> torch.Tensor:
        """The share's part of a linear layer's weight (or its gradient); of a bias when 1-D (all
        of a row-parallel layer's bias, added after the all-reduce)."""
        if self.rows is not None:
            t = t.index_select(0, self.rows)
        if self.cols is not None and t.dim() == 2:
            t = t.index_select(1, self.cols)
        return t

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(x, w, b)`` of the share's product (no bias for a partial sum)."""
        return self.inputs(x), self.weight(w), None if b is None or self.cols is not None else self.weight(b)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)`` of the share's ``a @ b``."""
        if self.batch is None:
            return a, b
        dim, idx = self.batch
        return a.index_select(dim, idx), b.index_select(dim, idx)


#: The whole product: what a rank computes without tensor parallelism.
WHOLE = Share()


@dataclass
class CoveredInjection(Injection):
    """An :class:`~sdcwatch.testbed.faults.Injection` with the check that covers its tensor."""

    check: str | None = None
    """``gemm_fwd``, ``gemm_bwd`` or ``gemm_weight``; None when no checksum covers the tensor."""
    bound: float | None = None
    """That check's absolute rounding bound at the injection: a change above it breaks the check."""


def _covered(inj: Injection, check: str | None, bound: float | None) -> CoveredInjection:
    return CoveredInjection(**{f.name: getattr(inj, f.name) for f in fields(Injection)}, check=check, bound=bound)


class BoundedInjector(FaultInjector):
    """A :class:`~sdcwatch.testbed.faults.FaultInjector` whose one-element injections are
    :class:`CoveredInjection` s (module docstring). Same faults, same elements, same values."""

    def __init__(self, faults: Any = (), *, rank: int = 0) -> None:
        super().__init__(faults, rank=rank)
        # per linear layer under a gradient fault: (input, output gradient) of its last use in a
        # pass of the fault's rank and step (what the weight- and bias-gradient checks read)
        self._grad_context: dict[str, list[torch.Tensor | None]] = {}

    # -- wiring -------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: Any = None) -> "BoundedInjector":
        super().attach(model, optimizer)
        owners = {}
        for i, spec in enumerate(self.faults):
            if spec.where != "grad" or spec.kind not in ELEMENT_KINDS:
                continue
            for pname, _ in self._param_targets.get(i, ()):
                owner = pname.rpartition(".")[0]
                if isinstance(self._modules.get(owner), nn.Linear):
                    owners.setdefault(owner, []).append(spec)
        for owner, specs in owners.items():
            hook = functools.partial(self._keep_grad_context, owner, specs)
            self._handles.append(self._modules[owner].register_forward_hook(hook))
        return self

    def _keep_grad_context(self, owner: str, specs: list[FaultSpec], module: nn.Module, args: Any, output: Any) -> None:
        """On a pass of a gradient fault's rank and step: keep the layer's input, and its output
        gradient when the backward computes it (it comes before the weight's gradient)."""
        if not any(s.hits(self.step, self.rank) for s in specs):
            return
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        t0 = time.thread_time()
        context: list[torch.Tensor | None] = [x.detach(), None]
        self._grad_context[owner] = context

        def keep(dy: torch.Tensor) -> None:
            context[1] = dy.detach()

        output.register_hook(keep)
        self.cpu_seconds += time.thread_time() - t0

    # -- the bounds ---------------------------------------------------------------------------------
    def _share(self, module: str) -> Share:
        """The share of module ``module``'s product this injector's rank computes (all of it)."""
        return WHOLE

    def _bounded(self, start: int, covering: Callable[[], tuple[str | None, float | None]]) -> None:
        """Give the one-element injections recorded from ``start`` on the check ``covering()`` names."""
        new = [k for k in range(start, len(self.injections)) if self.injections[k].index is not None]
        if not new:
            return
        t0 = time.thread_time()
        check, bound = covering()
        for k in new:
            self.injections[k] = _covered(self.injections[k], check, bound)
        self.cpu_seconds += time.thread_time() - t0

    def _output_hook(self, i: int, spec: FaultSpec, name: str):
        inner = super()._output_hook(i, spec, name)

        def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
            start = len(self.injections)
            out = inner(module, inputs, output)
            if len(self.injections) > start:
                self._bounded(start, lambda: _forward_cover(module, inputs, output, self._share(name)))
            return out

        return hook

    def _grad_hook(self, i: int, spec: FaultSpec, pname: str):
        inner = super()._grad_hook(i, spec, pname)
        owner, _, which = pname.rpartition(".")

        def hook(grad: torch.Tensor) -> Any:
            start = len(self.injections)
            out = inner(grad)
            if len(self.injections) > start:
                self._bounded(start, lambda: self._grad_cover(owner, which, grad))
            return out

        return hook

    def _grad_cover(self, owner: str, which: str, grad: torch.Tensor) -> tuple[str | None, float | None]:
        module = self._modules.get(owner)
        context = self._grad_context.pop(owner, None)
        if not isinstance(module, nn.Linear) or _shared(module, self._modules) or context is None:
            return None, None
        x, dy = context
        if dy is None:
            return None, None
        share = self._share(owner)
        dy = share.outputs(dy)  # the gradient of its output features
        if which == "weight":
            return "gemm_bwd", weight_grad_bound(share.inputs(x), dy, share.weight(grad))
        return "gemm_bwd", bias_grad_bound(dy, share.weight(grad))

    def _apply(self, i: int, spec: FaultSpec, t: torch.Tensor, name: str, rng: Any) -> None:
        start = len(self.injections)
        cover: tuple[str | None, float | None] = (None, None)
        if spec.where == "param":  # the bound of the weight as the optimizer left it, before the fault
            owner = name.rpartition(".")[0]
            if isinstance(self._modules.get(owner), nn.Linear) and t.dim() in (1, 2):
                cover = ("gemm_weight", memory_bound(self._share(owner).weight(t)))
        super()._apply(i, spec, t, name, rng)
        if spec.where == "param":
            self._bounded(start, lambda: cover)


def _forward_cover(module: nn.Module, inputs: Any, output: Any, share: Share) -> tuple[str | None, float | None]:
    """The forward checksum covering ``module``'s output, and its bound for this call, of ``share``."""
    y = output[0] if isinstance(output, (tuple, list)) and output else output
    if not isinstance(y, torch.Tensor) or not inputs or not isinstance(inputs[0], torch.Tensor):
        return None, None
    if isinstance(module, nn.Linear):
        bias = module.bias if isinstance(module.bias, torch.Tensor) else None
        return "gemm_fwd", linear_bound(*share.linear(inputs[0], module.weight, bias), y.dtype)
    if getattr(module, "_sdcwatch_gemm", False) and len(inputs) >= 2 and isinstance(inputs[1], torch.Tensor):
        return "gemm_fwd", matmul_bound(*share.matmul(inputs[0], inputs[1]), y.dtype)
    return None, None


def _shared(module: nn.Module, modules: dict[str, nn.Module]) -> bool:
    """Whether ``module``'s weight belongs to another module too (tied embeddings): no gradient or
    memory check covers it (its gradient is a sum over uses)."""
    w = getattr(module, "weight", None)
    return sum(1 for m in modules.values() if m is not module and getattr(m, "weight", None) is w) > 0
