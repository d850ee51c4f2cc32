"""The matrix checksums' hooks in code torch.compile traces, a part of
:class:`~sdcwatch.telemetry.probes.gemm_checks.GemmChecks` (docs/probes.md says how and why).
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
    """The compiled-code part of ``checks``: reads its switches, keeps calls on the modules of its
    ``products`` and drains them into its ``step``."""

    def __init__(self, checks: "GemmChecks") -> None:
        self.checks = checks

    def linear(self, module: nn.Linear, args: tuple, output: Any) -> bool:
        """The linear hook in traced code: calls, ordinals and seals live on the module, so the code
        reads no Python value that differs between blocks. False: left to the indexed hook."""
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
        """Whether compiled code checks against the seal: an optimizer's, of the whole weight."""
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
            ordinal = self.checks.step.traced_ordinal()
            ys = accumulated_sum(y.detach(), -1, torch.float32).reshape(-1)
            self.checks.products.calls_on(module).append(("o", ys, ordinal))

    def drain(self) -> None:
        """Move the calls compiled code kept on the modules into this step's lists."""
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
        """The forward check in traced code: the weight's sums and norms from the seal (no read of
        the weight), every reduction of ``x`` and ``y`` a row reduction inductor fuses into kernels
        that already read them. A provisional seal's infinite ``trust``: measured, never judged."""
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
        ordinal = checks.step.traced_ordinal()
        calls.append(("f", ys, ref, x.amax(), x.amin(), sealed.k, b_abs, sealed.trust, coef, ordinal))
