"""The matrix checksums on a model: :class:`GemmChecks` hooks every ``nn.Linear`` (forward, weight
and bias gradient, weights in memory) and the products modules report with :func:`observe_gemm`;
the checks and their rounding bounds are :mod:`sdcwatch.telemetry.checksum`'s.
"""

from __future__ import annotations

import fnmatch
import math
import weakref
from typing import Any, Callable

import torch
from torch import nn

from sdcwatch.core.names import GEMM_METRICS
from sdcwatch.telemetry.checksum import (
    _TINY,
    _accumulation_dtype,
    _forward_ratio,
    _gamma,
    _grad_reference,
    _input_roundoff,
    _matmul_ratio,
    _sum,
    abs_max,
    rounding_coefficient,
    unit_roundoff,
)

__all__ = ["GemmChecks", "observe_gemm"]

# custom-GEMM owner (a module) -> the GemmChecks that report it; weak so a dropped model leaves no trace
_OBSERVERS: "weakref.WeakKeyDictionary[nn.Module, list[GemmChecks]]" = weakref.WeakKeyDictionary()


def observe_gemm(
    owner: nn.Module, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """Report one custom or fused product ``c = a @ b (+ bias)`` computed inside ``owner``.

    Every :class:`GemmChecks` attached to the model that holds ``owner`` checks it with
    :func:`check_matmul` on its sampled steps; the product becomes a layer of the ``gemm_*``
    metrics, named after ``owner``. Costs one dictionary look-up when nothing is attached.
    """
    observers = _OBSERVERS.get(owner)
    if observers:
        for checks in observers:
            checks.observe(owner, a, b, c, bias)


class GemmChecks:
    """Checksums of every ``nn.Linear`` of a model (forward, weight and bias gradient, weights),
    plus the custom products reported with :func:`observe_gemm`; one value per product and step.

    ``active`` says whether the step in progress is checked (the probes' sampling and enabled
    flag); hooks cost a function call otherwise. :meth:`collect` returns this step's per-layer
    ratios (:data:`GEMM_METRICS`) as device tensors and starts the next step. A weight shared with
    another module (tied embeddings) is checked forward only: its gradient is a sum over uses.
    """

    def __init__(
        self, model: nn.Module, *, active: Callable[[], bool] = lambda: True, modules: str = "*", weights: bool = True
    ) -> None:
        self.active = active
        self.names: list[str] = []
        """Names of the checked products, in layer order (the index in the ``gemm_*`` metrics)."""
        self._modules: list[nn.Module] = []
        self._handles: list[Any] = []
        self._forward: list[tuple[nn.Module, Callable]] = []  # forward hooks, registered only when due
        self._forward_handles: list[Any] = []
        self._weights = weights
        self.keep_bounds = False
        """Keep each check's absolute bound of the last step in :attr:`bounds` (fault-injection
        campaigns use it to tell which faults a checksum can see; off in training)."""
        self.bounds: dict[tuple[str, str], torch.Tensor] = {}
        self._x_max: torch.Tensor | None = None
        self._sealed_at: list[tuple | None] = []
        self._bias_checked: list[bool] = []
        owners: dict[int, int] = {}
        for _, m in model.named_modules():
            for p in m.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        globs = [g.strip() for g in modules.split(",") if g.strip()]
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and any(fnmatch.fnmatchcase(name, g) for g in globs):
                i = self._add(name, m)
                self._forward.append((m, self._forward_hook(i)))
                # an FSDP2 shard (a DTensor) is outside the autograd graph: its hook would never fire
                if m.weight.requires_grad and owners.get(id(m.weight), 0) == 1 and not _sharded(m.weight):
                    self._handles.append(m.weight.register_hook(self._weight_grad_hook(i)))
                    if m.bias is not None and m.bias.requires_grad and owners.get(id(m.bias), 0) == 1:
                        self._handles.append(m.bias.register_hook(self._bias_grad_hook(i)))
                        self._bias_checked[i] = True
        for name, m in model.named_modules():
            _OBSERVERS.setdefault(m, []).append(self)
            if getattr(m, "_sdcwatch_gemm", False) and any(fnmatch.fnmatchcase(name, g) for g in globs):
                self._add(name, m)  # a module whose forward(a, b) returns a @ b
                self._forward.append((m, self._product_hook))
        self.hook_forward(True)
        self._owners = [m for _, m in model.named_modules()]
        self._module_names = {id(m): n for n, m in model.named_modules()}
        self._reset()

    def _add(self, name: str, module: nn.Module) -> int:
        self.names.append(name)
        self._modules.append(module)
        self._sealed_at.append(None)
        self._bias_checked.append(False)
        return len(self.names) - 1

    def _reset(self) -> None:
        n = len(self.names)
        self._fwd: list[torch.Tensor | None] = [None] * n
        self._bwd: list[torch.Tensor | None] = [None] * n
        self._wt: list[torch.Tensor | None] = [None] * n
        self._in: list[torch.Tensor | None] = [None] * n
        self._pending: list[list | None] = [None] * n  # weight-gradient references of this backward

    @staticmethod
    def _max(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        # a NaN must survive the running maximum (torch.maximum propagates it)
        return new if old is None else torch.maximum(old, new)

    # -- forward ----------------------------------------------------------------------------------
    def _forward_hook(self, i: int) -> Callable:
        def hook(module: nn.Linear, args: tuple, output: Any) -> None:
            if not args or not self.active():
                return
            x, y = args[0], output
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and y.is_floating_point()):
                return
            self._check_forward(i, module, x, y)
            if y.requires_grad and torch.is_grad_enabled() and i < len(self._pending):
                xd = x.detach()  # autograd keeps x for the weight gradient anyway: no extra memory
                x_max = self._x_max
                y.register_hook(lambda dy, i=i, xd=xd, x_max=x_max: self._output_grad(i, xd, dy, x_max))

        return hook

    def _check_forward(self, i: int, module: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            w, b = module.weight, module.bias
            acc = _accumulation_dtype(y.dtype)
            v = _sum(w, 0, acc)
            sw = torch.linalg.vector_norm(w, dim=1, dtype=acc).sum()
            coef = rounding_coefficient(w.shape[1], w.shape[0], y.dtype, input_roundoff=_input_roundoff(x))
            ratio, xn, bound = _forward_ratio(x, v, y, sw, b, coef)
            self._x_max = xn
            self._fwd[i] = self._max(self._fwd[i], ratio.float())
            if self.keep_bounds:
                self.bounds[("gemm_fwd", self.names[i])] = bound
            self._in[i] = self._max(self._in[i], xn.float())
            sealed = self._sealed_at[i]
            if self._weights and sealed is not None and sealed[2] is not None:
                # an FSDP2 shard: this rank's own shard of the weight, read where the optimizer wrote it
                w, b = sealed[2].to_local(), None if sealed[3] is None else sealed[3].to_local()
                v = _sum(w, 0, acc)
                sw = torch.linalg.vector_norm(w, dim=1, dtype=acc).sum()
            if self._weights and sealed is not None and sealed[0].shape == v.shape:
                # the same reduction of the same bits: any difference is a weight changed in memory
                bound = (_gamma(w.shape[0], unit_roundoff(acc)) * sw).clamp_min(_TINY)
                ratio = (v - sealed[0]).abs_().amax() / bound
                if b is not None and sealed[1] is not None:
                    b_bound = (_gamma(b.numel(), unit_roundoff(acc)) * _sum(b.abs(), None, acc)).clamp_min(_TINY)
                    ratio = torch.maximum(ratio, (_sum(b, None, acc) - sealed[1]).abs() / b_bound)
                    if self.keep_bounds:
                        self.bounds[("gemm_weight", self.names[i] + ".bias")] = b_bound
                self._wt[i] = self._max(self._wt[i], ratio.float())
                if self.keep_bounds:
                    self.bounds[("gemm_weight", self.names[i] + ".weight")] = bound

    def seal(self) -> None:
        """Take the weights' column sums as they are now (call right after the optimizer step; the
        probes do): the next forward compares against them. Costs one pass over the weights."""
        with torch.no_grad():
            for i, m in enumerate(self._modules):
                w = getattr(m, "weight", None)
                if isinstance(w, torch.Tensor) and w.dim() == 2 and self._weights:
                    acc = _accumulation_dtype(w.dtype)
                    b = getattr(m, "bias", None)
                    b = b if isinstance(b, torch.Tensor) else None
                    # an FSDP2 shard (a DTensor): the rank's own shard is sealed, and checked in the
                    # forward against itself (the forward's all-gathered weight is every rank's)
                    shard = _sharded(w)
                    self._sealed_at[i] = (
                        _sum(w.to_local() if shard else w, 0, acc),  # as the check does: same bits, same sum
                        None if b is None else _sum(b.to_local() if shard else b, None, acc),
                        w if shard else None,
                        b if shard else None,
                    )

    def unseal(self) -> None:
        """Forget the sealed column sums (after weights were changed outside the optimizer, e.g. a
        checkpoint loaded): the weight check resumes after the next :meth:`seal`."""
        self._sealed_at = [None] * len(self._sealed_at)

    # -- backward ---------------------------------------------------------------------------------
    def _output_grad(self, i: int, x: torch.Tensor, dy: torch.Tensor, x_max: torch.Tensor | None) -> None:
        """dY of one use of layer i: the expected column sums of its dW (summed over uses)."""
        try:
            with torch.no_grad():
                ref, xcol, sdy, s_total, tokens = _grad_reference(x, dy, x_max)
                bias_scale = math.sqrt(tokens) * sdy  # Σ|dY| <= sqrt(N m) ||dY||_F
                p = self._pending[i]
                if p is None:
                    waiting = {"weight"} | ({"bias"} if self._bias_checked[i] else set())
                    self._pending[i] = [ref, xcol * sdy, tokens, s_total, bias_scale, _input_roundoff(x), waiting]
                else:  # the weight is used more than once: its gradient is the sum, so are the checks
                    p[0] = p[0] + ref
                    p[1] = p[1] + xcol * sdy
                    p[2] = max(p[2], tokens)
                    p[3] = p[3] + s_total
                    p[4] = p[4] + bias_scale
        except Exception:  # a shape we do not understand: no check rather than a broken backward
            self._pending[i] = None

    def _weight_grad_hook(self, i: int) -> Callable:
        def hook(dw: torch.Tensor) -> None:
            p = self._pending[i] if i < len(self._pending) else None
            if p is None or dw.dim() != 2 or dw.shape[1] != p[0].shape[0]:
                return
            with torch.no_grad():
                coef = rounding_coefficient(p[2], dw.shape[0], dw.dtype, input_roundoff=p[5])
                res = (_sum(dw, 0, p[0].dtype) - p[0]).abs_().amax()
                bound = (coef * p[1]).clamp_min(_TINY)
                self._bwd[i] = self._max(self._bwd[i], (res / bound).float())
                if self.keep_bounds:
                    self.bounds[("gemm_bwd", self.names[i] + ".weight")] = bound
            self._done(i, "weight")

        return hook

    def _done(self, i: int, which: str) -> None:
        """The weight's or the bias's gradient was checked; forget the reference once both were
        (autograd may run either hook first)."""
        p = self._pending[i]
        if p is not None:
            p[6].discard(which)
            if not p[6]:
                self._pending[i] = None

    def _bias_grad_hook(self, i: int) -> Callable:
        def hook(db: torch.Tensor) -> None:
            p = self._pending[i] if i < len(self._pending) else None
            if p is None:
                return
            with torch.no_grad():
                # Σ db and Σ dY are the same sum in two orders: 2γ_N + γ_m, times Σ|dY| <= sqrt(N) Σ||dY_:j||
                u = unit_roundoff(_accumulation_dtype(db.dtype))
                coef = 2 * _gamma(p[2], u) + _gamma(db.numel(), u) + unit_roundoff(db.dtype)
                res = (_sum(db, None, p[3].dtype) - p[3]).abs()
                bound = (coef * p[4]).clamp_min(_TINY)
                self._bwd[i] = self._max(self._bwd[i], (res / bound).float())
                if self.keep_bounds:
                    self.bounds[("gemm_bwd", self.names[i] + ".bias")] = bound
            self._done(i, "bias")

        return hook

    # -- custom products --------------------------------------------------------------------------
    def _product_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if len(args) >= 2 and isinstance(output, torch.Tensor):
            self.observe(module, args[0], args[1], output)

    def observe(
        self, owner: nn.Module, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """A custom product of ``owner`` (see :func:`observe_gemm`); a new owner becomes a new layer."""
        if not self.active():
            return
        try:
            i = self._modules.index(owner)
        except ValueError:
            i = self._add(self._module_names.get(id(owner), type(owner).__name__), owner)
            for lst in (self._fwd, self._bwd, self._wt, self._in, self._pending):
                lst.append(None)
        with torch.no_grad():
            acc = _accumulation_dtype(c.dtype)
            coef = rounding_coefficient(b.shape[-2], b.shape[-1], c.dtype, input_roundoff=_input_roundoff(a))
            ys = _sum(c, -1, acc)
            ref = ((a if a.dtype == acc else a.to(acc)) @ _sum(b, -1, acc).unsqueeze(-1)).squeeze(-1)
            if bias is not None:
                ref = ref + _sum(bias, None, acc)
            ratio, bound = _matmul_ratio(a, b, ys, ref, bias, coef, acc)
            self._fwd[i] = self._max(self._fwd[i], ratio)
            self._in[i] = self._max(self._in[i], abs_max(a).float())
            if self.keep_bounds:
                self.bounds[("gemm_fwd", self.names[i])] = bound

    # -- the step ---------------------------------------------------------------------------------
    def collect(self) -> dict[str, torch.Tensor] | None:
        """This step's (n_products,) tensor per :data:`GEMM_METRICS` (None if nothing was checked);
        resets for the next step. Products not checked this step report 0."""
        if not any(t is not None for t in self._fwd):
            self._reset()
            return None
        device = next(t for t in self._fwd if t is not None).device
        zero = torch.zeros((), device=device)
        out = {}
        for name, values in zip(GEMM_METRICS, (self._fwd, self._bwd, self._wt, self._in)):
            out[name] = torch.stack([zero if t is None else t.to(device) for t in values])
        self._reset()
        return out

    def discard(self) -> None:
        """Drop what this step measured (a step that is not recorded)."""
        self._reset()

    def hook_forward(self, want: bool) -> None:
        """Register the forward hooks (``True``) or remove them: a module with a forward hook leaves
        PyTorch's fast call path, so the probes keep them only on the steps that are checked."""
        if want and not self._forward_handles:
            self._forward_handles = [m.register_forward_hook(hook) for m, hook in self._forward]
        elif not want and self._forward_handles:
            for h in self._forward_handles:
                h.remove()
            self._forward_handles = []

    def remove(self) -> None:
        """Remove every hook."""
        self.hook_forward(False)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._owners:
            lst = _OBSERVERS.get(m)
            if lst:
                lst[:] = [c for c in lst if c is not self]


def _sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor shard (FSDP2), outside the autograd graph and the forward's weight."""
    return hasattr(t, "to_local")
