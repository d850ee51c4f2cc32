"""The floor of unfused matrix checksums on the CPU: the reductions they must do, timed alone.

A checked product must read its output once (row sums), its input three times (one
matrix-vector product and the largest |value| for the bound: a maximum and a minimum), and in the
backward its output gradient twice (row sums, norm) and its input once more (one vector-matrix
product). This benchmark captures the reference model's tensors of one training step and times
only those reductions, next to the training step itself, interleaved: whatever the probes'
bookkeeping costs comes on top, so the ratio is a lower bound of the every-step checksums'
overhead for unfused kernels (AEGIS fuses them into the GEMM's epilogue and reads nothing again)::

    .venv/bin/python bench/bench_checksum_floor.py --batch-size 32 --repeats 30
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_step import timed_alone, train_step, write_result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    help = "timed rounds (each: a step, then the reductions)"
    args, cfg, model, opt, batch_of = timed_alone(__doc__, argv, "repeats", 30, help)
    batch = batch_of(0)
    linears, products = [], []

    def grab_linear(module, inputs, output):
        x = inputs[0].detach()
        output.register_hook(lambda dy: linears.append((module.weight.detach(), x, output.detach(), dy.detach())))

    handles = [m.register_forward_hook(grab_linear) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    handles += [
        m.register_forward_hook(lambda m, a, out: products.append((a[0].detach(), a[1].detach(), out.detach())))
        for m in model.modules()
        if getattr(m, "_sdcwatch_gemm", False)
    ]
    model.loss(batch).backward()
    for h in handles:
        h.remove()

    def step() -> None:
        train_step(model, opt, batch)

    def linear_reductions() -> None:
        for w, x, y, dy in linears:
            n, m = x.shape[-1], y.shape[-1]
            v = w.sum(0)
            y.sum(-1), x @ v, x.amax(), x.amin()  # forward: row sums, reference, bound
            x2, dy2 = x.reshape(-1, n), dy.reshape(-1, m)
            s = dy2.sum(-1)
            s @ x2, torch.linalg.vector_norm(dy2)  # backward: reference, bound

    def product_reductions() -> None:
        for a, b, c in products:
            c.sum(-1), a @ b.sum(-1).unsqueeze(-1), a.amax(), a.amin(), b.amax(), b.amin()

    def scan() -> None:  # what an unchecked step does: the row sums of every product's output
        for _, _, y, _ in linears:
            y.sum(-1)
        for _, _, c in products:
            c.sum(-1)

    parts = {"step": step, "linear": linear_reductions, "attention_product": product_reductions, "scan": scan}
    for f in parts.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(args.repeats):
        for name, f in parts.items():
            t0 = time.thread_time()
            f()
            times[name].append(time.thread_time() - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": cfg.__dict__,
        "batch_size": args.batch_size,
        "median_ms": med,
        "checks_floor_pct": 100.0 * (med["linear"] + med["attention_product"]) / med["step"],
        "scan_floor_pct": 100.0 * med["scan"] / med["step"],
    }
    print(
        f"step {med['step']:.2f} ms (training-thread CPU); the checksums' reductions alone: linear layers "
        f"{med['linear']:.2f} ms, attention product {med['attention_product']:.2f} ms = "
        f"{result['checks_floor_pct']:.1f}% of the step; the scan of every product's output "
        f"{med['scan']:.2f} ms = {result['scan_floor_pct']:.1f}%",
        flush=True,
    )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
