"""Matrix-product checksums (algorithm-based fault tolerance) and their rounding bounds: ``C 1 = A (B 1)``
for a product, ``1^T dW = (dY 1)^T X`` for its weight gradient, each within a bound derived from
the lengths, norms and dtypes involved, so a correct product never passes it (docs/probes.md derives it)."""

from __future__ import annotations

import math

import torch

__all__ = [
    "TINY",
    "abs_max",
    "accumulated_sum",
    "accumulation_dtype",
    "bias_grad_coefficient",
    "gemm_input_roundoff",
    "grad_reference",
    "linear_check_bound",
    "matmul_check_bound",
    "memory_bound_of",
    "product_dtype",
    "check_linear",
    "check_matmul",
    "check_weight_grad",
    "rounding_coefficient",
    "underflow_floor",
    "unit_roundoff",
    "weight_grad_check_bound",
]

#: Keeps an all-zero product's bound positive (0 / tiny = 0, any residual is huge).
TINY = 1e-30


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff ``u`` of a floating dtype (2^-24 for float32, 2^-8 for bfloat16)."""
    u = _UNIT_ROUNDOFF.get(dtype)
    return torch.finfo(dtype).eps / 2 if u is None else u


_UNIT_ROUNDOFF = {d: torch.finfo(d).eps / 2 for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}


def rounding_gamma(k: int, u: float) -> float:
    """``γ_k = k u / (1 - k u)``: the relative error bound of a sum of ``k`` terms (inf past k u = 1/2)."""
    ku = k * u
    return ku / (1.0 - ku) if ku < 0.5 else math.inf


def accumulated_sum(t: torch.Tensor, dim: int | None, acc: torch.dtype) -> torch.Tensor:
    """``t.sum`` accumulated in ``acc`` (asking for the dtype it already has takes a slower path)."""
    if t.dtype == acc:
        return t.sum() if dim is None else t.sum(dim)
    return t.sum(dtype=acc) if dim is None else t.sum(dim, dtype=acc)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What GEMMs accumulate in: float64 for float64, float32 for everything narrower."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def product_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype a product was rounded to: the narrowest floating one of its result's and its
    output gradient's (autocast computes a float32 weight's gradient in bfloat16, then casts it up)."""
    floats = [d for d in dtypes if d.is_floating_point] or list(dtypes)
    return max(floats, key=unit_roundoff)


#: Where ``torch.is_autocast_enabled`` knows the device type.
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu"})


def gemm_input_roundoff(a: torch.Tensor, b: torch.Tensor | None = None, *, compute: torch.dtype | None = None) -> float:
    """Relative rounding of a GEMM's inputs ``u_in`` (the mean over ``a`` and ``b``): an operand cast
    down to ``compute`` (the product's dtype; None: autocast's for ``a``'s device, else ``a``'s), or
    TF32 on CUDA float32. ``b`` None: like ``a``, but cast under autocast (a float32 weight).
    """
    autocast = False
    if compute is None:
        device = "cuda" if a.is_cuda else "cpu" if a.is_cpu else a.device.type
        autocast = device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device) and a.is_floating_point()
        compute = torch.get_autocast_dtype(device) if autocast else a.dtype
    ra = _operand_roundoff(a, compute)
    if b is not None:
        rb = _operand_roundoff(b, compute)
    elif autocast and unit_roundoff(compute) > unit_roundoff(torch.float32):
        rb = unit_roundoff(compute)
    else:
        rb = ra
    return ra if ra == rb else (ra + rb) / 2


def _operand_roundoff(t: torch.Tensor, compute: torch.dtype) -> float:
    """Relative rounding of one GEMM operand: cast down to ``compute``, or TF32 on CUDA float32."""
    if t.dtype == compute:
        tf32 = compute == torch.float32 and t.is_cuda and torch.backends.cuda.matmul.allow_tf32
        return 2.0**-11 if tf32 else 0.0
    if t.is_floating_point() and compute.is_floating_point and unit_roundoff(t.dtype) < unit_roundoff(compute):
        return unit_roundoff(compute)
    return 0.0


