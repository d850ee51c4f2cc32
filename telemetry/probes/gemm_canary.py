"""The per-product canary: a known-answer test of one linear layer's product on every step.

An unhealthy GPU whose matrix products are persistently a little off (relative errors of 1e-4 to
1e-2) stays under the checksums' rounding bound (:mod:`sdcwatch.telemetry.probes.checksum_bounds`) and moves no
statistic, yet it is wrong on every product it computes. Replicas hold the same weights, so the
same fixed input times the same weight must give the same bits on every healthy rank: one
product each step, on every rank, and the replica vote on its fingerprint names the rank whose
result differs, at the step that product is checked.

**Which product.** The linear layers of the model (``nn.Linear``, ``Conv1D``) in registration order
(``model.named_modules()``, the order of :attr:`GemmChecks.names` without the custom products);
step ``s`` checks layer ``s mod n`` (:meth:`GemmCanary.product_at`; with sampling, the ``k``-th
canary step checks layer ``k mod n``): the same layer on every rank at a step, every layer once
every ``n`` canaries. Under tensor parallelism each rank holds its own
share of each layer and checks that share: the replicas of the share agree.

**Which input.** A few rows (:data:`ROWS`) of standard normal values drawn from a generator
seeded by the layer's shape (:func:`known_input`): the same on every rank and every run, without
anything to ship or configure (the whole-model canary needs a user's ``canary_input``).

**Through the faulty path.** The product is ``F.linear`` on the layer's own weight and bias, the
kernel the layer's forward calls, so a faulty device corrupts the canary's product as it corrupts
the step's. The simulated unhealthy node (a forward hook adding noise to the module's output,
:mod:`sdcwatch.testbed.faults`) must be seen the same way: the canary passes its product
through the module's fault hooks (:func:`~sdcwatch.telemetry.probes.output_faults.output_faults`), and through
none of its other hooks, the probes' (which would skip it) and their module-call machinery (what
most of the canary's cost was). A subclass with a forward of its own is called instead, with
its hooks, the probes' skipping it (:func:`~sdcwatch.telemetry.probes.canary.canary_section`).

**When, and under FSDP2.** It runs in :meth:`Watch.step` after the step's forward and backward,
outside any compiled graph (a choice read inside ``torch.compile``'d hooks would recompile on
every step). A weight sharded by FSDP2 (a DTensor) is gathered whole first (``full_tensor()``, one
all-gather of that one weight, on every rank of its shard group at the same step) and the module
is called with it (``torch.func.functional_call``): every data-parallel rank of the same tensor
and pipeline piece then holds the same unsharded weight, so the vote runs over the *peer group*
(every ``dp_replicate`` and ``dp_shard`` coordinate, :data:`PEER_VOTED` in
:mod:`sdcwatch.detectors.replica`), not only over the replicas of one shard, of which plain FSDP
has just one.

A weight changed in one rank's *memory* (a flipped bit in its FSDP shard) reaches the gathered
weight of every rank of that shard group: their canaries all disagree alike. The vote then blames
none of them on the canary's account (:mod:`sdcwatch.detectors.replica`): the shard-wise
``param_fp`` vote (HSDP) and the in-memory check ``gemm_weight`` name the rank itself. Without
FSDP only that rank's canary moves.

The result is ``gemm_canary_fp`` in the record. Kernels must be deterministic across the
replicas (one hardware type), as for every fingerprint.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F
from sdcwatch.telemetry.probes import fingerprint as fp
from sdcwatch.telemetry.probes.canary import canary_section
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
    key = (in_features, out_features, rows, dtype, str(device))
    x = _INPUTS.get(key)
    if x is None:
        if len(_INPUTS) > 256:
            _INPUTS.clear()
        seed = zlib.crc32(f"sdcwatch-gemm-canary:{in_features}x{out_features}x{rows}".encode())
        gen = torch.Generator().manual_seed(seed)
        x = _INPUTS[key] = torch.randn(rows, in_features, generator=gen).to(device=device, dtype=dtype)
    return x


class GemmCanary:
    """The known-answer products of one model's linear layers, one per step in rotation."""

    def __init__(self, model: nn.Module, stride: int = 1) -> None:
        self.stride = max(1, int(stride))
        """Steps between two canaries (``every * gemm_canary_every``): consecutive canaries check
        consecutive products, whatever the sampling."""
        self.products: list[tuple[str, nn.Linear]] = [
            (name, m)
            for name, m in model.named_modules()
            if is_linear(m) and isinstance(m.weight, torch.Tensor) and m.weight.dim() == 2
        ]
        """(name, module) of every product checked, in rotation order."""
        self.failed: set[str] = set()
        """Products whose canary could not be computed (a subclass with its own weight layout, e.g. a
        quantized one): skipped from then on, on every rank alike (they hold the same model)."""

    @property
    def names(self) -> list[str]:
        """The names of :attr:`products`, in rotation order: what ``gemm_canary_product`` indexes
        (the ``canary_products`` layer names a rank hands the service)."""
        return [name for name, _ in self.products]

    @classmethod
    def of(cls, model: nn.Module, config: Any) -> "GemmCanary | None":
        """The canary a :class:`~sdcwatch.telemetry.probes.config.ProbeConfig` asks for (None when
        ``gemm_canary_every`` is 0): on every ``every * gemm_canary_every``-th step."""
        k = config.gemm_canary_every
        return cls(model, config.every * k) if k else None

    def report(self, step: int, fingerprints: dict[str, Any]) -> None:
        """Put step ``step``'s ``gemm_canary_fp`` (a raw device fingerprint) into ``fingerprints``
        when the step is a canary step."""
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
        """Raw device fingerprint of step ``step``'s product of the known input (module docstring);
        no host synchronisation. Under FSDP2 a collective: call it on every rank of the step."""
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
        if type(module).forward is _LINEAR_FORWARD:  # the product itself, and the faults on its output
            with torch.no_grad():
                if sharded:
                    w, b = _whole(w), None if b is None else _whole(b)
                x = known_input(w.shape[1], w.shape[0], w.dtype, w.device)
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
                    x = known_input(w.shape[1], w.shape[0], w.dtype, w.device)
                    y = torch.func.functional_call(module, whole, (x,))
                else:
                    y = module(known_input(w.shape[1], w.shape[0], w.dtype, w.device))
        if not isinstance(y, torch.Tensor):
            return None
        return fp.fingerprint_device([y])


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (an all-gather), a plain tensor as it is."""
    return t.full_tensor() if is_shard(t) else t
