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
    "bias_grad_bound",
    "accumulation_dtype",
    "bias_grad_coefficient",
    "gemm_input_roundoff",
    "grad_reference",
    "linear_bound",
    "matmul_bound",
    "memory_bound",
    "memory_bound_of",
    "product_dtype",
    "rounding_gamma",
    "check_linear",
    "check_matmul",
    "check_weight_grad",
    "rounding_coefficient",
    "underflow_floor",
    "unit_roundoff",
    "weight_grad_bound",
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
    """Relative rounding of a GEMM's inputs before the products (``u_in``; the coefficient counts
    ``2 u_in``, the mean over the two operands ``a`` and ``b``).

    ``compute`` is the dtype the product is computed in (its output's); None: the autocast dtype
    where autocast is on for ``a``'s device (a forward hook runs inside it), else ``a``'s. An
    operand wider than it was cast to it (autocast): its unit roundoff. A float32 product on
    CUDA float32 operands: TF32 where ``allow_tf32``; else none. ``b`` unknown (None): like ``a``,
    but cast under autocast (a float32 weight). Reads no setting a compiled graph breaks on.
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
    """``c = 2γ_n + 3γ_m + u_out + 2 u_in`` of the module docstring: the bound of a checksum over
    ``m`` outputs of inner products of length ``n``, relative to ``||row|| x Σ ||column||``;
    ``out_dtype`` is the dtype the products were rounded to (:func:`product_dtype`). A product
    narrower than its accumulation, or on rounded inputs, has its second order too:
    ``x (1 + u_out)(1 + u_in)^2``."""
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
    """``2γ_N + γ_m + u_out``: the bias gradient's check ``Σ db = Σ dY`` (the same sum in two
    orders) relative to ``Σ|dY|``; ``out_dtype`` the dtype ``db`` was rounded to (:func:`product_dtype`).
    A narrow ``db``: ``(2γ_N + 2γ_m + u_out)(1 + u_out)``."""
    u = unit_roundoff(accumulation_dtype(out_dtype))
    u_out = unit_roundoff(out_dtype)
    c = 2 * rounding_gamma(tokens, u) + rounding_gamma(m, u) + u_out
    if u_out > u:  # a narrow db: the reference's row sums (γ_m) and the second order too
        c = (c + rounding_gamma(m, u)) * (1 + u_out)
    return c


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """Largest |value| of ``t`` as a 0-d tensor (NaN if any; two fast reductions, no copy)."""
    return torch.maximum(t.amax(), -t.amin())


def _forward_ratio(
    x: torch.Tensor, v: torch.Tensor, y: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None, coef: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ratio, largest |input|, bound) given ``v = B 1`` (n,) and ``sw = Σ ||column of B||``."""
    acc = v.dtype
    ys = accumulated_sum(y, -1, acc)
    ref = (x if x.dtype == acc else x.to(acc)) @ v
    if bias is not None:
        ref = ref + accumulated_sum(bias, None, acc)
    xn, bound = _forward_bound(x, sw, bias, coef, acc, underflow_floor(y.shape[-1], y.dtype))
    return (ys - ref).abs_().amax() / bound, xn, bound


def _forward_bound(
    x: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None, coef: float, acc: torch.dtype, floor: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest |input|, ``c (sqrt(n) max|x| S_w + S_b)`` (+ ``floor``)): the bound of a linear layer's checksum."""
    xn = abs_max(x).to(acc)
    scale = xn * (math.sqrt(x.shape[-1]) * sw)
    if bias is not None:
        scale = scale + accumulated_sum(bias.abs(), None, acc)
    bound = scale * coef
    return xn, (bound + floor if floor else bound).clamp_min(TINY)


def _linear_terms(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.dtype, torch.Tensor, float]:
    """(accumulation dtype, ``S_w = Σ_j ||w_j||``, rounding coefficient) of ``x weight^T``."""
    acc = accumulation_dtype(out_dtype)
    sw = torch.linalg.vector_norm(weight, dim=1, dtype=acc).sum()
    roundoff = gemm_input_roundoff(x, weight, compute=out_dtype)
    coef = rounding_coefficient(weight.shape[1], weight.shape[0], out_dtype, input_roundoff=roundoff)
    return acc, sw, coef


