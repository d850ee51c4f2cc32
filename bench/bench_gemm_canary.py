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

import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_step import timed_alone, train_step, write_result  # noqa: E402
from sdcwatch.telemetry.probes.gemm_canary import GemmCanary  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    help = "timed rounds (each: 5 steps, then 500 canary calls)"
    args, cfg, model, opt, batch = timed_alone(__doc__, argv, "rounds", 20, help)
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
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
