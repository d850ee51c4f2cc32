"""A nanoGPT-style model trained under DDP with sdcwatch watching it: the README's plain loop on a
model sdcwatch knows nothing about.

The model computes attention by hand (``softmax(q @ k.T / sqrt(d))`` with a causal mask written
with ``masked_fill(-inf)``) and ties the embedding to the output head; nothing in it mentions
sdcwatch. Four lines add the telemetry: an ``Emitter``, ``attach()``, ``watch.step()`` once per
optimizer step, and the two ``close()`` calls.

On one machine, with the embedded broker and the service running (see the README, "Watch your own
job on one machine"):

    SDCWATCH_RUN=clean .venv/bin/torchrun --nproc-per-node 2 examples/nanogpt_ddp.py
    SDCWATCH_RUN=nan .venv/bin/torchrun --nproc-per-node 2 examples/nanogpt_ddp.py --nan-step 20 --nan-rank 1

The second run writes a NaN into block 1's attention output on rank 1 at step 20 (sdcwatch's fault
injector, the way to test your alerting); ``sdcwatch serve`` logs a non-finite incident naming
rank 1, layer 1 (the block index, ``transformer.h.1``) and step 20. The clean run raises nothing.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sdcwatch.telemetry import Emitter, attach
from sdcwatch.testbed import FaultInjector, FaultSpec
from torch.nn.parallel import DistributedDataParallel

VOCAB, BLOCK = 256, 32


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)  # sdcwatch measures attention here, on sampled steps
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer: int = 3, n_head: int = 4, d: int = 64) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, d),
                wpe=nn.Embedding(BLOCK, d),
                h=nn.ModuleList([Block(d, n_head) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(d),
            )
        )
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nan-step", type=int, default=None, help="write a NaN at this step (default: none)")
    parser.add_argument("--nan-rank", type=int, default=1, help="on this rank (default 1)")
    parser.add_argument("--nan-layer", type=int, default=1, help="into this block's attention output (default 1)")
    parser.add_argument("--topic", default="sdcwatch.telemetry", help="Kafka topic (default sdcwatch.telemetry)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR...
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    emitter = Emitter(topic=args.topic)  # Kafka at $SDCWATCH_BOOTSTRAP, run $SDCWATCH_RUN
    ddp = DistributedDataParallel(model)
    watch = attach(model, emitter, optimizer=opt, ddp=ddp)  # before the first backward

    injector = None
    if args.nan_step is not None:
        target = f"transformer.h.{args.nan_layer}.attn"  # the module's output, in its forward hook
        nan = FaultSpec(kind="nan", rank=args.nan_rank, step=args.nan_step, target=target)
        injector = FaultInjector([nan], rank=rank).attach(model, opt)

    data = torch.Generator().manual_seed(1234 + rank)  # each rank its own batches
    for step in range(args.steps):
        if injector is not None:
            injector.begin_step(step)
        x = torch.randint(0, VOCAB, (8, BLOCK), generator=data)
        loss = ddp(x, torch.roll(x, -1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        watch.step(step, loss=loss)  # once per optimizer step; the loss stays a tensor
        if injector is not None:
            injector.end_step()

    watch.close()
    emitter.close()  # flushes, then sends the end-of-run marker: the run is finished, not stalled
    print(f"rank {rank}: {args.steps} steps, {emitter.sent} records sent, {emitter.dropped} dropped", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
