"""The per-product canary: a known-answer test of one linear layer's product on every step, the
layers in rotation, fingerprinted so that the replica vote names a rank whose products are
persistently a little off (docs/probes.md, "The per-product canary": which product, input and path).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F
from sdcwatch.telemetry.probes import fingerprint as fp
from sdcwatch.telemetry.probes.canary import canary_section
from sdcwatch.telemetry.probes.compiled_calls import cached
from sdcwatch.telemetry.probes.gemm_state import is_shard
from sdcwatch.telemetry.probes.linear_layout import is_linear, linear_weight
from sdcwatch.telemetry.probes.output_faults import output_faults
from torch import nn

__all__ = ["GemmCanary", "known_input", "ROWS"]

#: Rows of the known input: enough to exercise every output column, few enough to cost nothing.
ROWS = 4

_INPUTS: dict[tuple, torch.Tensor] = {}
_LINEAR_FORWARD = nn.Linear.forward


def known_input(in_features: int, out_features: int, dtype: torch.dtype, device: Any, rows: int = ROWS) -> torch.Tensor:
    """The fixed ``(rows, in_features)`` input of a product of this shape: standard normal values
    from a generator seeded by the shape alone (the same on every rank and run); cached."""

    def draw() -> torch.Tensor:
        seed = zlib.crc32(f"sdcwatch-gemm-canary:{in_features}x{out_features}x{rows}".encode())
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(rows, in_features, generator=gen).to(device=device, dtype=dtype)

    return cached(_INPUTS, (in_features, out_features, rows, dtype, str(device)), draw)


class GemmCanary:
    """The known-answer products of one model's linear layers, one per step in rotation."""

    def __init__(self, model: nn.Module, stride: int = 1) -> None:
        self.stride = max(1, int(stride))  # steps between two canaries: consecutive ones, consecutive products
        self.products: list[tuple[str, nn.Linear]] = [
            (name, m)
            for name, m in model.named_modules()
            if is_linear(m) and isinstance(m.weight, torch.Tensor) and m.weight.dim() == 2
        ]
        """(name, module) of every product checked, in rotation order."""
        self.failed: set[str] = set()  # products whose canary failed (a quantized layout): skipped

    @property
    def names(self) -> list[str]:
        """The names of :attr:`products`: what ``gemm_canary_product`` indexes."""
        return [name for name, _ in self.products]

    @classmethod
    def of(cls, model: nn.Module, config: Any) -> "GemmCanary | None":
        """The canary a :class:`~sdcwatch.telemetry.probes.config.ProbeConfig` asks for (None: off)."""
        k = config.gemm_canary_every
        return cls(model, config.every * k) if k else None

    def report(self, step: int, fingerprints: dict[str, Any]) -> None:
        """Put ``gemm_canary_fp`` into ``fingerprints`` when ``step`` is a canary step."""
        if step % self.stride == 0:
            raw = self.fingerprint(step)
            if raw is not None:
                fingerprints["gemm_canary_fp"] = raw

    def index_at(self, step: int) -> int | None:
        """The index in :attr:`products` of the product step ``step`` checks (None without one)."""
        return (step // self.stride) % len(self.products) if self.products else None

    def product_at(self, step: int) -> tuple[str, nn.Linear] | None:
        """The product step ``step`` checks (None for a model without linear layers)."""
        k = self.index_at(step)
        return None if k is None else self.products[k]

    def fingerprint(self, step: int) -> torch.Tensor | None:
        """Raw device fingerprint of step ``step``'s product of the known input (no host sync; under
        FSDP2 a collective: on every rank)."""
        picked = self.product_at(step)
        if picked is None or picked[0] in self.failed:
            return None
        try:
            return self._fingerprint(picked[1])
        except Exception:  # never into the training loop: this product is not checked
            self.failed.add(picked[0])
            return None

    def _fingerprint(self, module: nn.Linear) -> torch.Tensor | None:
        w, b = linear_weight(module)  # (out, in), whatever the layout
        sharded = is_shard(w) or (b is not None and is_shard(b))
        x = known_input(w.shape[1], w.shape[0], w.dtype, w.device)  # a shard's shape is the whole weight's
        if type(module).forward is _LINEAR_FORWARD:  # the product itself, and the faults on its output
            with torch.no_grad():
                if sharded:
                    w, b = _whole(w), None if b is None else _whole(b)
                y = F.linear(x, w, b)
                for hook in output_faults(module):
                    got = hook(module, (x,), y)
                    y = y if got is None else got
        else:  # a layer with a forward of its own: called, its own hooks too (the probes skip it)
            with torch.no_grad(), canary_section():
                if sharded:
                    whole = {"weight": _whole(module.weight)}
                    if b is not None:
                        whole["bias"] = _whole(b)
                    y = torch.func.functional_call(module, whole, (x,))
                else:
                    y = module(x)
        if not isinstance(y, torch.Tensor):
            return None
        return fp.fingerprint_device([y])


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (an all-gather), a plain tensor as it is."""
    return t.full_tensor() if is_shard(t) else t
