"""The Triton kernel behind :func:`~sdcwatch.telemetry.probes.row_scan.row_scan`: one read of a product's
output rows writes each row's fp32 sum, largest |value| and count of NaN/Inf/near-INF elements.
Imports without triton (no kernel then); ``TRITON_INTERPRET=1`` set before triton's import runs it on a CPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # row_scan runs torch ops instead
    triton = tl = None

__all__ = ["launch_config", "launch_row_scan"]

# Input bytes one program reads per loop iteration: 4096 bf16/fp16 or 2048 fp32 elements, 32 bytes a
# thread at 8 warps (two 16-byte loads): enough bytes in flight to run near memory bandwidth with one
# row per program at LLM widths, few enough registers for the three accumulators.
_TILE_BYTES = 8192


def _row_scan_body(
    y_ptr,
    sums_ptr,
    peaks_ptr,
    bad_ptr,
    R,
    n,
    stride_r,
    limit,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = rows < R
    base = y_ptr + rows.to(tl.int64)[:, None] * stride_r
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    top = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    bad = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.int32)
    for start in range(0, n, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = in_rows[:, None] & (cols < n)[None, :]
        if BF16_BITS:  # bf16 read as its int16 bits: the top half of the fp32 word, subnormals included
            v = (tl.load(base + cols[None, :], mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            v = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.abs(v)
        acc += v
        # NaN kept in `top` element-wise; tl.max over the row drops it (max.f32 on a GPU, and in the
        # interpreter), so the row's NaN comes from the sum of `top`, NaN iff an element is (all >= 0)
        top = tl.maximum(top, a, propagate_nan=tl.PropagateNan.ALL)
        bad += ((a >= limit) | (v != v)).to(tl.int32)
    peak = tl.max(top, axis=1)
    nan_seen = tl.sum(top, axis=1)
    peak = tl.where(nan_seen != nan_seen, nan_seen, peak)
    tl.store(sums_ptr + rows, tl.sum(acc, axis=1), mask=in_rows)
    tl.store(peaks_ptr + rows, peak, mask=in_rows)
    tl.store(bad_ptr + rows, tl.sum(bad, axis=1), mask=in_rows)


_row_scan_kernel = triton.jit(_row_scan_body) if triton is not None else None


def _pow2_at_least(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def launch_config(R: int, n: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_N, num_warps) for R rows of n elements of ``elem_bytes`` bytes each."""
    tile = _TILE_BYTES // elem_bytes
    block_n = min(_pow2_at_least(n), tile)
    block_r = min(tile // block_n, _pow2_at_least(R))
    tile_bytes = block_r * block_n * elem_bytes  # 32 bytes a thread from 2 KiB tiles up
    num_warps = 8 if tile_bytes >= 8192 else 4 if tile_bytes >= 4096 else 2 if tile_bytes >= 2048 else 1
    return block_r, block_n, num_warps


def launch_row_scan(y2, sums, peaks, bad, limit: float, config: tuple[int, int, int] | None = None) -> None:
    """Write ``sums``, ``peaks``, ``bad`` ((R,) fp32, fp32, int32) for ``y2``: (R, n), unit column stride;
    ``config``: (BLOCK_R, BLOCK_N, num_warps) instead of :func:`launch_config`'s (a benchmark's sweep)."""
    if _row_scan_kernel is None:
        raise RuntimeError("the row_scan kernel needs triton, which does not import here")
    R, n = y2.shape
    block_r, block_n, num_warps = config or launch_config(R, n, y2.element_size())
    # bf16 -> fp32 is a 16-bit shift; done by hand it is exact in Triton's interpreter too, whose
    # own bf16 conversion loses subnormals (an exponent flip makes them)
    bf16 = y2.dtype == torch.bfloat16
    _row_scan_kernel[(-(-R // block_r),)](
        y2.view(torch.int16) if bf16 else y2,
        sums,
        peaks,
        bad,
        R,
        n,
        y2.stride(0),
        limit,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        BF16_BITS=bf16,
        num_warps=num_warps,
    )
