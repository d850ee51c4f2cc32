"""The weight-gradient checksum of :class:`~sdcwatch.telemetry.probes.gemm_checks.GemmChecks`: ``dW = dY^T X``
implies ``1^T dW = (dY 1)^T X`` (the bound is :mod:`sdcwatch.telemetry.probes.checksum_bounds`'s).

A checked forward registers a hook on the product's output; in the backward that hook takes the
output gradient's reductions (:func:`~sdcwatch.telemetry.probes.checksum_bounds.grad_reference`, one
vector-matrix product with the input autograd keeps anyway), and the weight's and the bias's
gradient hooks compare the gradients' column sums with them. Its own concept and its own sampling
(``ProbeConfig.checksum_every``): the forward and the weights in memory can be checked on more
steps (``checksum_forward_every``) than the backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from sdcwatch.telemetry.probes.checksum_bounds import (
    TINY,
    accumulated_sum,
    accumulation_dtype,
    gemm_input_roundoff,
    grad_reference,
    rounding_coefficient,
    rounding_gamma,
    unit_roundoff,
)

__all__ = ["GradientChecks"]


class GradientChecks:
    """The backward half of :class:`~sdcwatch.telemetry.probes.gemm_checks.GemmChecks` (a mixin): the
    hooks that check each product's weight and bias gradient. Uses the host's ``names``, its step
    (``_step``, a :class:`~sdcwatch.telemetry.probes.gemm_state.StepChecks`), ``_bias_checked`` and
    ``_pending`` (per product: this backward's reference, kept until both gradients are checked)."""

    names: list[str]
    _step: Any
    _bias_checked: list[bool]
    _pending: list[list | None]

    def _output_grad(self, i: int, x: torch.Tensor, x_max: torch.Tensor, dy: torch.Tensor) -> None:
        """dY of one use of layer i: the expected column sums of its dW (summed over uses)."""
        try:
            with torch.no_grad():
                ref, s, sdy, tokens = grad_reference(x, dy)
                m = dy.shape[-1]
                # max_k ||X_:k|| <= sqrt(N) max|X|; Σ_j ||dY_:j|| <= sqrt(m) ||dY||_F
                scale = (x_max.to(sdy.dtype) * sdy).mul_(math.sqrt(tokens) * math.sqrt(m))
                bias = self._bias_checked[i]
                s_total = s.sum() if bias else None
                bias_scale = sdy * math.sqrt(tokens * m) if bias else None  # Σ|dY| <= sqrt(N m) ||dY||_F
                p = self._pending[i]
                if p is None:
                    waiting = {"weight"} | ({"bias"} if bias else set())
                    self._pending[i] = [ref, scale, tokens, s_total, bias_scale, gemm_input_roundoff(x), waiting]
                else:  # the weight is used more than once: its gradient is the sum, so are the checks
                    p[0] = p[0] + ref
                    p[1] = p[1] + scale
                    p[2] = max(p[2], tokens)
                    if bias:
                        p[3] = p[3] + s_total
                        p[4] = p[4] + bias_scale
        except Exception:  # a shape we do not understand: no check rather than a broken backward
            self._pending[i] = None

    def _weight_grad_hook(self, i: int, dw: torch.Tensor) -> None:
        p = self._pending[i] if i < len(self._pending) else None
        if p is None or dw.dim() != 2 or dw.shape[1] != p[0].shape[0]:
            return
        with torch.no_grad():
            coef = rounding_coefficient(p[2], dw.shape[0], dw.dtype, input_roundoff=p[5])
            st = self._step
            st.g_idx.append(i)
            st.g_res.append((accumulated_sum(dw, 0, p[0].dtype) - p[0]).abs_().amax())
            st.g_bound.append((p[1] * coef).clamp_min_(TINY))
            st.g_names.append(self.names[i] + ".weight")
        self._done(i, "weight")

    def _done(self, i: int, which: str) -> None:
        """The weight's or the bias's gradient was checked; forget the reference once both were
        (autograd may run either hook first)."""
        p = self._pending[i]
        if p is not None:
            p[6].discard(which)
            if not p[6]:
                self._pending[i] = None

    def _bias_grad_hook(self, i: int, db: torch.Tensor) -> None:
        p = self._pending[i] if i < len(self._pending) else None
        if p is None or p[3] is None:
            return
        with torch.no_grad():
            # Σ db and Σ dY are the same sum in two orders: 2γ_N + γ_m, times Σ|dY|
            u = unit_roundoff(accumulation_dtype(db.dtype))
            coef = 2 * rounding_gamma(p[2], u) + rounding_gamma(db.numel(), u) + unit_roundoff(db.dtype)
            st = self._step
            st.g_idx.append(i)
            st.g_res.append((accumulated_sum(db, None, p[3].dtype) - p[3]).abs())
            st.g_bound.append((p[4] * coef).clamp_min_(TINY))
            st.g_names.append(self.names[i] + ".bias")
        self._done(i, "bias")