def check_linear(
    x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Forward checksum of ``y = x weight^T + bias`` (``torch.nn.functional.linear``): a 0-d tensor.

    The largest residual of ``y``'s row sums against ``x (weight^T 1) + Σ bias``, over its rounding
    bound (module docstring): <= 1 for a correct product, > 1 when an element of ``y`` is off by
    more than rounding can explain, NaN or Inf when ``y`` holds one. Stays on the device.
    """
    with torch.no_grad():
        if x.numel() == 0 or y.numel() == 0:
            return torch.zeros((), device=y.device)
        acc, sw, coef = _linear_terms(x, weight, y.dtype)
        v = accumulated_sum(weight, 0, acc)
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
        acc = accumulation_dtype(c.dtype)
        n, m = b.shape[-2], b.shape[-1]
        coef = rounding_coefficient(n, m, c.dtype, input_roundoff=gemm_input_roundoff(a, b, compute=c.dtype))
        v = accumulated_sum(b, -1, acc)  # (..., n)
        ys = accumulated_sum(c, -1, acc)  # (..., N)
        ref = ((a if a.dtype == acc else a.to(acc)) @ v.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            ref = ref + accumulated_sum(bias, None, acc)
        return _matmul_ratio(a, b, ys, ref, bias, coef, acc, underflow_floor(m, c.dtype))[0]


def _matmul_ratio(
    a: torch.Tensor,
    b: torch.Tensor,
    ys: torch.Tensor,
    ref: torch.Tensor,
    bias: torch.Tensor | None,
    coef: float,
    acc: torch.dtype,
    floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, bound) of a product's checksum; ``||a_i|| <= sqrt(n) max|a|`` and
    ``Σ_j ||b_:j|| <= m sqrt(n) max|b|`` (one fast reduction each)."""
    bound = _matmul_bound(a, b, bias, coef, acc, floor)
    return ((ys - ref).abs_().amax() / bound).float(), bound


def _matmul_bound(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, coef: float, acc: torch.dtype, floor: float = 0.0
) -> torch.Tensor:
    """``c (n m max|a| max|b| + Σ|bias|)`` (+ ``floor``): the bound of a product's checksum."""
    n, m = b.shape[-2], b.shape[-1]
    scale = abs_max(a).to(acc) * abs_max(b).to(acc) * (n * m)
    if bias is not None:
        scale = scale + accumulated_sum(bias.abs(), None, acc)
    bound = scale * coef
    return (bound + floor if floor else bound).clamp_min(TINY)


def grad_reference(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The reductions the check of a weight gradient ``dW = dY^T X`` needs, kept on the device:
    (expected column sums ``(dY 1)^T X`` (n,), the row sums ``s = dY 1`` (N,), ``||dY||_F``,
    N tokens). ``Σ_j ||dY_:j|| <= sqrt(m) ||dY||_F`` and ``Σ dY = Σ s`` follow from them."""
    acc = accumulation_dtype(dy.dtype)
    n, m = x.shape[-1], dy.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, m)
    s = accumulated_sum(dy2, -1, acc)
    ref = s @ (x2 if x2.dtype == acc else x2.to(acc))
    return ref, s, torch.linalg.vector_norm(dy2, dtype=acc), x2.shape[0]


def check_weight_grad(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """Checksum of a weight gradient ``dw = dy^T x`` (a linear layer's backward): a 0-d ratio tensor.

    ``x`` (..., n) is the layer's input, ``dy`` (..., m) the gradient of its output, ``dw`` (m, n).
    Compares ``dw``'s column sums with ``(dy 1)^T x``; <= 1 for a correct product.
    """
    with torch.no_grad():
        ref, _, dy_norm, tokens = grad_reference(x, dy)
        res = (accumulated_sum(dw, 0, ref.dtype) - ref).abs_().amax()
        return (res / _weight_grad_bound(x, dy, dy_norm, tokens, dw)).float()


def _weight_grad_bound(
    x: torch.Tensor, dy: torch.Tensor, dy_norm: torch.Tensor, tokens: int, dw: torch.Tensor
) -> torch.Tensor:
    """``c' sqrt(N) max|X| sqrt(m) ||dY||_F``: the bound of a weight gradient's checksum
    (``max_k ||X_:k|| <= sqrt(N) max|X|``, ``Σ_j ||dY_:j|| <= sqrt(m) ||dY||_F``); the product was
    rounded to ``dY``'s dtype where that is narrower than ``dW``'s (autocast)."""
    xcol = abs_max(x).to(dy_norm.dtype) * math.sqrt(tokens)
    out = product_dtype(dw.dtype, dy.dtype)
    coef = rounding_coefficient(tokens, dw.shape[0], out, input_roundoff=gemm_input_roundoff(x, dy, compute=out))
    bound = coef * xcol * (dy_norm * math.sqrt(dy.shape[-1]))
    floor = underflow_floor(dw.shape[0], out)
    return (bound + floor if floor else bound).clamp_min(TINY)


# -- the bounds on their own: how large a change of one element each check is sure to see ------------
# (a fault-injection campaign asks it of every fault, whether or not the probes checked its step)


def linear_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> float:
    """The absolute bound :func:`check_linear` holds the row sums of ``y = x weight^T + bias`` to:
    an element of ``y`` changed by more than this breaks the forward checksum."""
    with torch.no_grad():
        acc, sw, coef = _linear_terms(x, weight, out_dtype)
        return float(_forward_bound(x, sw, bias, coef, acc, underflow_floor(weight.shape[0], out_dtype))[1])


def matmul_bound(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> float:
    """The absolute bound :func:`check_matmul` holds the row sums of ``a @ b (+ bias)`` to."""
    with torch.no_grad():
        acc = accumulation_dtype(out_dtype)
        n, m = b.shape[-2], b.shape[-1]
        coef = rounding_coefficient(n, m, out_dtype, input_roundoff=gemm_input_roundoff(a, b, compute=out_dtype))
        return float(_matmul_bound(a, b, bias, coef, acc, underflow_floor(m, out_dtype)))


def weight_grad_bound(x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor) -> float:
    """The absolute bound :func:`check_weight_grad` holds the column sums of ``dw = dy^T x`` to:
    an element of ``dw`` changed by more than this breaks the weight-gradient checksum."""
    with torch.no_grad():
        _, _, dy_norm, tokens = grad_reference(x, dy)
        return float(_weight_grad_bound(x, dy, dy_norm, tokens, dw))


def bias_grad_bound(dy: torch.Tensor, db: torch.Tensor) -> float:
    """The absolute bound of the bias gradient's check ``Σ db = Σ dY`` (the same sum in two orders:
    :func:`bias_grad_coefficient` times ``Σ|dY| <= sqrt(N m) ||dY||_F``)."""
    with torch.no_grad():
        m = dy.shape[-1]
        dy2 = dy.reshape(-1, m)
        tokens = dy2.shape[0]
        out = product_dtype(db.dtype, dy.dtype)
        coef = bias_grad_coefficient(tokens, db.numel(), out)
        bound = torch.linalg.vector_norm(dy2, dtype=accumulation_dtype(dy.dtype)) * math.sqrt(tokens * m) * coef
        floor = underflow_floor(db.numel(), out)
        return float((bound + floor if floor else bound).clamp_min(TINY))


def memory_bound(t: torch.Tensor) -> float:
    """The absolute bound of the weight check (weights in memory against their sums when last
    written): ``γ_m Σ_j ||w_j||`` for a (m, n) weight, ``γ_m Σ|b|`` for a bias of m values; a
    change of one value by less than this is lost in the column sum's own rounding."""
    with torch.no_grad():
        acc = accumulation_dtype(t.dtype)
        if t.dim() == 2:
            return float(memory_bound_of(torch.linalg.vector_norm(t, dim=1, dtype=acc).sum(), t.shape[0]))
        return float(memory_bound_of(accumulated_sum(t.abs(), None, acc), t.numel()))


def memory_bound_of(total: torch.Tensor, m: int) -> torch.Tensor:
    """``γ_m total`` (in ``total``'s dtype, the accumulation's): the weight check's bound from the
    weight's ``Σ_j ||w_j||`` (or a bias's ``Σ|b|``) over its ``m`` rows."""
    return (total * rounding_gamma(m, unit_roundoff(total.dtype))).clamp_min(TINY)