def rounding_coefficient(n: int, m: int, out_dtype: torch.dtype, *, input_roundoff: float = 0.0) -> float:
    """``c = 2γ_n + 3γ_m + u_out + 2 u_in``: the bound of a checksum over ``m`` outputs of inner
    products of length ``n`` rounded to ``out_dtype``, relative to ``||row|| x Σ ||column||``; a
    narrow product, or rounded inputs, add the second order ``x (1 + u_out)(1 + u_in)^2``."""
    u = unit_roundoff(accumulation_dtype(out_dtype))
    u_out = unit_roundoff(out_dtype)
    c = 2 * rounding_gamma(n, u) + 3 * rounding_gamma(m, u) + u_out + 2 * input_roundoff
    if u_out > u or input_roundoff > 0:
        c *= (1 + u_out) * (1 + input_roundoff) ** 2
    return c


def underflow_floor(m: int, out_dtype: torch.dtype) -> float:
    """Absolute error of ``m`` outputs rounded into ``out_dtype``'s subnormal range (``u_out``
    times its smallest normal each), where it is above :data:`TINY`: float16's; 0 otherwise."""
    if not out_dtype.is_floating_point:
        return 0.0
    floor = m * unit_roundoff(out_dtype) * torch.finfo(out_dtype).smallest_normal
    return floor if floor > TINY else 0.0


def bias_grad_coefficient(tokens: int, m: int, out_dtype: torch.dtype) -> float:
    """``2γ_N + γ_m + u_out``: the bias gradient's check ``Σ db = Σ dY`` relative to ``Σ|dY|``
    (a narrow ``db``: ``(2γ_N + 2γ_m + u_out)(1 + u_out)``)."""
    u = unit_roundoff(accumulation_dtype(out_dtype))
    u_out = unit_roundoff(out_dtype)
    c = 2 * rounding_gamma(tokens, u) + rounding_gamma(m, u) + u_out
    if u_out > u:  # a narrow db: the reference's row sums (γ_m) and the second order too
        c = (c + rounding_gamma(m, u)) * (1 + u_out)
    return c


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """Largest |value| of ``t`` as a 0-d tensor (NaN if any; two fast reductions, no copy)."""
    return torch.maximum(t.amax(), -t.amin())


def _floored(bound: torch.Tensor, floor: float) -> torch.Tensor:
    """``bound`` plus the underflow ``floor`` (where there is one), kept positive."""
    return (bound + floor if floor else bound).clamp_min(TINY)


