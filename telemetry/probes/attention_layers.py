"""The attention layers of a watch: which modules they are, and how their observations add up (docs/probes.md)."""

from __future__ import annotations

import fnmatch
import itertools
from typing import TYPE_CHECKING, Any, Callable

import torch
from sdcwatch.core.errors import ConfigError
from sdcwatch.telemetry.probes.compiled_calls import kept_calls, remove_hooks
from sdcwatch.telemetry.probes.attention import ATTENTION_WATCHES, attention_stats, combine_attention, mha_qk_logits
from torch import nn

if TYPE_CHECKING:
    from sdcwatch.telemetry.probes.gradients import StepBuffer
    from sdcwatch.telemetry.probes.watch import Watch

__all__ = ["AttentionLayers"]

_SERIALS = itertools.count()


class AttentionLayers:
    """The attention layers of ``watch`` (found in ``model`` as its config says); their observations
    of a step fold into ``buffer.attention``. A layer's observations reach the watch's
    ``observe_attention`` (which also hands the logits to the residual-stream check)."""

    def __init__(self, watch: "Watch", buffer: "StepBuffer", model: nn.Module) -> None:
        self.watch = watch
        self.buffer = buffer
        self.config = watch.config
        self.layers: list[nn.Module] = []
        self.handles: list[Any] = []
        self.attr = f"_sdcwatch_attn_{next(_SERIALS)}"  # where compiled code keeps a layer's observations
        self._index: dict[nn.Module, int] = {}
        self._self_reporting: set[nn.Module] = set()  # layers that call observe_attention themselves
        spec = self.config.attention
        named = [(n, m) for n, m in model.named_modules()]
        if spec == "none":
            chosen = []
        elif spec == "auto":
            chosen = [
                (n, m)
                for n, m in named
                if getattr(m, "_sdcwatch_attention", False) or isinstance(m, nn.MultiheadAttention)
            ]
        else:
            globs = [g.strip() for g in spec.split(",") if g.strip()]
            chosen = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, g) for g in globs)]
            if not chosen:
                raise ConfigError("probes.attention", f"{spec!r} matches no module")
        for _, m in chosen:
            self._register_layer(m)
            if getattr(m, "_sdcwatch_attention", False):
                # known now, not at its first report: compiled code then sees the same set every step
                self._self_reporting.add(m)

    def _register_layer(self, module: nn.Module) -> int:
        index = len(self.layers)
        self.layers.append(module)
        module.__dict__.setdefault(self.attr, [])  # compiled code's observations (observe_attention)
        self._index[module] = index
        entries = ATTENTION_WATCHES.setdefault(module, [])
        entries.append((self.watch, index))
        # the same list on the module, where observe_attention reads it: compiled code then guards on
        # the module's attribute, not on the keys of a global weak dictionary that garbage collection changes
        object.__setattr__(module, "_sdcwatch_watches", entries)
        if isinstance(module, nn.MultiheadAttention):
            self.handles.append(module.register_forward_pre_hook(self._mha_hook(index), with_kwargs=True))
        return index

    def layer_of(self, module: nn.Module) -> int | None:
        """The layer index of ``module``; with attention "auto" an unknown module becomes a layer."""
        index = self._index.get(module)
        if index is None and self.config.attention == "auto":
            index = self._register_layer(module)
        return index

    def reports_itself(self, module: nn.Module) -> bool:
        """Whether ``module`` reports its attention (observe_attention, or the MHA hook)."""
        return (
            module in self._self_reporting
            or getattr(module, "_sdcwatch_attention", False)
            or isinstance(module, nn.MultiheadAttention)
        )

    def observe(
        self,
        layer: int | nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        logits: torch.Tensor | None = None,
        causal: bool = True,
    ) -> None:
        """Measure one attention layer (index, or a module; an unknown module becomes a new layer)."""
        if not self.watch.attention_on:
            return
        # kept on the layer (no layer index in the traced code); folded in at the step's end
        traced = isinstance(layer, nn.Module) and torch.compiler.is_compiling() and self.attr in layer.__dict__
        if isinstance(layer, nn.Module) and not traced:
            self._self_reporting.add(layer)
            known = self._index.get(layer)
            layer = known if known is not None else self._register_layer(layer)
        if not traced and not 0 <= layer < len(self.layers):
            raise ConfigError("probes.layer", f"layer {layer} out of range [0, {len(self.layers)})")
        cfg = self.config
        stats = attention_stats(
            q, k, logits=logits, heads=cfg.heads, queries=cfg.queries, sequences=cfg.sequences, causal=causal
        )
        if traced:
            layer.__dict__[self.attr].append(stats)
        else:
            self.record(layer, stats)

    def drain(self) -> None:
        """Fold in the observations compiled code kept on the layers (see :meth:`observe`)."""
        for i, stats in kept_calls(self.layers, self.attr):
            self.record(i, stats)

    def discard(self) -> None:
        """Drop the observations compiled code kept on the layers in a step that is not recorded."""
        kept_calls(self.layers, self.attr)

    def record(self, layer: int, stats: torch.Tensor) -> None:
        """Fold one observation of ``layer`` into the step's: every micro-batch (gradient
        accumulation) and every call of the layer counts; means are averaged, extremes kept."""
        attn = self.buffer.attention
        seen = attn.get(layer)
        attn[layer] = (stats, 1) if seen is None else (combine_attention(seen[0], stats), seen[1] + 1)

    def _mha_hook(self, index: int) -> Callable:
        def hook(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
            if not (self.watch.enabled and self.watch.attention_on):
                return
            q, k, logits = mha_qk_logits(module, args, kwargs)
            self.watch.observe_attention(index, q, k, logits=logits, causal=False)

        return hook

    def remove(self) -> None:
        """Remove the hooks and forget the watch on its layers."""
        remove_hooks(self.handles)
        for m in self.layers:
            entries = ATTENTION_WATCHES.get(m)
            if entries:
                entries[:] = [(w, i) for w, i in entries if w is not self.watch]
