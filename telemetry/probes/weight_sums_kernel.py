"""The Triton kernel behind :func:`~sdcwatch.telemetry.probes.weight_sums.weight_sums`: one read of a
weight writes, per block of rows and of columns, the partial column sums and row sums of squares in
float32. Imports without triton (no kernel then); ``TRITON_INTERPRET=1`` runs it on a CPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # weight_sums runs torch ops instead
    triton = tl = None

__all__ = ["launch_weight_sums", "grid_of"]

BLOCK_M = 32
BLOCK_N = 128
#: Programs to aim for: a few per multiprocessor of a large GPU (132 on an H100), for bandwidth.
PROGRAMS = 1024


def _weight_sums_body(
    w_ptr,
    cols_ptr,
    rows_ptr,
    m,
    n,
    rows_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    pn = tl.program_id(0)  # column block
    pm = tl.program_id(1)  # row split
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < n
    col_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pm * rows_per_split
    for start in range(0, rows_per_split, BLOCK_M):
        rows = first + start + tl.arange(0, BLOCK_M)
        in_rows = (rows < m) & (start + tl.arange(0, BLOCK_M) < rows_per_split)
        mask = in_rows[:, None] & in_cols[None, :]
        ptrs = w_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :]
        if BF16_BITS:  # bf16 read as its int16 bits (exact in the interpreter too, subnormals included)
            v = (tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        col_acc += tl.sum(v, axis=0)
        tl.store(rows_ptr + pn.to(tl.int64) * m + rows, tl.sum(v * v, axis=1), mask=in_rows)
    tl.store(cols_ptr + pm.to(tl.int64) * n + cols, col_acc, mask=in_cols)


_weight_sums_kernel = triton.jit(_weight_sums_body) if triton is not None else None


def grid_of(m: int, n: int) -> tuple[int, int, int]:
    """(column blocks, row splits, rows per split) for an (m, n) weight."""
    col_blocks = -(-n // BLOCK_N)
    splits = max(1, min(-(-m // BLOCK_M), -(-PROGRAMS // col_blocks)))
    rows_per_split = -(-(-(-m // splits)) // BLOCK_M) * BLOCK_M  # whole BLOCK_M tiles
    splits = -(-m // rows_per_split)
    return col_blocks, splits, rows_per_split


def launch_weight_sums(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial column sums (splits, n), partial row sums of squares (column blocks, m)), float32,
    of the contiguous 2-d ``w`` (float32, bfloat16 or float16)."""
    if _weight_sums_kernel is None:
        raise RuntimeError("the weight_sums kernel needs triton, which does not import here")
    m, n = w.shape
    col_blocks, splits, rows_per_split = grid_of(m, n)
    cols = torch.empty((splits, n), dtype=torch.float32, device=w.device)
    rows = torch.empty((col_blocks, m), dtype=torch.float32, device=w.device)
    bf16 = w.dtype == torch.bfloat16
    _weight_sums_kernel[(col_blocks, splits)](
        w.view(torch.int16) if bf16 else w,
        cols,
        rows,
        m,
        n,
        rows_per_split,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BF16_BITS=bf16,
        num_warps=4,
    )
    return cols, rows
