"""Matrix-product checksums (algorithm-based fault tolerance) for every linear layer of a model.

A product ``C = A B`` (a linear layer: ``y = x W^T + b``) satisfies ``C 1 = A (B 1)``: the row sums
of the output equal the input times the row sums of ``B``, one matrix-vector product next to the
matrix-matrix one (O(N d) beside O(N d^2)). Its weight gradient ``dW = dY^T X`` satisfies
``1^T dW = (dY 1)^T X``. A hardware fault that changes an element of the product by more than the
rounding error breaks the identity; nothing else does. The tolerance is the rounding bound
of the two sides, derived below, so a correct product can never pass it and no constant is tuned.

**The bound.** With unit roundoff ``u`` of the accumulation and ``γ_k = k u / (1 - k u)``, an
inner product of length ``n`` computed in any order (blocked, FMA, split-K) has an error at most
``γ_n Σ_k |a_k b_k| <= γ_n ||a|| ||b||`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
§3.1). For row ``i`` of ``y = x W^T + b`` (``W`` is m x n) and its checksum:

* each ``y_ij`` is off by at most ``γ_n ||x_i|| ||w_j||`` plus one rounding to the output type
  (``u_out |y_ij|``), and summing the ``m`` values adds ``γ_m Σ_j |y_ij|``;
* the reference ``x_i · (W^T 1) + Σ_j b_j`` is off by ``γ_m`` (forming ``W^T 1``) plus ``γ_n``
  (the dot product), each times at most ``||x_i|| Σ_j ||w_j||``;

so ``|Σ_j y_ij - x_i·(W^T 1) - Σ_j b_j| <= c (||x_i|| S_w + S_b)`` with ``S_w = Σ_j ||w_j||``,
``S_b = Σ_j |b_j|`` and ``c = 2γ_n + 3γ_m + u_out + 2 u_in`` (``u_in``: when the kernel rounds
its inputs first, as TF32 does, each product is off by ``2 u_in`` relative). The weight gradient's
check is the same with the roles of the token (length ``N``) and feature dimensions exchanged:
``|Σ_j dW_jk - Σ_i s_i X_ik| <= c' ||X_:k|| Σ_j ||dY_:j||`` with ``s = dY 1`` and
``c' = 2γ_N + 3γ_m + u_out + 2 u_in``. The bound is rigorous (a worst case); the error seen in
practice grows like ``sqrt(n) u`` and sits two to four orders of magnitude below it. The
reported *ratio* is the largest residual of a layer divided by one bound that holds for every
row: ``max_i |r_i| / (c (sqrt(n) max|x| S_w + S_b))``, since ``||x_i|| <= sqrt(n) max|x|``; in
the backward ``max_k ||X_:k|| <= sqrt(N) max|X|`` and ``Σ_j ||dY_:j|| <= sqrt(m) ||dY||_F``.
These norms cost one fast reduction each where exact row and column norms cost more than the
product's own checksum; they loosen the bound by a small factor (about max|x| over the rows'
RMS). The ratio never exceeds the per-row one, so "ratio > 1" cannot fire on a correct product.
A NaN or Inf in the product makes it NaN or Inf.

The weights themselves get a third check: the column sums ``W^T 1`` the forward check needs are
compared with those taken when the optimizer last wrote the weights (:meth:`GemmChecks.seal`);
the same reduction of the same bits gives the same result, so any change of a weight in memory
between the update and its use shows (relative to ``γ_m S_w``, below which a change is lost in
the sum's own rounding).

Use it on any model through :class:`GemmChecks` (forward hooks on ``nn.Linear`` modules, tensor
hooks for the backward; :func:`sdcwatch.telemetry.probes.attach` does it). A module whose
``forward(a, b)`` returns ``a @ b`` and that sets ``_sdcwatch_gemm = True`` is checked the same way
(the reference model's attention ``probs @ v``). Inside a custom or fused kernel's module, call
:func:`observe_gemm` (or :func:`check_matmul` on its own) with the kernel's inputs and output: a
compiled model whose ``nn.Linear`` hooks no longer run keeps its checks that way.
"""

from __future__ import annotations

import fnmatch
import math
import weakref
from typing import Any, Callable

