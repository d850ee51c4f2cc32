"""The weight-gradient checksum of :class:`~sdcwatch.telemetry.probes.gemm_checks.GemmChecks`:
``dW = dY^T X`` implies ``1^T dW = (dY 1)^T X`` (docs/probes.md says how and why).
"""

from __future__ import annotations

import math

import torch
from sdcwatch.telemetry.probes.checksum_bounds import (
    TINY,
    accumulated_sum,
    accumulation_dtype,
    bias_grad_coefficient,
    gemm_input_roundoff,
    grad_reference,
    product_dtype,
    rounding_coefficient,
    underflow_floor,
)
from sdcwatch.telemetry.probes.gemm_state import ProductTable, StepChecks
from sdcwatch.telemetry.probes.linear_layout import linear_weight

__all__ = ["GradientChecks", "TracedReference"]


class TracedReference:
    """One product's weight-gradient reference, added into on the device by a traced output-gradient
    hook (traced code may add into tensors allocated beforehand, not change Python state)."""

    __slots__ = ("ref", "scale", "s_total", "bias_scale", "uses")

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device) -> None:
        self.ref = torch.zeros(n, dtype=dtype, device=device)
        self.scale = torch.zeros((), dtype=dtype, device=device)
        self.s_total = torch.zeros((), dtype=dtype, device=device)
        self.bias_scale = torch.zeros((), dtype=dtype, device=device)
        self.uses = torch.zeros((), dtype=dtype, device=device)  # output gradients added

    def clear(self) -> None:
        for t in (self.ref, self.scale, self.s_total, self.bias_scale, self.uses):
            t.zero_()

    def bound_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """``scale``, or +inf where no output gradient was added (a NaN gradient still fails)."""
        return torch.where(self.uses > 0, scale, torch.full_like(scale, math.inf))


