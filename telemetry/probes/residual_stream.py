"""Extreme values in the forward pass that no matrix-product checksum sees: the residual stream (docs/probes.md)."""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from sdcwatch.telemetry.probes.compiled_calls import cached, kept_calls, remove_hooks
from sdcwatch.telemetry.probes.forward_order import ForwardOrder
from torch import nn

__all__ = ["ResidualStream", "peak", "repeated_blocks"]

_SERIALS = itertools.count()


def peak(t: torch.Tensor) -> torch.Tensor:
    """Largest |value| of ``t`` as a 0-d float32 device tensor (two reductions); ``-inf`` skipped, NaN kept."""
    t = t.detach()
    lo, hi = t.amin(), t.amax()
    lo_abs = torch.where(lo == float("-inf"), torch.zeros_like(lo), lo.abs())
    return torch.maximum(hi.abs(), lo_abs).float()  # NaN in hi or lo survives torch.maximum


@functools.lru_cache(maxsize=None)
def _mask_level(dtype: torch.dtype) -> float:
    """Half the dtype's lowest value: a logit at or below it is a mask mark (-inf, or Hugging Face's
    additive ``torch.finfo(dtype).min`` moved by a few units in the last place), not a logit."""
    return torch.finfo(dtype).min / 2


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

    def __init__(
        self,
        model: nn.Module,
        *,
        active: Callable[[], bool] = lambda: True,
        n_attention: int = 0,
        order: ForwardOrder | None = None,
    ) -> None:
        self.active = active
        self.order = order  # numbers the observations in forward order (nonfinite_first)
        self.blocks = repeated_blocks(model)
        self.names = [n for n, _ in self.blocks]
        self._n_attention = n_attention
        self._index: dict[tuple, torch.Tensor] = {}
        # compiled code keeps each call on the block itself (see _traced_block): named per instance
        serial = next(_SERIALS)
        self._calls_attr = f"_sdcwatch_stream_{serial}"
        self.logits_attr = f"_sdcwatch_logits_{serial}"  # where compiled code keeps a layer's logits
        self.attention_layers: list[nn.Module] = []  # the watch's, in layer order
        self._block_of: dict[int, int] = {}
        for i, (_, m) in enumerate(self.blocks):
            self._block_of[id(m)] = i
            m.__dict__[self._calls_attr] = []
        self._handles = [m.register_forward_hook(self._block_hook) for _, m in self.blocks]
        self._reset()

    def _reset(self) -> None:
        kept_calls([m for _, m in self.blocks], self._calls_attr)  # compiled code's calls of a dropped step
        kept_calls(self.attention_layers, self.logits_attr)
        # per call: block index and the output's largest and smallest value (0-d device tensors);
        # the -inf mask and the maxima over calls are resolved once per step in collect()
        self._block: list[int] = []
        self._hi: list[torch.Tensor] = []
        self._lo: list[torch.Tensor] = []
        self._layer: list[int] = []
        self._logit: list[torch.Tensor] = []
        self._logit_low: list[torch.Tensor] = []
        self._block_seq: list[int] = []  # forward ordinals of the block calls and the logits
        self._layer_seq: list[int] = []

    def _block_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        """The forward hook of every block (one function: traced code holds no block index)."""
        if not self.active():
            return
        out = output
        if isinstance(out, (tuple, list)) and out:
            out = out[0]  # Hugging Face blocks return (hidden_states, ...)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.numel() == 0:
            return
        out = out.detach()
        if torch.compiler.is_compiling():  # the call kept on the block, its ordinal counted on the device
            ordinal = self.order.traced_tick() if self.order is not None else None
            module.__dict__[self._calls_attr].append((out.amax(), out.amin(), ordinal))
            return
        self._block.append(self._block_of[id(module)])
        if self.order is not None:
            self._block_seq.append(self.order.tick())
        self._hi.append(out.amax())
        self._lo.append(out.amin())

    def observe_logits_traced(self, module: nn.Module, logits: torch.Tensor) -> None:
        """:meth:`observe_logits` in traced code: kept on the layer, its ordinal counted on the device."""
        if logits.numel() == 0:
            return
        logits = logits.detach()
        ordinal = self.order.traced_tick() if self.order is not None else None
        low = F.threshold(logits, _mask_level(logits.dtype), 0.0).amin()
        module.__dict__[self.logits_attr].append((logits.amax(), low, ordinal))

    def _drain(self) -> None:
        """Move the calls compiled code kept on the blocks and attention layers into this step's lists."""
        for i, (hi, low, ordinal) in kept_calls(self.attention_layers, self.logits_attr):
            self._layer.append(i)
            self._logit.append(hi)
            self._logit_low.append(low)
            if ordinal is not None:
                self._layer_seq.append(ordinal)
        for i, (hi, lo, ordinal) in kept_calls([m for _, m in self.blocks], self._calls_attr):
            self._block.append(i)
            self._hi.append(hi)
            self._lo.append(lo)
            if ordinal is not None:
                self._block_seq.append(ordinal)

    def observe_logits(self, layer: int, logits: torch.Tensor) -> None:
        """The pre-softmax logits of attention layer ``layer`` (masked slots ``-inf`` or the dtype's lowest value)."""
        if logits.numel() == 0:
            return
        # the maximum skips masked slots (-inf) and keeps NaN and +inf; the minimum skips every mask
        # mark (-inf, Hugging Face's additive dtype-lowest: at or below half the lowest value) in one
        # F.threshold pass; a NaN minimum reads as "no minimum" (0) in collect()
        logits = logits.detach()
        self._layer.append(int(layer))
        if self.order is not None:
            self._layer_seq.append(self.order.tick())
        self._logit.append(logits.amax())
        self._logit_low.append(F.threshold(logits, _mask_level(logits.dtype), 0.0).amin())  # NaN: see collect()

    def collect(self, n_attention: int | None = None) -> dict[str, torch.Tensor] | None:
        """This step's values per :data:`STREAM_METRICS` (None if nothing was seen); resets."""
        self._drain()
        if not self._block and not self._layer:
            self._reset()
            return None
        out = {}
        with torch.no_grad():
            if self._block:
                hi, lo = torch.stack(self._hi).float(), torch.stack(self._lo).float()
                lo_abs = torch.where(lo == float("-inf"), torch.zeros_like(lo), lo.abs())
                peaks = torch.maximum(hi.abs(), lo_abs)  # NaN in hi or lo survives torch.maximum
                out["stream_max"] = self._per_index(self._block, peaks, len(self.blocks))
                if self.order is not None:
                    self.order.note(self._block_seq, peaks)
            if self._layer:
                n = self._n_attention if n_attention is None else n_attention
                n = max(n, max(self._layer) + 1)
                hi = torch.stack(self._logit).float()
                low = torch.stack(self._logit_low).float()
                low = -torch.where(low.isnan(), 0.0, low)  # the smallest, as the largest of the negated
                out["attn_logit_max"] = self._per_index(self._layer, hi, n)
                out["attn_logit_min"] = -self._per_index(self._layer, low, n)
                if self.order is not None:
                    self.order.note(self._layer_seq, torch.maximum(hi.abs(), low.abs()))
        self._reset()
        return out

    def _per_index(self, index: list[int], values: torch.Tensor, n: int) -> torch.Tensor:
        """The largest of ``values`` per index in ``range(n)`` (0 where none; NaN kept)."""
        if len(index) == n and index == list(range(n)) and values.dtype == torch.get_default_dtype():
            return values  # every index once, in order (the usual step): the values are the maxima
        idx = cached(self._index, (tuple(index), values.device), lambda: torch.tensor(index, device=values.device))
        return torch.zeros(n, device=values.device).scatter_reduce_(0, idx, values, "amax", include_self=False)

    def remove(self) -> None:
        remove_hooks(self._handles)
        for _, m in self.blocks:
            m.__dict__.pop(self._calls_attr, None)
        for m in self.attention_layers:
            m.__dict__.pop(self.logits_attr, None)