import torch
from torch import nn

from sdcwatch.core.names import GEMM_METRICS

__all__ = [
    "GEMM_METRICS",
    "GemmChecks",
    "abs_max",
    "check_linear",
    "check_matmul",
    "check_weight_grad",
    "observe_gemm",
    "rounding_coefficient",
    "unit_roundoff",
]

# GEMM_METRICS: the per-layer metrics GemmChecks adds to a record (one value per checked product)

_TINY = 1e-30  # keeps an all-zero product's bound positive (0 / tiny = 0, any residual is huge)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff ``u`` of a floating dtype (2^-24 for float32, 2^-8 for bfloat16)."""
    return torch.finfo(dtype).eps / 2


def _gamma(k: int, u: float) -> float:
    ku = k * u
    return ku / (1.0 - ku) if ku < 0.5 else math.inf


def _sum(t: torch.Tensor, dim: int | None, acc: torch.dtype) -> torch.Tensor:
    """``t.sum`` accumulated in ``acc`` (asking for the dtype it already has takes a slower path)."""
    if t.dtype == acc:
        return t.sum() if dim is None else t.sum(dim)
    return t.sum(dtype=acc) if dim is None else t.sum(dim, dtype=acc)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What GEMMs accumulate in: float64 for float64, float32 for everything narrower."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _input_roundoff(t: torch.Tensor) -> float:
    """Relative rounding of a GEMM's inputs before the products: TF32 on CUDA float32, else none."""
    if t.is_cuda and t.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return 2.0 ** -11
    return 0.0


def rounding_coefficient(n: int, m: int, out_dtype: torch.dtype, *, input_roundoff: float = 0.0) -> float:
    """``c = 2γ_n + 3γ_m + u_out + 2 u_in`` of the module docstring: the bound of a checksum over
    ``m`` outputs of inner products of length ``n``, relative to ``||row|| x Σ ||column||``."""
    u = unit_roundoff(_accumulation_dtype(out_dtype))
    return 2 * _gamma(n, u) + 3 * _gamma(m, u) + unit_roundoff(out_dtype) + 2 * input_roundoff


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """Largest |value| of ``t`` as a 0-d tensor (NaN if any; two fast reductions, no copy)."""
    return torch.maximum(t.amax(), -t.amin())


def _forward_ratio(x: torch.Tensor, v: torch.Tensor, y: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                   coef: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ratio, largest |input|, bound) given ``v = B 1`` (n,) and ``sw = Σ ||column of B||``."""
    acc = v.dtype
    ys = _sum(y, -1, acc)
    ref = (x if x.dtype == acc else x.to(acc)) @ v
    if bias is not None:
        ref = ref + _sum(bias, None, acc)
    xn = abs_max(x).to(acc)
    scale = xn * (math.sqrt(x.shape[-1]) * sw)
    if bias is not None:
        scale = scale + _sum(bias.abs(), None, acc)
    bound = (scale * coef).clamp_min(_TINY)
    return (ys - ref).abs_().amax() / bound, xn, bound


def check_linear(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Forward checksum of ``y = x weight^T + bias`` (``torch.nn.functional.linear``): a 0-d tensor.

    The largest residual of ``y``'s row sums against ``x (weight^T 1) + Σ bias``, over its rounding
    bound (module docstring): <= 1 for a correct product, > 1 when an element of ``y`` is off by
    more than rounding can explain, NaN or Inf when ``y`` holds one. Stays on the device.
    """
    with torch.no_grad():
        if x.numel() == 0 or y.numel() == 0:
            return torch.zeros((), device=y.device)
        acc = _accumulation_dtype(y.dtype)
        n, m = weight.shape[1], weight.shape[0]
        v = _sum(weight, 0, acc)
        sw = torch.linalg.vector_norm(weight, dim=1, dtype=acc).sum()
        coef = rounding_coefficient(n, m, y.dtype, input_roundoff=_input_roundoff(x))
        return _forward_ratio(x, v, y, sw, bias, coef)[0].float()