def linear_check_bound(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The absolute bound :func:`check_linear` holds the row sums of ``y = x weight^T + bias`` to (0-d):
    ``c (sqrt(n) max|x| S_w + S_b)`` with ``S_w = Σ_j ||w_j||`` (+ the underflow floor)."""
    acc = accumulation_dtype(out_dtype)
    sw = torch.linalg.vector_norm(weight, dim=1, dtype=acc).sum()
    roundoff = gemm_input_roundoff(x, weight, compute=out_dtype)
    coef = rounding_coefficient(weight.shape[1], weight.shape[0], out_dtype, input_roundoff=roundoff)
    scale = abs_max(x).to(acc) * (math.sqrt(x.shape[-1]) * sw)
    if bias is not None:
        scale = scale + accumulated_sum(bias.abs(), None, acc)
    return _floored(scale * coef, underflow_floor(weight.shape[0], out_dtype))


def check_linear(
    x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Forward checksum of ``y = x weight^T + bias``: a 0-d device tensor, the largest residual of
    ``y``'s row sums against ``x (weight^T 1) + Σ bias`` over its rounding bound: <= 1 for a correct
    product, > 1 when an element of ``y`` is off by more than rounding explains, NaN or Inf with ``y``'s.
    """
    with torch.no_grad():
        if x.numel() == 0 or y.numel() == 0:
            return torch.zeros((), device=y.device)
        acc = accumulation_dtype(y.dtype)
        ref = (x if x.dtype == acc else x.to(acc)) @ accumulated_sum(weight, 0, acc)
        if bias is not None:
            ref = ref + accumulated_sum(bias, None, acc)
        bound = linear_check_bound(x, weight, bias, y.dtype)
        return ((accumulated_sum(y, -1, acc) - ref).abs_().amax() / bound).float()


def check_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Checksum of a (batched) product ``c = a @ b (+ bias)`` from any kernel (e.g. ``probs @ v`` of
    attention): a 0-d ratio tensor as :func:`check_linear`'s. ``a`` is (..., N, n), ``b`` (..., n, m)
    or (n, m), ``c`` (..., N, m), ``bias`` (m,).
    """
    with torch.no_grad():
        if a.numel() == 0 or c.numel() == 0:
            return torch.zeros((), device=c.device)
        acc = accumulation_dtype(c.dtype)
        v = accumulated_sum(b, -1, acc)  # (..., n)
        ys = accumulated_sum(c, -1, acc)  # (..., N)
        ref = ((a if a.dtype == acc else a.to(acc)) @ v.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            ref = ref + accumulated_sum(bias, None, acc)
        return ((ys - ref).abs_().amax() / matmul_check_bound(a, b, c.dtype, bias)).float()


def matmul_check_bound(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The absolute bound :func:`check_matmul` holds the row sums of ``a @ b (+ bias)`` to (0-d):
    ``c (n m max|a| max|b| + Σ|bias|)`` (+ the underflow floor; ``||a_i|| <= sqrt(n) max|a|``,
    ``Σ_j ||b_:j|| <= m sqrt(n) max|b|``)."""
    acc = accumulation_dtype(out_dtype)
    n, m = b.shape[-2], b.shape[-1]
    coef = rounding_coefficient(n, m, out_dtype, input_roundoff=gemm_input_roundoff(a, b, compute=out_dtype))
    scale = abs_max(a).to(acc) * abs_max(b).to(acc) * (n * m)
    if bias is not None:
        scale = scale + accumulated_sum(bias.abs(), None, acc)
    return _floored(scale * coef, underflow_floor(m, out_dtype))


def grad_reference(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """For the check of ``dW = dY^T X``: (expected column sums ``(dY 1)^T X`` (n,), the row sums
    ``s = dY 1`` (N,), ``||dY||_F``, N tokens), on the device."""
    acc = accumulation_dtype(dy.dtype)
    n, m = x.shape[-1], dy.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, m)
    s = accumulated_sum(dy2, -1, acc)
    ref = s @ (x2 if x2.dtype == acc else x2.to(acc))
    return ref, s, torch.linalg.vector_norm(dy2, dtype=acc), x2.shape[0]


def check_weight_grad(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """Checksum of a weight gradient ``dw = dy^T x`` (input ``x`` (..., n), output gradient ``dy``
    (..., m), ``dw`` (m, n)): a 0-d ratio tensor, <= 1 for a correct product."""
    with torch.no_grad():
        ref, _, dy_norm, tokens = grad_reference(x, dy)
        res = (accumulated_sum(dw, 0, ref.dtype) - ref).abs_().amax()
        return (res / weight_grad_check_bound(x, dy, dy_norm, tokens, dw)).float()


def weight_grad_check_bound(
    x: torch.Tensor, dy: torch.Tensor, dy_norm: torch.Tensor, tokens: int, dw: torch.Tensor
) -> torch.Tensor:
    """The absolute bound :func:`check_weight_grad` holds the column sums of ``dw = dy^T x`` to (0-d;
    ``dy_norm`` and ``tokens`` from :func:`grad_reference`): ``c' sqrt(N) max|X| sqrt(m) ||dY||_F``."""
    xcol = abs_max(x).to(dy_norm.dtype) * math.sqrt(tokens)
    out = product_dtype(dw.dtype, dy.dtype)
    coef = rounding_coefficient(tokens, dw.shape[0], out, input_roundoff=gemm_input_roundoff(x, dy, compute=out))
    return _floored(coef * xcol * (dy_norm * math.sqrt(dy.shape[-1])), underflow_floor(dw.shape[0], out))


def memory_bound_of(total: torch.Tensor, m: int) -> torch.Tensor:
    """``γ_m total``: the weight check's bound from ``Σ_j ||w_j||`` (or ``Σ|b|``) over ``m`` rows."""
    return (total * rounding_gamma(m, unit_roundoff(total.dtype))).clamp_min(TINY)