class GradientChecks:
    """The hooks that check each product's weight and bias gradient against the reference its output
    gradient gives, into the shared ``step``; a reference is kept until both gradients are checked."""

    def __init__(self, products: ProductTable, step: StepChecks) -> None:
        self.products = products
        self.step = step
        self._pending: dict[int, list] = {}
        self._traced: dict[int, TracedReference] = {}
        self._traced_meta: dict[int, tuple[int, float, torch.dtype]] = {}

    def reset(self) -> None:
        self._pending = {}

    def arm_traced(self, hooked: list[int]) -> None:
        """Before a step whose weight gradients are checked in compiled code: a :class:`TracedReference`
        for every product in ``hooked`` (allocated once), and no forward noted yet."""
        for i in self._traced_meta:  # a backward that never reached the weight's hook: start from zero
            if i in self._traced:
                self._traced[i].clear()
        self._traced_meta.clear()
        for i in hooked:
            held = self._traced.get(i)
            w, _ = linear_weight(self.products.modules[i])
            if held is None or held.ref.device != w.device:
                self._traced[i] = TracedReference(w.shape[1], accumulation_dtype(w.dtype), w.device)

    def note_traced_forward(self, i: int, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Note the tokens and rounding of a traced forward of product ``i`` (False: no traced reference)."""
        if i not in self._traced:
            return False
        tokens = x.numel() // x.shape[-1]
        before = self._traced_meta.get(i)
        # dW = dY^T X is rounded to y's dtype (dY's); under autocast X is cast to it
        roundoff, out = gemm_input_roundoff(x, y, compute=y.dtype), y.dtype
        if before is not None:
            tokens, roundoff, out = max(before[0], tokens), max(before[1], roundoff), product_dtype(before[2], out)
        self._traced_meta[i] = (tokens, roundoff, out)
        return True

    def output_grad(self, i: int, x: torch.Tensor, x_max: torch.Tensor, dy: torch.Tensor) -> None:
        """dY of one use of layer i: the expected column sums of its dW (summed over uses)."""
        if torch.compiler.is_compiling():
            return self._traced_output_grad(i, x, x_max, dy)
        try:
            with torch.no_grad():
                ref, s, sdy, tokens = grad_reference(x, dy)
                m = dy.shape[-1]
                # max_k ||X_:k|| <= sqrt(N) max|X|; Σ_j ||dY_:j|| <= sqrt(m) ||dY||_F
                scale = (x_max.to(sdy.dtype) * sdy).mul_(math.sqrt(tokens) * math.sqrt(m))
                bias = self.products.bias_checked[i]
                s_total = s.sum() if bias else None
                bias_scale = sdy * math.sqrt(tokens * m) if bias else None  # Σ|dY| <= sqrt(N m) ||dY||_F
                p = self._pending.get(i)
                # the product was rounded to dY's dtype (autocast: a bf16 dW cast up to the fp32 weight's)
                roundoff = gemm_input_roundoff(x, dy, compute=dy.dtype)
                if p is None:
                    waiting = {"weight"} | ({"bias"} if bias else set())
                    self._pending[i] = [ref, scale, tokens, s_total, bias_scale, roundoff, waiting, dy.dtype]
                else:  # the weight is used more than once: its gradient is the sum, so are the checks
                    p[0] = p[0] + ref
                    p[1] = p[1] + scale
                    p[2] = max(p[2], tokens)
                    p[5], p[7] = max(p[5], roundoff), product_dtype(p[7], dy.dtype)
                    if bias:
                        p[3] = p[3] + s_total
                        p[4] = p[4] + bias_scale
        except Exception:  # a shape we do not understand: no check rather than a broken backward
            self._pending.pop(i, None)

    def _traced_output_grad(self, i: int, x: torch.Tensor, x_max: torch.Tensor, dy: torch.Tensor) -> None:
        """:meth:`output_grad` in traced code: the same reductions, added into a :class:`TracedReference`."""
        held = self._traced.get(i)
        if held is None:
            return
        with torch.no_grad():
            ref, s, sdy, tokens = grad_reference(x, dy)
            m = dy.shape[-1]
            held.ref.add_(ref.to(held.ref.dtype))
            held.uses.add_(1)
            held.scale.add_((x_max.to(sdy.dtype) * sdy) * (math.sqrt(tokens) * math.sqrt(m)))
            if self.products.bias_checked[i]:
                held.s_total.add_(s.sum())
                held.bias_scale.add_(sdy * math.sqrt(tokens * m))

    def _traced_pending(self, i: int) -> list | None:
        """The reference a traced backward summed for product ``i``, as a pending one (None: none)."""
        meta = self._traced_meta.pop(i, None)
        held = self._traced.get(i)
        if meta is None or held is None:
            return None
        bias = self.products.bias_checked[i]
        waiting = {"weight"} | ({"bias"} if bias else set())
        scale, bias_scale = held.bound_scale(held.scale), held.bound_scale(held.bias_scale) if bias else None
        p = [held.ref, scale, meta[0], held.s_total if bias else None, bias_scale]
        self._pending[i] = p + [meta[1], waiting, meta[2]]
        return self._pending[i]

    def weight_grad(self, i: int, dw: torch.Tensor) -> None:
        """Check the column sums of product ``i``'s weight gradient against the reference."""
        p = self._pending.get(i) or self._traced_pending(i)
        if p is None or dw.dim() != 2 or dw.shape[1] != p[0].shape[0]:
            return
        with torch.no_grad():
            out = product_dtype(dw.dtype, p[7])
            coef = rounding_coefficient(p[2], dw.shape[0], out, input_roundoff=p[5])
            floor = underflow_floor(dw.shape[0], out)
            res = (accumulated_sum(dw, 0, p[0].dtype) - p[0]).abs_().amax()
            bound = (p[1] * coef + floor if floor else p[1] * coef).clamp_min_(TINY)
            self.step.add_grad(i, self.products.names[i] + ".weight", res, bound)
        self._done(i, "weight")

    def _done(self, i: int, which: str) -> None:
        """Forget the reference once both gradients were checked (autograd may run either hook first)."""
        p = self._pending.get(i)
        if p is not None:
            p[6].discard(which)
            if not p[6]:
                del self._pending[i]
                held = self._traced.get(i)
                if held is not None and p[0] is held.ref:
                    held.clear()  # the next traced backward adds from zero

    def bias_grad(self, i: int, db: torch.Tensor) -> None:
        """The bias gradient of product ``i``: its sum against the reference."""
        p = self._pending.get(i) or self._traced_pending(i)
        if p is None or p[3] is None:
            return
        with torch.no_grad():
            # Σ db and Σ dY are the same sum in two orders: 2γ_N + γ_m, times Σ|dY|
            coef = bias_grad_coefficient(p[2], db.numel(), product_dtype(db.dtype, p[7]))
            res = (accumulated_sum(db, None, p[3].dtype) - p[3]).abs()
            self.step.add_grad(i, self.products.names[i] + ".bias", res, (p[4] * coef).clamp_min_(TINY))
        self._done(i, "bias")