def check_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Checksum of a (batched) product ``c = a @ b (+ bias)`` from any kernel: a 0-d ratio tensor.

    ``a`` is (..., N, n), ``b`` (..., n, m) or (n, m), ``c`` (..., N, m); ``bias`` (m,). Use it on a
    custom or fused GEMM with the kernel's own inputs and output (e.g. ``probs @ v`` of attention).
    Same meaning as :func:`check_linear`: <= 1 for a correct product.
    """
    with torch.no_grad():
        if a.numel() == 0 or c.numel() == 0:
            return torch.zeros((), device=c.device)
        acc = _accumulation_dtype(c.dtype)
        n, m = b.shape[-2], b.shape[-1]
        coef = rounding_coefficient(n, m, c.dtype, input_roundoff=_input_roundoff(a))
        v = _sum(b, -1, acc)  # (..., n)
        ys = _sum(c, -1, acc)  # (..., N)
        ref = ((a if a.dtype == acc else a.to(acc)) @ v.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            ref = ref + _sum(bias, None, acc)
        return _matmul_ratio(a, b, ys, ref, bias, coef, acc)[0]


def _matmul_ratio(a: torch.Tensor, b: torch.Tensor, ys: torch.Tensor, ref: torch.Tensor, bias: torch.Tensor | None,
                  coef: float, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, bound) of a product's checksum; ``||a_i|| <= sqrt(n) max|a|`` and
    ``Σ_j ||b_:j|| <= m sqrt(n) max|b|`` (one fast reduction each)."""
    n, m = b.shape[-2], b.shape[-1]
    scale = abs_max(a).to(acc) * abs_max(b).to(acc) * (n * m)
    if bias is not None:
        scale = scale + _sum(bias.abs(), None, acc)
    bound = (scale * coef).clamp_min(_TINY)
    return ((ys - ref).abs_().amax() / bound).float(), bound


def _grad_reference(x: torch.Tensor, dy: torch.Tensor, x_max: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """For ``dW = dY^T X``: (expected column sums (n,), an upper bound of max_k ||X_:k||, of
    Σ_j ||dY_:j||, Σ dY, N tokens); ``x_max`` is max|X| when already known."""
    acc = _accumulation_dtype(dy.dtype)
    n, m = x.shape[-1], dy.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, m)
    tokens = x2.shape[0]
    s = _sum(dy2, -1, acc)
    ref = s @ (x2 if x2.dtype == acc else x2.to(acc))
    xcol = (abs_max(x2) if x_max is None else x_max).to(acc) * math.sqrt(tokens)
    sdy = torch.linalg.vector_norm(dy2, dtype=acc) * math.sqrt(m)
    return ref, xcol, sdy, s.sum(), tokens


def check_weight_grad(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """Checksum of a weight gradient ``dw = dy^T x`` (a linear layer's backward): a 0-d ratio tensor.

    ``x`` (..., n) is the layer's input, ``dy`` (..., m) the gradient of its output, ``dw`` (m, n).
    Compares ``dw``'s column sums with ``(dy 1)^T x``; <= 1 for a correct product.
    """
    with torch.no_grad():
        ref, xcol, sdy, _, tokens = _grad_reference(x, dy)
        coef = rounding_coefficient(tokens, dw.shape[0], dw.dtype, input_roundoff=_input_roundoff(x))
        res = (_sum(dw, 0, ref.dtype) - ref).abs_().amax()
        return (res / (coef * xcol * sdy).clamp_min(_TINY)).float()


# -- hooks on a model ---------------------------------------------------------------------------

# custom-GEMM owner (a module) -> the GemmChecks that report it; weak so a dropped model leaves no trace
_OBSERVERS: "weakref.WeakKeyDictionary[nn.Module, list[GemmChecks]]" = weakref.WeakKeyDictionary()


def observe_gemm(owner: nn.Module, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
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

    def __init__(self, model: nn.Module, *, active: Callable[[], bool] = lambda: True, modules: str = "*",
                 weights: bool = True) -> None:
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
                if m.weight.requires_grad and owners.get(id(m.weight), 0) == 1:
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
                    self._sealed_at[i] = (_sum(w, 0, acc),  # as the forward does: the same bits give the same sum
                                          _sum(b, None, acc) if isinstance(b, torch.Tensor) else None)

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

    def observe(self, owner: nn.Module, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                bias: torch.Tensor | None = None) -> None:
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

