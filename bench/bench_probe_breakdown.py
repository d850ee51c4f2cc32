"""Where the default probes' every-step cost goes, piece by piece, on the reference model (CPU).

The training thread's CPU time spent inside each probe function, per step that the sampled probes
(checksums, attention statistics, act_max, fingerprints) leave alone, next to the whole step's: the
extreme-value scan of the attention logits (``attn_logit_max``/``attn_logit_min``), of the products'
outputs (``gemm_out``), of the blocks' outputs (``stream_max``), the per-step reductions that turn
them into the record (with ``nonfinite_first``) and the per-product canary. Time inside a function
includes the device work it launches (on CPU, all of it), not the cache misses it causes later,
so the pieces add up to a little less than the overhead ``bench_overhead.py`` measures::

    .venv/bin/python bench/bench_probe_breakdown.py --batch-size 32 --steps 150
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import _Replica  # noqa: E402
from reference_step import batches  # noqa: E402
from sdcwatch.telemetry import MemoryBus  # noqa: E402
from sdcwatch.telemetry.probes import forward_order, gemm_canary, gemm_checks, residual_stream, sampled_checks  # noqa: E402
from sdcwatch.telemetry.probes.presets import probe_config  # noqa: E402
from sdcwatch.testbed.model import GPTConfig  # noqa: E402

#: (owner, function, what it is) of every piece timed
PIECES = [
    (residual_stream.ResidualStream, "observe_logits", "attention logits: max, masked min (attn_logit_*)"),
    (residual_stream.ResidualStream, "_hook", "block outputs: max, min (stream_max)"),
    (gemm_checks.GemmChecks, "_linear_hook", "linear outputs: row sums (gemm_out)"),
    (gemm_checks.GemmChecks, "_product_hook", "custom products' outputs: row sums (gemm_out)"),
    (gemm_checks.GemmChecks, "collect", "step end: gemm_out per product"),
    (residual_stream.ResidualStream, "collect", "step end: stream_max, attn_logit_* per layer"),
    (forward_order.ForwardOrder, "first", "step end: nonfinite_first"),
    (gemm_canary.GemmCanary, "report", "per-product canary (gemm_canary_fp)"),
    (sampled_checks.SampledChecks, "sync", "per-step switches"),
]


def _timed(acc: collections.Counter, label: str, f):
    @functools.wraps(f)
    def g(*args, **kwargs):
        t0 = time.thread_time_ns()
        try:
            return f(*args, **kwargs)
        finally:
            acc[label] += time.thread_time_ns() - t0

    return g


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probes", default="default", help="a preset or a JSON/TOML file (bench_overhead.py's names)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    acc: collections.Counter = collections.Counter()
    for owner, name, label in PIECES:
        if name == "_hook":  # a factory of closures: time the closures it makes
            make = getattr(owner, name)
            setattr(owner, name, lambda self, i, _make=make, _label=label: _timed(acc, _label, _make(self, i)))
        else:
            setattr(owner, name, _timed(acc, label, getattr(owner, name)))
    name, cfg = probe_config(args.probes)
    model_cfg = GPTConfig()
    replica = _Replica(0, model_cfg, cfg, MemoryBus())
    batch_of = batches(args.batch_size, model_cfg.seq_len)
    total = steps = 0
    sampled = [cfg.checksum_every, cfg.attention_every, cfg.activations_every]
    for step in range(args.warmup + args.steps):
        batch = batch_of(step)
        before = collections.Counter(acc)
        c0 = time.thread_time_ns()
        replica.step(step, batch)
        spent = time.thread_time_ns() - c0
        quiet = all(not every or step % every for every in sampled) and step % cfg.fingerprint_every
        if step >= args.warmup and quiet:
            steps += 1
            total += spent
        else:  # warm-up or a step a sampled probe runs on: not counted
            acc.clear()
            acc.update(before)
    replica.close()
    print(f"probes {name}, batch {args.batch_size}: {steps} every-step-only steps, {total / steps / 1e6:.2f} ms a step")
    for _, _, label in PIECES:
        us = acc[label] / steps / 1e3
        print(f"  {label:50s} {us:8.1f} us/step  {100 * acc[label] / total:5.2f}% of the step")
    inside = sum(acc.values())
    print(f"  {'all of the above':50s} {inside / steps / 1e3:8.1f} us/step  {100 * inside / total:5.2f}% of the step")
    if args.out:
        result = {
            "probes": name,
            "batch_size": args.batch_size,
            "steps": steps,
            "step_ms": total / steps / 1e6,
            "us_per_step": {label: acc[label] / steps / 1e3 for _, _, label in PIECES},
            "all_us_per_step": inside / steps / 1e3,
            "all_percent_of_step": 100 * inside / total,
            "load_average": list(os.getloadavg()),
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
