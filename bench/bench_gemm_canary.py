"""The per-product canary's cost, timed alone next to the training step it rides on.

Each step the probes multiply a 4-row known input by one linear layer's weight, in rotation, and
fingerprint the result (:mod:`sdcwatch.telemetry.probes.gemm_canary`). Its work does not grow with the
batch, so its share of a step falls as the batch and the model grow. This benchmark times the
call (training-thread CPU, every product of the rotation in turn) and the reference model's
training step, interleaved, and reports the ratio: a measurement on a quiet thread, where the
paired step-time ratios of ``bench/bench_overhead.py`` cannot resolve a difference this small on a
loaded machine::

    .venv/bin/python bench/bench_gemm_canary.py --batch-size 32 --rounds 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_step import at_width, batches, reference_model, train_step  # noqa: E402
from sdcwatch.telemetry.probes.gemm_canary import GemmCanary  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds (each: 5 steps, then 500 canary calls)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = at_width(args.d_model)
    model, opt = reference_model(cfg)
    batch = batches(args.batch_size, cfg.seq_len)
    canary = GemmCanary(model)

    def step(s: int) -> None:
        train_step(model, opt, batch(s))

    for s in range(3):  # warm-up
        step(s)
        canary.fingerprint(s)
    steps, calls = [], []
    for r in range(args.rounds):
        t0 = time.thread_time()
        for s in range(5):
            step(s)
        steps.append((time.thread_time() - t0) / 5)
        t0 = time.thread_time()
        raw = None
        for s in range(500):
            raw = canary.fingerprint(r * 500 + s)
        int(raw)  # the device work is done
        calls.append((time.thread_time() - t0) / 500)
    out = {
        "batch_size": args.batch_size,
        "d_model": args.d_model,
        "products": len(canary.products),
        "step_cpu_ms": statistics.median(steps) * 1e3,
        "canary_cpu_us": statistics.median(calls) * 1e6,
    }
    out["share_of_step_pct"] = out["canary_cpu_us"] / (out["step_cpu_ms"] * 1e3) * 100
    print(
        f"per-product canary: {out['canary_cpu_us']:.1f} us CPU a step against a {out['step_cpu_ms']:.1f} ms "
        f"training step (batch {args.batch_size}, d_model {args.d_model}): {out['share_of_step_pct']:.3f}%"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
