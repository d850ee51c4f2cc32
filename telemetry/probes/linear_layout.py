"""Which modules are linear layers, and their weight as ``(out_features, in_features)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["is_linear", "linear_weight", "transposed"]


def transposed(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D``: a linear layer whose weight is stored
    ``(in, out)`` (recognised by its name and its ``nf`` output width, without importing
    transformers)."""
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(w, torch.Tensor)
        and w.dim() == 2
        and w.shape[1] == getattr(module, "nf", None)
    )


def is_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes ``y = x W^T + b`` with a 2-D weight: ``nn.Linear`` and ``Conv1D``."""
    return isinstance(module, nn.Linear) or transposed(module)


def linear_weight(module: nn.Module) -> tuple[Any, Any]:
    """``(W, b)`` of a linear layer with ``W`` as ``(out_features, in_features)``: the parameter
    itself for ``nn.Linear``, its transposed view for ``Conv1D``."""
    w, b = module.weight, getattr(module, "bias", None)
    return (w.t() if transposed(module) else w), b
