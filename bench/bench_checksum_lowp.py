"""Matrix checksums in bf16 and fp16 on the CPU: clean training raises no ratio above 1; which flipped bits are caught.

Trains the reference model (``sdcwatch.testbed.model``) ``--steps`` steps on a learnable byte
sequence with AdamW, every product checked on every step (forward, weight and bias gradient, weights
in memory), in one ``--mode``: ``bf16`` or ``fp16`` parameters, ``autocast-bf16`` or
``autocast-fp16`` (float32 parameters under ``torch.autocast("cpu")``), or ``fp32``. It prints the
largest clean ratio of each check and whether any step passed 1 (a false alarm). Then, on the trained
model, it flips each bit of one element of every linear layer's output (its median and its largest
|value|) and of its weight in memory, one at a time, and prints which bits are caught (ratio > 1 or
not finite) and the smallest change caught::

    .venv/bin/python bench/bench_checksum_lowp.py --steps 10000 --mode bf16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any, Callable

import torch
from sdcwatch.telemetry.probes.gemm_checks import GemmChecks
from sdcwatch.testbed.faults import flip_bit
from sdcwatch.testbed.model import GPT, GPTConfig

CHECKS = ("gemm_fwd", "gemm_bwd", "gemm_weight")
MODES = {  # parameter dtype, autocast dtype
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, None),
    "autocast-bf16": (torch.float32, torch.bfloat16),
    "autocast-fp16": (torch.float32, torch.float16),
}


def learnable_batches(batch: int, seq_len: int, seed: int) -> Callable[[int], torch.Tensor]:
    """Batches of ``t_{k+1} = 5 t_k + 3 mod 256`` from random starts, one byte in eight replaced by
    noise: the model learns it, so its weights and outputs grow as training goes on."""
    steps = torch.arange(seq_len + 1)

    def at(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        start = torch.randint(0, 256, (batch, 1), generator=g)
        seq = start.clone()
        for _ in steps[1:]:
            seq = torch.cat([seq, (seq[:, -1:] * 5 + 3) % 256], 1)
        noise = torch.rand(seq.shape, generator=g) < 0.125
        return torch.where(noise, torch.randint(0, 256, seq.shape, generator=g), seq)

    return at


def train_clean(args: argparse.Namespace) -> tuple[GPT, GemmChecks, Callable, dict[str, Any]]:
    """``args.steps`` checked steps; the largest ratio of each check, its product, and the steps above 1."""
    param_dtype, autocast = MODES[args.mode]
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layer=args.n_layer, n_head=4)).to(param_dtype)
    # float16 parameters: Adam's eps must stay above float16's underflow
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-4 if param_dtype == torch.float16 else 1e-8)
    checks = GemmChecks(model)
    data = learnable_batches(args.batch_size, args.seq_len, args.seed)

    def ctx() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()

    top = {k: torch.zeros(len(checks.names)) for k in CHECKS}
    over = {k: torch.zeros((), dtype=torch.long) for k in CHECKS}  # steps with a ratio above 1 (or NaN)
    losses = torch.zeros(args.steps)
    t0 = time.perf_counter()
    for s in range(args.steps):
        with ctx():
            loss = model.loss(data(s))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        checks.seal()
        got = checks.collect()
        losses[s] = loss.detach().float()
        for k in CHECKS:
            top[k] = torch.fmax(top[k], got[k])
            over[k] += (~(got[k] <= 1)).any()
    seconds = time.perf_counter() - t0
    clean = {
        k: {
            "max_ratio": float(top[k].max()),
            "product": checks.names[int(top[k].argmax())],
            "steps_above_1": int(over[k]),
        }
        for k in CHECKS
    }
    head = losses[: min(100, args.steps)].mean()
    tail = losses[-min(100, args.steps) :].mean()
    stats = {"clean": clean, "seconds": seconds, "loss_first_100": float(head), "loss_last_100": float(tail)}
    stats["nonfinite_losses"] = int((~losses.isfinite()).sum())
    return model, checks, ctx, stats


def _flip_output(index: int, bit: int, seen: dict) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        flat = out.detach().view(-1)
        seen["rms"] = float(flat.float().pow(2).mean().sqrt())  # of the clean output
        before = float(flat[index])
        flip_bit(flat, index, bit)
        seen["delta"] = abs(float(flat[index]) - before)
        return out

    return hook


def _trial(model: GPT, checks: GemmChecks, ctx: Callable, batch: torch.Tensor, check: str, i: int) -> float:
    """One checked forward (no backward) of ``batch``: the ratio of ``check`` for product ``i``."""
    with torch.no_grad(), ctx():
        model.loss(batch)
    return float(checks.collect()[check][i])


def _element(t: torch.Tensor, which: str) -> int:
    """Flat index of ``t``'s median or largest |value|."""
    a = t.detach().float().abs().view(-1)
    return int(a.argmax()) if which == "largest" else int(a.argsort()[a.numel() // 2])


def flip_sweep(model: GPT, checks: GemmChecks, ctx: Callable, batch: torch.Tensor) -> list[dict]:
    """Every bit of the median and the largest element of each linear layer's output and weight."""
    rows = []
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    checks.keep_bounds = True
    for name in linears:
        module, i = model.get_submodule(name), checks.names.index(name)
        grab: dict = {}
        handle = module.register_forward_hook(lambda m, a, out: grab.setdefault("y", out.detach().clone()))
        _trial(model, checks, ctx, batch, "gemm_fwd", i)
        handle.remove()
        y, bound = grab["y"], float(checks.bounds[("gemm_fwd", name)])
        for which in ("median", "largest"):
            index = _element(y, which)
            for bit in range(8 * y.element_size()):
                seen: dict = {}
                handle = module.register_forward_hook(_flip_output(index, bit, seen), prepend=True)
                ratio = _trial(model, checks, ctx, batch, "gemm_fwd", i)
                handle.remove()
                rows.append(_row("output", name, which, bit, ratio, seen["delta"], seen["rms"], bound, y.dtype))
        w = module.weight.data
        for which in ("median", "largest"):
            index = _element(w, which)
            for bit in range(8 * w.element_size()):
                before = float(w.view(-1)[index])
                flip_bit(w, index, bit)
                delta = abs(float(w.view(-1)[index]) - before)
                ratio = _trial(model, checks, ctx, batch, "gemm_weight", i)
                flip_bit(w, index, bit)  # back: the sealed sums hold again
                rms = float(w.float().pow(2).mean().sqrt())
                bound = float(checks.bounds[("gemm_weight", name + ".weight")])
                rows.append(_row("weight", name, which, bit, ratio, delta, rms, bound, w.dtype))
    return rows


def _row(
    target: str, name: str, which: str, bit: int, ratio: float, delta: float, rms: float, bound: float, dtype
) -> dict:
    caught = not ratio <= 1  # NaN and Inf too
    return {
        "target": target,
        "product": name,
        "element": which,
        "bit": bit,
        "dtype": str(dtype).replace("torch.", ""),
        "ratio": ratio,
        "caught": caught,
        "delta_over_rms": delta / rms if rms else float("inf"),
        "bound_over_rms": bound / rms if rms else float("inf"),
    }


def _bit_name(dtype: str, bit: int) -> str:
    mantissa = {"bfloat16": 7, "float16": 10, "float32": 23}[dtype]
    width = {"bfloat16": 16, "float16": 16, "float32": 32}[dtype]
    return "sign" if bit == width - 1 else f"e{bit - mantissa}" if bit >= mantissa else f"m{bit}"


def summarize(rows: list[dict]) -> dict:
    """Per target: how many of its flips each bit caught, and the smallest change caught."""
    out = {}
    for target in ("output", "weight"):
        mine = [r for r in rows if r["target"] == target]
        dtype = mine[0]["dtype"]
        bits = sorted({r["bit"] for r in mine}, reverse=True)
        per_bit = {}
        for b in bits:
            hit = [r for r in mine if r["bit"] == b]
            per_bit[_bit_name(dtype, b)] = f"{sum(r['caught'] for r in hit)}/{len(hit)}"
        caught = [r["delta_over_rms"] for r in mine if r["caught"] and r["delta_over_rms"] > 0]
        missed = [r["delta_over_rms"] for r in mine if not r["caught"]]
        out[target] = {
            "dtype": dtype,
            "caught_per_bit": per_bit,
            "smallest_caught_delta_over_rms": min(caught) if caught else None,
            "largest_missed_delta_over_rms": max(missed) if missed else None,
            "bound_over_rms": [min(r["bound_over_rms"] for r in mine), max(r["bound_over_rms"] for r in mine)],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=sorted(MODES), default="bf16")
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, checks, ctx, stats = train_clean(args)
    rows = flip_sweep(model, checks, ctx, learnable_batches(args.batch_size, args.seq_len, args.seed + 1)(0))
    flips = summarize(rows)
    print(
        f"mode {args.mode}: {args.steps} clean steps in {stats['seconds']:.0f} s, loss {stats['loss_first_100']:.3f}"
        f" -> {stats['loss_last_100']:.3f} (non-finite: {stats['nonfinite_losses']})"
    )
    print(f"{'check':<12} {'largest clean ratio':>20} {'at product':<22} {'steps above 1':>13}")
    for k, v in stats["clean"].items():
        print(f"{k:<12} {v['max_ratio']:>20.3g} {v['product']:<22} {v['steps_above_1']:>13}")
    for target, v in flips.items():
        print(f"\nflips of one {target} element ({v['dtype']}; median and largest |value| of each linear layer):")
        print("  caught per bit: " + " ".join(f"{b}:{c}" for b, c in v["caught_per_bit"].items()))
        lo, hi = v["bound_over_rms"]
        print(
            f"  bound / RMS: {lo:.3g} .. {hi:.3g}; smallest change caught: {v['smallest_caught_delta_over_rms']:.3g}"
            f" x RMS; largest missed: {v['largest_missed_delta_over_rms']:.3g} x RMS"
        )
    any_alarm = any(v["steps_above_1"] for v in stats["clean"].values())
    print(f"\nfalse alarms on clean steps: {'YES' if any_alarm else 'none'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **stats, "flips": flips, "trials": rows}, f, indent=1)
    return 1 if any_alarm else 0


if __name__ == "__main__":
    sys.exit(main())
