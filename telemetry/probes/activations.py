"""``act_max``: the largest |output| of any leaf module in a sampled forward pass, and which module
produced it (docs/probes.md, "How the probes are built").
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

import torch
from sdcwatch.telemetry.probes.compiled_calls import kept_calls, remove_hooks
from sdcwatch.telemetry.probes.forward_order import ForwardOrder
from torch import nn

__all__ = ["ActivationMax", "layer_of_module"]

_SERIALS = itertools.count()


class ActivationMax:
    """The act_max hooks of one watch's model; :meth:`take` gives a step's ``act_max`` and
    ``act_max_module`` (an index into :attr:`leaf_names`)."""

    def __init__(self, model: nn.Module, names: dict[nn.Module, str], allowed: Callable[[], bool]) -> None:
        self.leaves = [m for n, m in model.named_modules() if n and not any(True for _ in m.children())]
        self.leaf_names = [names[m] for m in self.leaves]
        self.on = False  # the step in progress is sampled (fixed for the step: see sync)
        self._allowed = allowed  # the watch is enabled and no canary forward is running
        self._handles: list[Any] = []
        self._seen: list[tuple[int, torch.Tensor]] = []  # (leaf index, max |output|) per module call
        # compiled code keeps each call on the module itself, numbered by a device counter (see _hook)
        self._order = ForwardOrder()
        self._calls_attr = f"_sdcwatch_act_{next(_SERIALS)}"
        self._leaf_of = {id(m): i for i, m in enumerate(self.leaves)}
        for m in self.leaves:
            m.__dict__[self._calls_attr] = []

    def sync(self, want: bool) -> None:
        """Hook the leaves for a sampled step, unhook them otherwise (the hooks test only :attr:`on`:
        one reading the step number would recompile at every sampled step)."""
        self.on = want
        if want:
            device = next((p.device for m in self.leaves for p in m.parameters(recurse=False)), None)
            if device is not None:
                self._order.place(device)
        if want and not self._handles:
            # one hook for every leaf: code torch.compile traces then holds no leaf index
            self._handles = [m.register_forward_hook(self._hook) for m in self.leaves]
        elif not want and self._handles:
            self.remove()

    def remove(self) -> None:
        remove_hooks(self._handles)

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not (self.on and self._allowed()):
            return
        out = output if isinstance(output, torch.Tensor) else None
        if out is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            out = output[0]
        if out is None or not out.is_floating_point() or out.numel() == 0:
            return
        m = out.detach().nan_to_num(nan=math.nan, posinf=math.inf, neginf=0.0).abs().amax().float()
        if torch.compiler.is_compiling():  # kept on the module, in the order counted on the device
            module.__dict__[self._calls_attr].append((m, self._order.traced_tick()))
            return
        self._seen.append((self._leaf_of[id(module)], m))

    def take(self) -> dict[str, torch.Tensor]:
        """The step's ``act_max`` and ``act_max_module`` as device scalars ({} when nothing was
        seen), and a fresh start for the next step."""
        seen, self._seen = self._seen, []
        traced = kept_calls(self.leaves, self._calls_attr)  # (leaf index, (max |output|, ordinal))
        self._order.reset()
        if traced:  # the first call, in the order they ran, that reached the maximum (NaN the largest)
            values = torch.stack([v for _, (v, _) in traced])
            key = values.nan_to_num(nan=math.inf)
            ordinals = torch.stack([o.reshape(()).float().to(values.device) for _, (_, o) in traced])
            first = torch.where(key == key.amax(), ordinals, math.inf).argmin()
        elif seen:
            values = torch.stack([v for _, v in seen])
            first = values.nan_to_num(nan=math.inf).argmax()  # argmax gives the first of equal maxima
        else:
            return {}
        ids = torch.tensor([i for i, _ in traced or seen], dtype=torch.float32).to(values.device, non_blocking=True)
        return {"act_max": values.amax(), "act_max_module": ids[first]}

    def clear(self) -> None:
        self._seen = []
        kept_calls(self.leaves, self._calls_attr)


def layer_of_module(name: str, layers: list[str]) -> int:
    """The index in ``layers`` (attention module names) of the layer whose block (its parent) holds
    module ``name``; -1 when none does (embeddings, the head)."""
    best, index = -1, -1
    for i, layer in enumerate(layers):
        block = layer.rsplit(".", 1)[0] if "." in layer else layer
        if (name == block or name.startswith(block + ".")) and len(block) > best:
            best, index = len(block), i
    return index
