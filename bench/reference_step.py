"""The reference model's training step as the CPU benchmarks set it up and time it: the model at a
width, its optimizer, the batches, the step and two replicas timed side by side, defined once, so
that every benchmark's step time describes the same step (``bench_overhead.py``,
``bench_probe_breakdown.py``, ``bench_guard.py``, ``bench_gemm_canary.py``,
``bench_checksum_floor.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from sdcwatch.testbed.model import GPT, GPTConfig
from sdcwatch.testbed.simulated import shared_corpus

__all__ = [
    "CORPUS_BYTES",
    "LR",
    "at_width",
    "reference_model",
    "batches",
    "train_step",
    "side_by_side",
    "timed_alone",
    "write_result",
]

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


def timed_alone(doc: str, argv: Sequence[str] | None, rounds: str, default: int, help: str) -> tuple[Any, ...]:
    """What a benchmark that times one piece alone beside the training step sets up, on one thread:
    its options (``--batch-size``, ``--d-model``, ``--out`` and ``--{rounds}``, its timed rounds),
    the model at that width, its optimizer and its batches. Returns ``(args, cfg, model, opt, batch_of)``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument(f"--{rounds}", type=int, default=default, help=help)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = at_width(args.d_model)
    model, opt = reference_model(cfg)
    return args, cfg, model, opt, batches(args.batch_size, cfg.seq_len)


def write_result(out: str | None, result: Any) -> None:
    """The result as indented JSON into ``out`` (the raw result; ``bench/summarise.py`` makes its page)."""
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
