"""nanoGPT's training loop (gradient accumulation over micro-batches, DDP's gradient sync on the last
one only, batches drawn with torch's random generator, clipping) guarded by sdcwatch, the fault
injector stepped in the guard's ``compute``, against the same loop as nanoGPT writes it, unguarded.

    python tests/examples/guarded_accumulation.py                       # one process
    torchrun --standalone --nproc-per-node 2 tests/examples/guarded_accumulation.py

Each rank prints one JSON line: for each scenario, the guard's outcomes and the SHA-256 of the
parameters after the last step. ``nanogpt``: the unguarded loop; ``report``: guarded, report mode,
no fault; ``transient``: a NaN in block 1's attention on the last rank at step ``FAULT_STEP``, for
that step; ``persistent``: the same NaN from that step on.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from sdcwatch.telemetry import Guard, GuardConfig, MicroBatches
from sdcwatch.testbed import FaultInjector, FaultSpec
from sdcwatch.testbed.model import GPT, GPTConfig, next_byte_loss
from torch.nn.parallel import DistributedDataParallel

STEPS, ACCUM, FAULT_STEP, CLIP = 12, 3, 8, 1.0
CONFIG = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2)
SCENARIOS = ("nanogpt", "report", "transient", "persistent")


def setup(rank: int, world: int):
    """The model, its DDP wrapper (None in one process), the optimizer and nanoGPT's ``get_batch``."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(CONFIG)
    ddp = DistributedDataParallel(model) if world > 1 else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(rank))  # this rank's shard

    def get_batch():  # nanoGPT's: random windows, drawn from torch's global generator
        ix = torch.randint(len(tokens) - CONFIG.seq_len - 1, (4,))
        return torch.stack([tokens[i : i + CONFIG.seq_len + 1] for i in ix])

    torch.manual_seed(1000 + rank)  # the batches' draws
    return model, ddp, opt, get_batch


def nanogpt(rank: int, world: int) -> list:
    """The loop as nanoGPT writes it: the next micro-batch fetched between forward and backward."""
    model, ddp, opt, get_batch = setup(rank, world)
    X = get_batch()
    for _ in range(STEPS):
        for micro_step in range(ACCUM):
            if ddp is not None:
                ddp.require_backward_grad_sync = micro_step == ACCUM - 1
            loss = next_byte_loss((ddp or model)(X[:, :-1]), X) / ACCUM
            X = get_batch()  # prefetch the next micro-batch while the backward runs
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [digest(model), []]


def guarded(rank: int, world: int, mode: str, faults: list[FaultSpec]) -> list:
    """The same loop under the guard: the micro-batches a step reads are kept for its rerun."""
    model, ddp, opt, get_batch = setup(rank, world)
    guard = Guard(model, opt, GuardConfig(mode=mode))
    injector = FaultInjector(faults, rank=rank).attach(model, opt)
    batches = MicroBatches(get_batch, per_step=ACCUM)
    outcomes = []
    for step in range(STEPS):
        micro = batches.of(step)

        def compute():
            injector.begin_step(step)  # again on the guard's rerun: a transient fault stays away
            total = torch.zeros(())
            for micro_step, X in enumerate(micro):
                if ddp is not None:
                    ddp.require_backward_grad_sync = micro_step == ACCUM - 1
                loss = next_byte_loss((ddp or model)(X[:, :-1]), X) / ACCUM
                loss.backward()
                total += loss.detach()
            return total, torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)

        outcome = guard.step(step, compute)
        injector.end_step()
        if outcome.action != "none" or outcome.would:
            outcomes.append([outcome.step, outcome.action or outcome.would, outcome.verdict, outcome.applied])
    injector.detach()
    return [digest(model), outcomes]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    nan = dict(kind="nan", rank=world - 1, step=FAULT_STEP, target="blocks.1.attn.scores")
    results = {
        "nanogpt": nanogpt(rank, world),
        "report": guarded(rank, world, "report", []),
        "transient": guarded(rank, world, "act", [FaultSpec(**nan)]),
        "persistent": guarded(rank, world, "act", [FaultSpec(**nan, duration=0)]),
    }
    # one write of the whole line (under PIPE_BUF): two ranks sharing the pipe never interleave
    os.write(sys.stdout.fileno(), (json.dumps({"rank": rank, **results}) + "\n").encode())
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
