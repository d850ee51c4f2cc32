"""The per-product canary (:mod:`sdcwatch.telemetry.probes.gemm_canary`) of the simulated 3D ranks.

Each pipeline stage has the canary the probes of that stage's model piece would build
(:func:`stage_canaries`: a :class:`~sdcwatch.telemetry.probes.gemm_canary.GemmCanary` over the stage's
modules): at step ``s`` each rank checks the stage's linear layer :meth:`GemmCanary.product_at`
names (the stage's ``nn.Linear`` layers in registration order, in rotation) on the layer's known
input, reports the fingerprint of *its share* of the product (the rows of a column-parallel weight
it holds, the partial sum of a row-parallel one, before the all-reduce) and, beside it, which
product it checked (``gemm_canary_product``, the index in its stage's list, whose names the rank
hands the service as its ``canary_products``). The product goes through the module, so the
pieces' fault injectors run on it as on the step's forward (the simulated unhealthy node's noise
lands in the faulty rank's share only); the probe's own hooks skip it. The vote is the replica
vote within the peer group: the ranks with the same tensor and pipeline coordinates on every
data-parallel replica.
"""

from __future__ import annotations

from typing import Any

import torch
from sdcwatch.telemetry.probes import fingerprint as fp
from sdcwatch.telemetry.probes.canary import canary_section
from sdcwatch.telemetry.probes.gemm_canary import GemmCanary, known_input
from sdcwatch.telemetry.probes.watch import canary_product
from torch import nn
from torch.nn import functional as F

__all__ = ["stage_canaries", "shard_canaries", "checked_products"]


def stage_canaries(plan: Any, config: Any) -> list[GemmCanary | None]:
    """Each pipeline stage's canary for the probes' ``config`` (None when they run none)."""
    return [GemmCanary.of(plan.stage_view(p), config) for p in range(plan.pp)]


def checked_products(run: Any, step: int) -> list[dict[str, float]]:
    """Per stage, ``{gemm_canary_product: index}`` of the product its canary checks at ``step``
    (:func:`~sdcwatch.telemetry.probes.watch.canary_product`), sent beside that step's ``gemm_canary_fp``."""
    return [{} if c is None else canary_product(c, step) for c in run.stage_canaries]


def shard_canaries(run: Any, step: int) -> dict[int, list[int]] | None:
    """``{replica: [fingerprint of piece k = pp * tp + tp_rank]}`` of ``step``'s known-answer
    products, or None when the probes do not check one at this step."""
    canaries = run.stage_canaries
    if not any(c is not None and step % c.stride == 0 for c in canaries):
        return None
    tp = run.tp
    picked = [None if c is None else c.product_at(step) for c in canaries]
    out: dict[int, list[int]] = {}
    inj = run.injector
    for r in range(run.replicas):
        inj.rank = r  # each piece's injector acts for that piece's rank of replica r
        row: list[int] = [0] * (run.pp * tp)
        with run._replica(r):
            for p, chosen in enumerate(picked):
                if chosen is None:
                    continue
                for t, share in enumerate(_shares(run, *chosen)):
                    row[p * tp + t] = fp.finalize(int(fp.fingerprint_device([share])))
        out[r] = row
    return out


def _shares(run: Any, name: str, module: nn.Linear) -> list[torch.Tensor]:
    """Each tensor shard's part of ``module``'s product of its known input, faults applied."""
    plan, tp = run.plan, run.tp
    w, b = module.weight.detach(), module.bias
    x = known_input(w.shape[1], w.shape[0], w.dtype, w.device)
    cursor = [len(i.injections) for i in run.injectors]
    with torch.no_grad():
        clean = F.linear(x, w, None if b is None else b.detach())
        with canary_section():
            y = module(x)
    culprits = {
        i.shard
        for i, start in zip(run.injectors, cursor)
        for rec in i.injections[start:]
        if rec.target == name and rec.where == "output"
    }
    shares = []
    for t in range(tp):
        part = plan.share(name, t)
        if part.cols is not None:  # its partial sum; a fault on it is where the fault was
            share = F.linear(part.inputs(x), part.weight(w))
            if t in culprits:
                share = share + (y - clean)
        elif part.rows is not None:
            share = part.outputs(y)
        else:  # replicated: the faulty rank's copy is its own
            share = y if t in culprits or not culprits else clean
        shares.append(share)
    return shares
