"""Extreme values in the forward pass that no matrix-product checksum sees: the residual stream.

A NaN, Inf or near-INF value (|x| >= 1e10, ATTNChecker's threshold) written into a block's output
travels down the residual stream, where the next LayerNorm absorbs it: the loss may never show it.
:class:`ResidualStream` records, on every checked step, the largest |value| of each block's output
(``stream_max``, one value per block) and of each attention layer's logits (``logit_max``).
The products' own inputs and outputs are covered by :mod:`sdcwatch.telemetry.checksum`
(``gemm_in`` and ``gemm_fwd``). ``-inf`` is how masked attention slots are written and is
skipped; NaN and ``+inf`` count.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from sdcwatch.core.names import STREAM_METRICS

__all__ = ["STREAM_METRICS", "ResidualStream", "peak", "repeated_blocks"]


def peak(t: torch.Tensor) -> torch.Tensor:
    """Largest |value| of ``t`` as a 0-d float32 device tensor; ``-inf`` skipped, NaN propagates.

    Two fast reductions, no copy; the minimum counts unless it is ``-inf`` (a mask).
    """
    t = t.detach()
    lo, hi = t.amin(), t.amax()
    lo_abs = torch.where(lo == float("-inf"), torch.zeros_like(lo), lo.abs())
    return torch.maximum(hi.abs(), lo_abs).float()  # NaN in hi or lo survives torch.maximum


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks: children of every ``nn.ModuleList`` that are not single layers
    (``blocks.0``, ``h.3``, ``model.layers.11``...), in model order."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            for i, child in enumerate(m):
                if any(True for _ in child.children()):  # a container, i.e. a block
                    out.append((f"{name}.{i}" if name else str(i), child))
    return out


class ResidualStream:
    """Per-step largest |value| of every block's output and of every attention layer's logits."""

    def __init__(self, model: nn.Module, *, active: Callable[[], bool] = lambda: True, n_attention: int = 0) -> None:
        self.active = active
        self.blocks = repeated_blocks(model)
        self.names = [n for n, _ in self.blocks]
        self._n_attention = n_attention
        self._handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(self.blocks)]
        self._reset()

    def _reset(self) -> None:
        self._stream: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._logits: dict[int, torch.Tensor] = {}

    def _hook(self, i: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.active():
                return
            out = output
            if isinstance(out, (tuple, list)) and out:
                out = out[0]  # Hugging Face blocks return (hidden_states, ...)
            if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
                return
            m = peak(out)
            old = self._stream[i]
            self._stream[i] = m if old is None else torch.maximum(old, m)

        return hook

    def observe_logits(self, layer: int, logits: torch.Tensor) -> None:
        """The pre-softmax logits of attention layer ``layer`` (masked slots ``-inf``)."""
        if logits.numel() == 0:
            return
        # the maximum skips masked slots (-inf) and keeps NaN and +inf; a large negative logit acts
        # as a mask (its softmax weight is 0 either way) and is left out, which halves the cost
        m = logits.detach().amax().float()
        old = self._logits.get(layer)
        self._logits[layer] = m if old is None else torch.maximum(old, m)

    def collect(self, n_attention: int | None = None) -> dict[str, torch.Tensor] | None:
        """This step's values per :data:`STREAM_METRICS` (None if nothing was seen); resets."""
        seen = [t for t in self._stream if t is not None] + list(self._logits.values())
        if not seen:
            self._reset()
            return None
        device = seen[0].device
        zero = torch.zeros((), device=device)
        out = {}
        if any(t is not None for t in self._stream):
            out["stream_max"] = torch.stack([zero if t is None else t for t in self._stream])
        n = self._n_attention if n_attention is None else n_attention
        if self._logits:
            n = max(n, max(self._logits) + 1)
            out["logit_max"] = torch.stack([self._logits.get(i, zero).to(device) for i in range(n)])
        self._reset()
        return out

    def discard(self) -> None:
        self._reset()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
