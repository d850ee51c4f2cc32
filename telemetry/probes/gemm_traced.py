"""The matrix checksums' hooks in code torch.compile traces (a part of
:class:`~sdcwatch.telemetry.probes.gemm_checks.GemmChecks`, working on its table of products and
its step's measurements).
(docs/probes.md, "How the probes are built", says how and why.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from sdcwatch.telemetry.probes.checksum_bounds import (
    accumulated_sum,
    accumulation_dtype,
    gemm_input_roundoff,
    rounding_coefficient,
)
from sdcwatch.telemetry.probes.gemm_state import SealedWeight, is_shard, local_part, zero_of
from sdcwatch.telemetry.probes.linear_layout import linear_weight
from torch import nn

if TYPE_CHECKING:
    from sdcwatch.telemetry.probes.gemm_checks import GemmChecks

__all__ = ["TracedCalls"]


class TracedCalls:
    """The compiled-code part of ``checks`` (a :class:`~sdcwatch.telemetry.probes.gemm_checks.GemmChecks`):
    reads its switches (``active``, ``scan``, ``backward``, ``optimizer_seals``, ``traced_backward``,
    ``weights``, ``order``), keeps calls on the modules of its ``products`` and drains them into
    its ``step``."""

    def __init__(self, checks: "GemmChecks") -> None:
        self.checks = checks

    def linear(self, module: nn.Linear, args: tuple, output: Any) -> bool:
        """The hook in code torch.compile traces: what it measures goes into the module's own list of
        this step's calls (``_calls_attr``, emptied at each step's end, so every block's first call
        sees it empty), its forward-order ordinal from a device counter, its seal from the module:
        the traced code reads no Python value that differs between blocks. Returns False for what
        it leaves to the indexed hook (a tensor-parallel or sharded weight, no optimizer's seal, the
        weight-gradient check in compiled backwards)."""
        checks = self.checks
        if not args:
            return True
        if not checks.active():
            if checks.scan():
                self.scan(module, output)
            return True
        if checks.traced_backward or is_shard(module.weight):
            return False
        sealed = checks.products.seal_on(module)
        w, b = linear_weight(module)
        if not self.seal_usable(sealed, w):
            return False
        x, y = args[0], output
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and y.is_floating_point()):
            return True
        if x.numel() == 0 or y.numel() == 0:
            return True
        with torch.no_grad():
            self.check_forward(module, sealed, w, b, x, y, accumulation_dtype(y.dtype))
        return True

    def seal_usable(self, sealed: SealedWeight | None, w: torch.Tensor) -> bool:
        """Whether compiled code checks this weight's product against its seal: an optimizer seals
        it after every update, and the seal is of the whole weight as the forward reads it."""
        return (
            self.checks.optimizer_seals
            and sealed is not None
            and sealed.shard is None
            and sealed.k is not None
            and tuple(sealed.v.shape) == (w.shape[1],)
        )

    def scan(self, module: nn.Module, y: Any) -> None:
        """A scanned call: the row sums of the product's output, kept on the module."""
        y = y if type(y) is torch.Tensor else local_part(y)
        if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel():
            order = self.checks.order
            ordinal = order.traced_tick() if order is not None else None
            ys = accumulated_sum(y.detach(), -1, torch.float32).reshape(-1)
            self.checks.products.calls_on(module).append(("o", ys, ordinal))

    def drain(self) -> None:
        """Move the calls compiled code kept on the modules into this step's lists, product by product
        (their order there does not matter: each call carries its product and its ordinal)."""
        st, names = self.checks.step, self.checks.names
        for i, c in self.checks.products.take_calls():
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
                st.compare_weight(i, names[i], c[1], c[2], c[3])

    def check_forward(
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
        module's list of this step's calls (see :meth:`linear`).

        A weight changed in memory after its seal shows here as a product whose row sums miss the
        reference at this step; on the steps whose weight gradients are checked too, the weight is
        also compared with its seal (``gemm_weight``), naming the weight. A provisional seal (before the
        optimizer's first step) carries an infinite ``trust``: its sums may predate a checkpoint load,
        so the call is measured but never judged (NaN still is)."""
        checks = self.checks
        calls = checks.products.calls_on(module)
        if checks.weights and checks.backward() and not any(c[0] == "w" for c in calls):
            bw = accumulated_sum(b, None, acc) if b is not None else None
            calls.append(("w", sealed, accumulated_sum(w, 0, acc), bw))
        ys = accumulated_sum(y, -1, acc).reshape(-1)
        ref = accumulated_sum((x if x.dtype == acc else x.to(acc)) * sealed.v, -1, acc).reshape(-1)
        b_abs = zero_of(acc, y.device)
        if b is not None and sealed.b_sum is not None:
            ref = ref + sealed.b_sum
            b_abs = sealed.b_abs
        coef = rounding_coefficient(
            w.shape[1], w.shape[0], y.dtype, input_roundoff=gemm_input_roundoff(x, w, compute=y.dtype)
        )
        ordinal = checks.order.traced_tick() if checks.order is not None else None
        calls.append(("f", ys, ref, x.amax(), x.amin(), sealed.k, b_abs, sealed.trust, coef, ordinal))
