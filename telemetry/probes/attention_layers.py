"""The attention layers of a watch: which modules they are, and how their observations add up.

A layer is found by the ``attention`` setting ("auto": modules that report themselves and
``nn.MultiheadAttention``; or module-name globs), or at its first report: an
``observe_attention`` call, or an attention call the tap (:mod:`~sdcwatch.telemetry.probes.sdpa`) saw.
Several observations of a layer in one step (micro-batches, repeated calls) fold into one.
:class:`AttentionLayers` is a part of :class:`~sdcwatch.telemetry.probes.watch.Watch`, which sets the
state it uses (``_layers``, ``_layer_index``, ``_self_reporting``, ``_attn``, ``_tap``,
``attention_on``, ``module_names``, ``config``, ``enabled``, ``_handles``).
"""

from __future__ import annotations

import fnmatch
import itertools
from typing import Callable

import torch
from sdcwatch.core.errors import ConfigError
from sdcwatch.telemetry.probes.kept import kept_calls
from sdcwatch.telemetry.probes.attention import ATTENTION_WATCHES, attention_stats, combine_attention, mha_qk_logits
from torch import nn

__all__ = ["AttentionLayers"]

_SERIALS = itertools.count()


class AttentionLayers:
    """The attention-layer half of a watch (a mixin of :class:`~sdcwatch.telemetry.probes.watch.Watch`)."""

    def _discover_attention(self, model: nn.Module) -> None:
        self._attn_attr = f"_sdcwatch_attn_{next(_SERIALS)}"  # where compiled code keeps a layer's observations
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
        index = len(self._layers)
        self._layers.append(module)
        module.__dict__.setdefault(self._attn_attr, [])  # compiled code's observations (observe_attention)
        self._layer_index[module] = index
        entries = ATTENTION_WATCHES.setdefault(module, [])
        entries.append((self, index))
        # the same list on the module, where observe_attention reads it: compiled code then guards on
        # the module's attribute, not on the keys of a global weak dictionary that garbage collection changes
        object.__setattr__(module, "_sdcwatch_watches", entries)
        if isinstance(module, nn.MultiheadAttention):
            self._handles.append(module.register_forward_pre_hook(self._mha_hook(index), with_kwargs=True))
        return index

    def layer_of(self, module: nn.Module) -> int | None:
        """The layer index of ``module``; with attention "auto" an unknown module becomes a layer."""
        index = self._layer_index.get(module)
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

    @property
    def layer_names(self) -> list[str]:
        """Module names of the attention layers, in layer-index order."""
        return [self.module_names.get(m, "") for m in self._layers]

    def begin_forward(self) -> None:
        """Mark the start of a forward pass that does not go through the attached module's call
        (Lightning runs ``training_step``): attention is then measured until :meth:`end_forward`."""
        if self._tap is not None:
            self._tap.forward_begin()

    def end_forward(self) -> None:
        """Mark the end of the forward pass :meth:`begin_forward` began."""
        if self._tap is not None:
            self._tap.forward_end()

    def observe_attention(
        self,
        layer: int | nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        logits: torch.Tensor | None = None,
        causal: bool = True,
    ) -> None:
        """Measure one attention layer (index, or a module; an unknown module becomes a new layer)."""
        if not self.attention_on:
            return
        if isinstance(layer, nn.Module) and torch.compiler.is_compiling() and self._attn_attr in layer.__dict__:
            # kept on the layer (no layer index in the traced code); folded in at the step's end
            cfg = self.config
            stats = attention_stats(
                q, k, logits=logits, heads=cfg.heads, queries=cfg.queries, sequences=cfg.sequences, causal=causal
            )
            layer.__dict__[self._attn_attr].append(stats)
            return
        if isinstance(layer, nn.Module):
            self._self_reporting.add(layer)
            known = self._layer_index.get(layer)
            layer = known if known is not None else self._register_layer(layer)
        if not 0 <= layer < len(self._layers):
            raise ConfigError("probes.layer", f"layer {layer} out of range [0, {len(self._layers)})")
        cfg = self.config
        stats = attention_stats(
            q, k, logits=logits, heads=cfg.heads, queries=cfg.queries, sequences=cfg.sequences, causal=causal
        )
        self.record_attention(layer, stats)

    def _drain_attention(self) -> None:
        """Fold in the observations compiled code kept on the layers (see :meth:`observe_attention`)."""
        for i, stats in kept_calls(self._layers, self._attn_attr):
            self.record_attention(i, stats)

    def record_attention(self, layer: int, stats: torch.Tensor) -> None:
        """Fold one observation of ``layer`` into the step's: every micro-batch (gradient
        accumulation) and every call of the layer counts; means are averaged, extremes kept."""
        seen = self._attn.get(layer)
        self._attn[layer] = (stats, 1) if seen is None else (combine_attention(seen[0], stats), seen[1] + 1)

    def _mha_hook(self, index: int) -> Callable:
        def hook(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
            if not (self.enabled and self.attention_on):
                return
            q, k, logits = mha_qk_logits(module, args, kwargs)
            self.observe_attention(index, q, k, logits=logits, causal=False)

        return hook
