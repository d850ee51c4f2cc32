"""The reference model's training step as the CPU benchmarks set it up and time it: the model at a
width, its optimizer, the batches, the step and two replicas timed side by side, defined once, so
that every benchmark's step time describes the same step (``bench_overhead.py``,
``bench_probe_breakdown.py``, ``bench_guard.py``, ``bench_gemm_canary.py``,
``bench_checksum_floor.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from sdcwatch.testbed.model import GPT, GPTConfig
from sdcwatch.testbed.simulated import shared_corpus

__all__ = ["CORPUS_BYTES", "LR", "at_width", "reference_model", "batches", "train_step", "side_by_side"]

CORPUS_BYTES = 1 << 20
"""Bytes of stdlib source the benchmarks train on."""
LR = 1e-3
"""AdamW's learning rate."""


def at_width(d_model: int) -> GPTConfig:
    """The reference model's shape at width ``d_model``: heads 64 wide, at least 4 of them."""
    return GPTConfig(d_model=d_model, n_head=max(4, d_model // 64))


def reference_model(cfg: GPTConfig, seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    """The reference model of shape ``cfg``, initialised from ``seed``, and its AdamW."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def batches(batch_size: int, seq_len: int) -> Callable[[int], torch.Tensor]:
    """Step ``s`` -> rank 0's batch of ``batch_size`` chunks of ``seq_len + 1`` tokens (seed 0)."""
    corpus = shared_corpus(CORPUS_BYTES)
    return lambda step: corpus.batch(seed=0, step=step, rank=0, batch_size=batch_size, seq_len=seq_len)


def train_step(model: GPT, opt: torch.optim.Optimizer, batch: torch.Tensor, clip: float | None = None) -> torch.Tensor:
    """One training step on ``batch`` (the gradient's norm clipped to ``clip`` when set); its loss."""
    loss = model.loss(batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss


def side_by_side(
    first: Any, second: Any, batch_size: int, seq_len: int, steps: int, warmup: int
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Two replicas' steps on the same batches, interleaved so that machine noise hits both alike:
    ``warmup`` untimed pairs, then ``steps`` timed ones; which goes first alternates, so neither
    always runs on a warmer cache. A replica's ``step(step, batch)`` returns its wall-clock and
    training-thread CPU seconds; returned: those of each replica's timed steps."""
    batch_of = batches(batch_size, seq_len)
    times: tuple[list, list] = ([], [])
    for step in range(warmup + steps):
        batch = batch_of(step)
        if step % 2:
            a = first.step(step, batch)
            b = second.step(step, batch)
        else:
            b = second.step(step, batch)
            a = first.step(step, batch)
        if step >= warmup:
            times[0].append(a)
            times[1].append(b)
    return times
