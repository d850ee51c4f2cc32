"""What a weight's seal reads from it, in one pass: its column sums (``W^T 1``) and ``Σ_j ||w_j||``,
the sum of its rows' norms (the bounds' weight factor; docs/probes.md says how and why).
"""

from __future__ import annotations

import torch

from sdcwatch.telemetry.probes.checksum_bounds import accumulated_sum
from sdcwatch.telemetry.probes.row_scan import FUSED_DTYPES, launch_on, triton_available

__all__ = ["weight_sums", "weight_sums_reference"]


def weight_sums_reference(w: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w.sum(0), Σ_j ||w_j||)`` accumulated in ``acc`` by torch's reductions: (n,) and 0-d."""
    return accumulated_sum(w, 0, acc), torch.linalg.vector_norm(w, dim=1, dtype=acc).sum()


def weight_sums(
    w: torch.Tensor, acc: torch.dtype, *, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The column sums (n,) and the sum of the row norms (0-d) of the 2-d ``w``, accumulated in ``acc``.
    ``use_triton``: None the one-read kernel for a contiguous weight on CUDA in float32 where triton
    imports, else torch's reductions (they agree to float32 rounding); True always the kernel.
    """
    if use_triton is None:
        use_triton = (
            w.is_cuda and acc == torch.float32 and w.dtype in FUSED_DTYPES and w.is_contiguous() and triton_available()
        )
    if not use_triton or w.dim() != 2 or w.numel() == 0:
        return weight_sums_reference(w, acc)
    from sdcwatch.telemetry.probes.weight_sums_kernel import launch_weight_sums

    w = w.detach().contiguous()
    cols, rows = launch_on(w, lambda: launch_weight_sums(w))
    # the partial sums of each column over the row blocks, of each row over the column blocks:
    # a fixed order, so the same weight always gives the same bits
    return cols.sum(0), rows.sum(0).sqrt().sum()
