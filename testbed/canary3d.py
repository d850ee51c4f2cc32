"""The per-product canary (:mod:`sdcwatch.telemetry.gemm_canary`) of the simulated 3D ranks.

Each rank of :class:`~sdcwatch.testbed.parallel3d.ParallelSimulatedRun` checks, at step ``s``,
linear layer ``s mod n`` of its own pipeline stage (the stage's ``nn.Linear`` layers in
registration order, as the probes of that rank's model piece would list them) on the layer's
known input, and reports the fingerprint of *its share* of the product: the rows of a
column-parallel weight it holds, the partial sum of a row-parallel one (before the all-reduce).
The product goes through the module, so the pieces' fault injectors run on it as on the step's
forward (the simulated unhealthy node's noise lands in the faulty rank's share only); the probe's
own hooks skip it. The vote is the replica vote within the peer group: the ranks with the same
tensor and pipeline coordinates on every data-parallel replica.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from sdcwatch.telemetry import fingerprint as fp
from sdcwatch.telemetry.canary import canary_section
from sdcwatch.telemetry.gemm_canary import known_input

__all__ = ["shard_canaries"]


def shard_canaries(run: Any, step: int) -> dict[int, list[int]] | None:
    """``{replica: [fingerprint of piece k = pp * tp + tp_rank]}`` of ``step``'s known-answer
    products, or None when the probes do not check one at this step."""
    cfg = run.probe_config
    every = cfg.every * cfg.gemm_canary_every  # as the probes sample it (GemmCanary.stride)
    if not every or step % every:
        return None
    plan, probe, tp = run.plan, run.probe, run.tp
    picked: list[tuple[str, nn.Linear] | None] = []
    for names in probe.stage_products:
        linear = [n for n in names if isinstance(plan.modules[n], nn.Linear)]
        name = linear[(step // every) % len(linear)] if linear else None
        picked.append((name, plan.modules[name]) if name else None)
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
    row, owner = plan.row_parallel(name), plan.output_owner(name)
    shares = []
    for t in range(tp):
        if row is not None and tp > 1:  # its partial sum; a fault on it is where the fault was
            cols = (row == t).nonzero().reshape(-1)
            share = F.linear(x.index_select(-1, cols), w.index_select(1, cols))
            if t in culprits:
                share = share + (y - clean)
        elif owner is not None and tp > 1:
            share = y.index_select(-1, (owner[1] == t).nonzero().reshape(-1))
        else:  # replicated: the faulty rank's copy is its own
            share = y if t in culprits or not culprits else clean
        shares.append(share)
    return shares
