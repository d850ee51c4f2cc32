"""One read of a product's output: each row's fp32 sum, largest |value| and count of NaN/Inf/near-INF
elements, from one Triton kernel on a GPU or plain torch ops elsewhere, and ``sdcwatch::row_scan``,
the same as a custom operator ``torch.compile`` calls without a graph break (docs/probes.md).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from sdcwatch.telemetry.probes.forward_order import NEAR_INF

__all__ = [
    "FUSED_DTYPES",
    "launch_on",
    "near_inf_limit",
    "row_scan",
    "row_scan_op",
    "row_scan_reference",
    "triton_available",
]

#: The dtypes the Triton kernels read.
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# worked out at import, so the step path never reads a tensor to the host for them
_limits = {dtype: float(torch.tensor(NEAR_INF, dtype=dtype)) for dtype in (*FUSED_DTYPES, torch.float64)}


def near_inf_limit(dtype: torch.dtype) -> float:
    """:data:`NEAR_INF` as a tensor of ``dtype`` holds it: 1e10 in fp32, 9999220736 in bf16, inf in fp16."""
    limit = _limits.get(dtype)
    if limit is None:
        limit = _limits[dtype] = float(torch.tensor(NEAR_INF, dtype=dtype))
    return limit


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (tried once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def launch_on(t: torch.Tensor, launch: Callable[[], Any]) -> Any:
    """``launch()`` with ``t``'s CUDA device current (triton launches on the current device)."""
    if not t.is_cuda:
        return launch()
    with torch.cuda.device(t.device):
        return launch()


def _rows(y: torch.Tensor) -> torch.Tensor:
    """``y`` as (R, n) over its last dim, the last dim contiguous (a view where strides allow)."""
    if y.dim() == 0:
        y = y.reshape(1)
    if y.stride(-1) != 1:
        y = y.contiguous()
    return y.reshape(math.prod(y.shape[:-1]), y.shape[-1])


def _empty_scan(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    R = math.prod(y.shape[:-1])
    zeros = torch.zeros(R, dtype=torch.float32, device=y.device)
    return zeros, zeros.clone(), torch.zeros(R, dtype=torch.int32, device=y.device)


def row_scan_reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`row_scan` gives, in plain torch ops (bit for bit ``y.sum(-1, dtype=torch.float32)``
    and ``y.abs().amax(-1).float()``, flattened to (R,)); empty rows give 0, 0, 0; no gradient."""
    y = y.detach()
    if y.dim() == 0:
        y = y.reshape(1)
    if y.shape[-1] == 0:
        return _empty_scan(y)
    a = y.abs()
    sums = y.sum(-1, dtype=torch.float32).reshape(-1)
    peaks = a.amax(-1).float().reshape(-1)
    bad = ((a >= near_inf_limit(y.dtype)) | a.isnan()).sum(-1, dtype=torch.int32).reshape(-1)
    return sums, peaks, bad


def row_scan(y: torch.Tensor, *, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's fp32 sum (to fp32 rounding), largest |value| (exactly, NaN kept) and count of NaN,
    +-inf or ``>= NEAR_INF`` elements over ``y``'s last dim: three (R,) tensors (float32, float32,
    int32). ``use_triton``: None the Triton kernel on CUDA where triton imports, else
    :func:`row_scan_reference`; True always the kernel (on a CPU under ``TRITON_INTERPRET=1``).
    """
    if not y.is_floating_point():
        raise TypeError(f"row_scan needs a floating tensor, got {y.dtype}")
    if use_triton is None:
        use_triton = y.is_cuda and y.dtype in FUSED_DTYPES and triton_available()
    if not use_triton:
        return row_scan_reference(y)
    if y.dtype not in FUSED_DTYPES:
        raise TypeError(f"the row_scan kernel reads float32, bfloat16 or float16, got {y.dtype}")
    y2 = _rows(y.detach())
    if y2.shape[0] == 0 or y2.shape[1] == 0:
        return _empty_scan(y2)
    from sdcwatch.telemetry.probes.row_scan_kernel import launch_row_scan

    R = y2.shape[0]
    sums = torch.empty(R, dtype=torch.float32, device=y2.device)
    peaks = torch.empty(R, dtype=torch.float32, device=y2.device)
    bad = torch.empty(R, dtype=torch.int32, device=y2.device)
    launch_on(y2, lambda: launch_row_scan(y2, sums, peaks, bad, near_inf_limit(y2.dtype)))
    return sums, peaks, bad


@torch.library.custom_op("sdcwatch::row_scan", mutates_args=())
def row_scan_op(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`row_scan` as ``torch.ops.sdcwatch.row_scan``: one opaque call to ``torch.compile``, no gradient."""
    return row_scan(y)


@row_scan_op.register_fake
def _row_scan_fake(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    R = math.prod(y.shape[:-1]) if y.dim() else 1
    return (
        y.new_empty((R,), dtype=torch.float32),
        y.new_empty((R,), dtype=torch.float32),
        y.new_empty((R,), dtype=torch.int32),
    )


def _no_gradient(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output)


def _backward(ctx, *grads) -> None:
    return None


row_scan_op.register_autograd(_backward, setup_context=_no_gradient)
