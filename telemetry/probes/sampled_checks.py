"""A watch's finite-SDC probes: the matrix checksums and the residual stream, sampled as its
:class:`~sdcwatch.telemetry.probes.config.ProbeConfig` says (docs/probes.md).
"""

from __future__ import annotations

from typing import Any

import torch
from sdcwatch.core.vocabulary import FIRST_BAD
from sdcwatch.telemetry.wire.environment import RankEnvironment
from sdcwatch.telemetry.probes.canary import canary_running
from sdcwatch.telemetry.probes.compiled_calls import remove_hooks
from sdcwatch.telemetry.probes.residual_stream import ResidualStream
from sdcwatch.telemetry.probes.forward_order import ForwardOrder
from sdcwatch.telemetry.probes.gemm_checks import GemmChecks
from torch import nn

__all__ = ["SampledChecks", "fills_kv_cache"]


def fills_kv_cache(model: nn.Module) -> bool:
    """Whether ``model`` (or a module in it) is a Hugging Face model whose config keeps
    ``use_cache`` on: its forward then fills a key/value cache even in training."""
    return any(getattr(getattr(m, "config", None), "use_cache", False) is True for m in model.modules())


class SampledChecks:
    """The checksums (:class:`GemmChecks`, which also scan the products' outputs on unchecked steps)
    and the residual stream of one watch; either is None when its sampling is 0."""

    def __init__(
        self,
        watch: Any,
        model: nn.Module,
        *,
        environment: RankEnvironment,
        optimizer: Any = None,
        external: bool = False,
    ) -> None:
        self._watch = watch
        cfg = watch.config
        # fixed for the step by sync() (under torch.compile a hook reading the step number would
        # recompile at every checked step; two values compile twice, then never again)
        self.checks_on = self.backward_on = self.stream_on = False
        # numbers the every-step observations of both probes in forward order (nonfinite_first)
        self.order = ForwardOrder()
        # on the steps the checksums do not check, the products' outputs are still scanned for
        # NaN, Inf and near-INF (gemm_out) with the residual stream
        self.checksums = (
            GemmChecks(
                model,
                active=lambda: self.due(self.checks_on),
                backward=lambda: self.due(self.backward_on),
                scan=lambda: self.due(self.stream_on),
                order=self.order,
                triton=environment.triton,
                # a Hugging Face model that fills a key/value cache in its training forward: Dynamo
                # cannot trace a hook on the products' outputs there (the check runs in eager code)
                compiled_grad_check=environment.compiled_grad_check and not fills_kv_cache(model),
            )
            if cfg.checksum_every or cfg.checksum_forward_every or cfg.stream_every
            else None
        )
        self.stream = (
            ResidualStream(model, active=lambda: self.due(self.stream_on), n_attention=watch.n_layers, order=self.order)
            if cfg.stream_every
            else None
        )
        self.handles: list[Any] = []
        if self.checksums is not None and optimizer is not None and not external:
            self.handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self.seal()))
            self.checksums.optimizer_seals = True

    def _scheduled_at(self, step: int, every: int) -> bool:
        cfg = self._watch.config
        return bool(every) and step % cfg.every == 0 and (step // cfg.every) % every == 0

    def _checked_at(self, step: int) -> bool:
        """Whether ``step``'s forward products and weights are checked (the backward's steps too)."""
        cfg = self._watch.config
        return self._scheduled_at(step, cfg.checksum_every) or self._scheduled_at(step, cfg.checksum_forward_every)

    def due(self, on: bool) -> bool:
        """Whether a probe switched ``on`` measures the forward running now (training forwards only)."""
        w = self._watch
        return on and w.enabled and w.model.training and not canary_running()

    def sync(self, closed: bool = False) -> None:
        """Switch the probes for the step about to run (forward hooks only for a checked step)."""
        cfg, step = self._watch.config, self._watch.next_step
        self.backward_on = not closed and self._scheduled_at(step, cfg.checksum_every)
        self.checks_on = not closed and self._checked_at(step)
        self.stream_on = not closed and self._scheduled_at(step, cfg.stream_every)
        if self.stream is not None:  # where compiled code keeps each attention layer's logits
            self.stream.attention_layers = self._watch.attention.layers
            for m in self.stream.attention_layers:
                m.__dict__.setdefault(self.stream.logits_attr, [])
        device = next((p.device for p in self._watch.model.parameters()), None)
        if device is not None:
            self.order.place(device)
        if self.checksums is not None:
            self.checksums.hook_forward(self.checks_on or self.stream_on)
            self.checksums.seal_provisionally()  # a no-op once the optimizer sealed the weights
            if self.backward_on:
                self.checksums.arm_traced_backward()

    def seal(self) -> None:
        """Seal the weights as the optimizer left them when the next forward is checked (the hook runs
        before ``watch.step()`` closes the step: the next forward is the one after ``next_step``)."""
        w = self._watch
        if self.checksums is not None and self._checked_at(w.next_step + 1):
            self.checksums.seal()

    def observe_logits(self, layer: int | nn.Module, logits: torch.Tensor | None) -> None:
        """An attention layer's logits, on the steps the residual stream is recorded."""
        if self.stream is None or logits is None or not self.due(self.stream_on):
            return
        if isinstance(layer, nn.Module):
            if torch.compiler.is_compiling() and self.stream.logits_attr in layer.__dict__:
                self.stream.observe_logits_traced(layer, logits)  # kept on the layer (see ResidualStream)
                return
            layer = self._watch.attention.layer_of(layer)
            if layer is None:  # not an attention layer of this watch
                return
        self.stream.observe_logits(layer, logits)

    def collect(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """This step's (per-layer vectors, scalars); the scalar is ``nonfinite_first`` (-1 on a clean
        step: the watch drops it). Starts the next step."""
        out: dict[str, torch.Tensor] = {}
        for probe in (self.checksums, self.stream):
            if probe is not None:
                out.update(probe.collect() or {})
        first = self.order.first()
        return out, ({} if first is None else {FIRST_BAD: first})

    def remove(self) -> None:
        remove_hooks(self.handles)
        for probe in (self.checksums, self.stream):
            if probe is not None:
                probe.remove()
