"""What a weight's seal reads from it, in one pass: its column sums (the forward checksum's ``W^T 1``
and the weights-in-memory comparison) and ``Σ_j ||w_j||``, the sum of its rows' norms (the forward
bound's weight factor and the weight check's rounding bound).
(docs/probes.md, "How the probes are built", says how and why.)
"""

from __future__ import annotations

import torch

from sdcwatch.telemetry.probes.checksum_bounds import accumulated_sum
from sdcwatch.telemetry.probes.row_scan import triton_available

__all__ = ["weight_sums", "weight_sums_reference"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def weight_sums_reference(w: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w.sum(0), Σ_j ||w_j||)`` accumulated in ``acc`` by torch's reductions: (n,) and 0-d."""
    return accumulated_sum(w, 0, acc), torch.linalg.vector_norm(w, dim=1, dtype=acc).sum()


def weight_sums(
    w: torch.Tensor, acc: torch.dtype, *, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The column sums (n,) and the sum of the row norms (0-d) of the 2-d ``w``, accumulated in ``acc``.

    ``use_triton``: None takes the one-read Triton kernel for a contiguous float32, bfloat16 or
    float16 weight on CUDA accumulated in float32 (where triton imports), torch's two reductions otherwise; True always the kernel (a CPU tensor only under
    ``TRITON_INTERPRET=1``); False torch's. The two agree to float32 rounding, not bit for bit.
    """
    if use_triton is None:
        use_triton = (
            w.is_cuda
            and acc == torch.float32
            and w.dtype in _KERNEL_DTYPES
            and w.is_contiguous()
            and triton_available()
        )
    if not use_triton or w.dim() != 2 or w.numel() == 0:
        return weight_sums_reference(w, acc)
    from sdcwatch.telemetry.probes.weight_sums_kernel import launch_weight_sums

    w = w.detach().contiguous()
    if w.is_cuda:
        with torch.cuda.device(w.device):  # triton launches on the current device
            cols, rows = launch_weight_sums(w)
    else:
        cols, rows = launch_weight_sums(w)
    # the partial sums of each column over the row blocks, of each row over the column blocks:
    # a fixed order, so the same weight always gives the same bits
    return cols.sum(0), rows.sum(0).sqrt().sum()
