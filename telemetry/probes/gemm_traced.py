"""The matrix checksums' hooks in code torch.compile traces (a part of
:class:`~sdcwatch.telemetry.probes.gemm_checks.GemmChecks`).

Blocks compiled one by one (``block.compile()``, as torchtitan does) share one graph only if the
traced code reads no Python value that differs between blocks: no product index, no length of a
list that grows along the forward pass, no counter. So the hooks here keep each call on the module
it belongs to (a list under a per-watch attribute, emptied at each step's end: every block's first
call finds it empty), take each weight's seal from the module, and number the calls in forward order
on the device (:meth:`~sdcwatch.telemetry.probes.forward_order.ForwardOrder.traced_tick`);
:meth:`TracedCalls._drain` gathers the calls into the step's lists, product by product, once the
step is over. The reductions are plain torch ones, which inductor fuses into the kernels that
already read the same tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from sdcwatch.telemetry.probes.checksum_bounds import (
    accumulated_sum,
    accumulation_dtype,
    gemm_input_roundoff,
    rounding_coefficient,
)
from sdcwatch.telemetry.probes.kept import kept_calls
from sdcwatch.telemetry.probes.gemm_state import SealedWeight, is_shard, local_part
from sdcwatch.telemetry.probes.linear_layout import linear_weight
from torch import nn

__all__ = ["TracedCalls"]


class TracedCalls:
    """The compiled-code half of :class:`~sdcwatch.telemetry.probes.gemm_checks.GemmChecks`, which owns
    the state used here (``_calls_attr``, ``_seal_attr``, ``_modules``, ``_step``, ``order``...)."""

    _calls_attr: str
    _seal_attr: str
    _modules: list[nn.Module]
    _index_of: dict[int, int]
    _weights: bool
    order: Any
    optimizer_seals: bool
    traced_backward: bool
    _step: Any
    active: Any
    scan: Any
    backward: Any
    _zero: Any
    _compare_weight: Any
    _linear_hook: Any

    def _any_linear_hook(self, module: nn.Linear, args: tuple, output: Any) -> None:
        """The forward hook of every linear layer: one function for all of them, so that code
        torch.compile traces holds no product index (a constant Dynamo guards on: blocks compiled one
        by one would each compile their own graphs)."""
        if torch.compiler.is_compiling() and self._traced_linear(module, args, output):
            return
        self._linear_hook(self._index_of[id(module)], module, args, output)

    def _traced_linear(self, module: nn.Linear, args: tuple, output: Any) -> bool:
        """The hook in code torch.compile traces: what it measures goes into the module's own list of
        this step's calls (``_calls_attr``, emptied at each step's end, so every block's first call
        sees it empty), its forward-order ordinal from a device counter, its seal from the module:
        the traced code reads no Python value that differs between blocks. Returns False for what
        it leaves to the indexed hook (a tensor-parallel or sharded weight, no optimizer's seal, the
        weight-gradient check in compiled backwards)."""
        if not args:
            return True
        if not self.active():
            if self.scan():
                self._traced_scan(module, output)
            return True
        if self.traced_backward or is_shard(module.weight):
            return False
        sealed = module.__dict__.get(self._seal_attr)
        w, b = linear_weight(module)
        if not self._seal_usable(sealed, w):
            return False
        x, y = args[0], output
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and y.is_floating_point()):
            return True
        if x.numel() == 0 or y.numel() == 0:
            return True
        with torch.no_grad():
            self._check_forward_traced(module, sealed, w, b, x, y, accumulation_dtype(y.dtype))
        return True

    def _seal_usable(self, sealed: SealedWeight | None, w: torch.Tensor) -> bool:
        """Whether compiled code checks this weight's product against its seal: an optimizer seals
        it after every update, and the seal is of the whole weight as the forward reads it."""
        return (
            self.optimizer_seals
            and sealed is not None
            and sealed.shard is None
            and sealed.k is not None
            and tuple(sealed.v.shape) == (w.shape[1],)
        )

    def _traced_scan(self, module: nn.Module, y: Any) -> None:
        y = y if type(y) is torch.Tensor else local_part(y)
        if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel():
            ordinal = self.order.traced_tick() if self.order is not None else None
            ys = accumulated_sum(y.detach(), -1, torch.float32).reshape(-1)
            module.__dict__[self._calls_attr].append(("o", ys, ordinal))

    def _drain(self) -> None:
        """Move the calls compiled code kept on the modules into this step's lists, product by product
        (their order there does not matter: each call carries its product and its ordinal)."""
        st = self._step
        for i, c in kept_calls(self._modules, self._calls_attr):
            if c[0] == "o":
                st.o_idx.append(i)
                st.o_ys.append(c[1])
                if c[2] is not None:
                    st.o_seq.append(c[2])
            elif c[0] == "f":
                st.f_idx.append(i)
                if c[-1] is not None:
                    st.f_seq.append(c[-1])
                st.add_check(*c[1:-1])
            else:  # "w": the weight (and bias) sums now beside the sealed ones
                self._compare_weight(i, c[1], c[2], c[3])

    def _check_forward_traced(
        self,
        module: nn.Module,
        sealed: SealedWeight,
        w: torch.Tensor,
        b: torch.Tensor | None,
        x: torch.Tensor,
        y: torch.Tensor,
        acc: torch.dtype,
    ) -> None:
        """The forward check in code torch.compile traces: the weight's sums and norms as the seal took
        them right after the optimizer wrote the weight (no read of the weight in the forward), and
        every reduction of ``x`` and ``y`` a row reduction that inductor fuses into the kernels that
        already read them (the normalisation that wrote ``x``, the rotary embedding, the activation or
        the residual add that reads ``y``): about no extra bytes. What it measures goes into the
        module's list of this step's calls (see :meth:`_traced_linear`).

        A weight changed in memory after its seal shows here as a product whose row sums miss the
        reference at this step; on the steps whose weight gradients are checked too, the weight is
        also compared with its seal (``gemm_weight``), naming the weight. A provisional seal (before the
        optimizer's first step) carries an infinite ``trust``: its sums may predate a checkpoint load,
        so the call is measured but never judged (NaN still is)."""
        calls = module.__dict__[self._calls_attr]
        if self._weights and self.backward() and not any(c[0] == "w" for c in calls):
            bw = accumulated_sum(b, None, acc) if b is not None else None
            calls.append(("w", sealed, accumulated_sum(w, 0, acc), bw))
        ys = accumulated_sum(y, -1, acc).reshape(-1)
        ref = accumulated_sum((x if x.dtype == acc else x.to(acc)) * sealed.v, -1, acc).reshape(-1)
        b_abs = self._zero(acc, y.device)
        if b is not None and sealed.b_sum is not None:
            ref = ref + sealed.b_sum
            b_abs = sealed.b_abs
        coef = rounding_coefficient(
            w.shape[1], w.shape[0], y.dtype, input_roundoff=gemm_input_roundoff(x, w, compute=y.dtype)
        )
        ordinal = self.order.traced_tick() if self.order is not None else None
        calls.append(("f", ys, ref, x.amax(), x.amin(), sealed.k, b_abs, sealed.trust, coef, ordinal))
