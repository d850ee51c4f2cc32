#!/usr/bin/env python3
"""Where a probe preset's cost goes on a GPU: each variant's step time and, from ``torch.profiler``,
the device time and kernel count it adds to the clean step, kernel by kernel.

A *variant* is a preset name (``default``, ``forward-checksums``, ``scalars-only``...) or ``clean``,
optionally with environment settings after a colon that are set while the replica is built, e.g.
``default:SDCWATCH_TRITON=0`` (the probes' row sums as torch ops, which inductor may fuse into the
kernels beside them, instead of the opaque Triton operator). Each variant is built alone (the
bench model of ``bench_gpu.py``), warmed up, timed over plain steps (not the sampled ones: 0, 16,
32...) with CUDA events, then profiled over a few more plain steps. The clean replica is timed
first and last, so a drift of the card shows.

    OUT=/tmp/out python3 bench/gpu/profile_probes.py --d-model 4096 --batch 4 \\
        --variants clean,scalars-only,default,default:SDCWATCH_TRITON=0
    python3 bench/gpu/profile_probes.py --smoke            # toy sizes on the CPU (wall-clock, no kernels)

Prints one table per variant (the kernels it adds, in ms a step) and a summary table last; writes
``$OUT/profile_probes.json`` (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_gpu  # noqa: E402  (its bootstrap makes sdcwatch importable from the checkout)
import torch  # noqa: E402

say = bench_gpu.say


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU")
    ap.add_argument("--d-model", type=int, default=None, help="width (default 4096; smoke 64)")
    ap.add_argument("--batch", type=int, default=None, help="sequences a step (default 4; smoke 4)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default 4; smoke 2)")
    ap.add_argument("--mode", choices=("eager", "compiled", "cudagraphs"), default="compiled")
    ap.add_argument("--compile-scope", choices=("model", "blocks"), default="model")
    ap.add_argument("--variants", default="clean,scalars-only,default,forward-checksums")
    ap.add_argument("--timed", type=int, default=None, help="timed plain steps (default 10; smoke 3)")
    ap.add_argument("--profiled", type=int, default=None, help="profiled plain steps (default 3; smoke 2)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per variant")
    ap.add_argument("--clip", action="store_true", help="clip gradients in every loop (see bench_gpu.py --clip)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def plan_for(a: argparse.Namespace) -> "bench_gpu.Plan":
    argv = ["--smoke"] if a.smoke else []
    d = a.d_model or (64 if a.smoke else 4096)
    argv += ["--d-models", str(d), "--batch", str(a.batch or 4), "--compile-scope", a.compile_scope]
    if a.clip:
        argv.append("--clip")
    if a.layers:
        argv += ["--layers", str(a.layers)]
    return bench_gpu.parse_plan(argv)


def variant(spec: str) -> tuple[str, dict[str, str]]:
    """``preset[:K=V[;K=V]]`` -> (preset, environment)."""
    name, _, env = spec.partition(":")
    pairs = dict(kv.split("=", 1) for kv in env.split(";") if kv)
    if name != "clean" and name not in bench_gpu.PROBE_PRESETS:
        raise SystemExit(f"--variants: {name!r} is neither clean nor a preset")
    return name, pairs


def plain_steps(start: int, n: int) -> list[int]:
    """``n`` step numbers from ``start`` on that no sampled probe runs at (not multiples of 16)."""
    out, s = [], start
    while len(out) < n:
        if s % 16:
            out.append(s)
        s += 1
    return out


def kernel_times(prof, steps: int) -> dict[str, tuple[float, float]]:
    """Kernel name -> (device ms a step, launches a step)."""
    out: dict[str, list[float]] = {}
    for evt in prof.events():
        if getattr(evt, "is_user_annotation", False) or evt.name.startswith(("Optimizer.", "ProfilerStep")):
            continue  # a range around kernels (the optimizer's step), not a kernel: counted twice else
        if str(getattr(evt, "device_type", "")).endswith("CUDA") and evt.device_time_total:
            name = evt.name
            cur = out.setdefault(name, [0.0, 0.0])
            cur[0] += evt.device_time_total / 1e3
            cur[1] += 1
    return {k: (v[0] / steps, v[1] / steps) for k, v in out.items()}


def measure(plan, d: int, mode: str, spec: str, data: list, timed: int, profiled: int) -> dict:
    """One variant: warm-up, timed plain steps, profiled plain steps."""
    name, env = variant(spec)
    with bench_gpu.environment(env):  # read when the replica is built (the probes decide it once)
        if mode != "eager":
            torch._dynamo.reset()
        cuda = plan.device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        rep = bench_gpu.Replica(plan, d, name, mode)
    for _ in range(3):
        rep.step(data[rep.step_no % len(data)])
    if cuda:
        torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    host, marks = [], []
    for s in plain_steps(rep.step_no, timed):
        rep.step_no = s
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        h0 = time.perf_counter()
        rep.step(data[s % len(data)])
        host.append((time.perf_counter() - h0) * 1e3)
        if cuda:
            b.record()
            marks.append((a, b))
    if cuda:
        torch.cuda.synchronize()
        ms = [a.elapsed_time(b) for a, b in marks]
    else:
        ms = host
    row = dict(
        variant=spec,
        warmup_s=round(warm, 1),
        ms_median=round(statistics.median(ms), 3),
        ms_all=[round(x, 3) for x in ms],
        host_ms_median=round(statistics.median(host), 3),
    )
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        steps = plain_steps(rep.step_no, profiled)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for s in steps:
                rep.step_no = s
                rep.step(data[s % len(data)])
            torch.cuda.synchronize()
        kernels = kernel_times(prof, len(steps))
        row["kernel_ms"] = round(sum(v[0] for v in kernels.values()), 3)
        row["kernel_launches"] = round(sum(v[1] for v in kernels.values()), 1)
        row["kernels"] = {k: [round(v[0], 4), round(v[1], 1)] for k, v in kernels.items()}
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if rep.watch is not None:
        row["probe_errors"] = rep.watch.errors
        rep.close()
    del rep
    bench_gpu.release()
    return row


def added(row: dict, clean: dict, top: int) -> list[tuple[str, float, float]]:
    """(kernel, ms a step added, launches added) against the clean replica, largest first."""
    base = clean.get("kernels", {})
    names = set(row.get("kernels", {})) | set(base)
    diff = []
    for k in names:
        ms = row.get("kernels", {}).get(k, [0, 0])
        b = base.get(k, [0, 0])
        diff.append((k, ms[0] - b[0], ms[1] - b[1]))
    diff.sort(key=lambda t: -abs(t[1]))
    return diff[:top]


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    plan = plan_for(a)
    torch.set_float32_matmul_precision("high")
    if a.smoke:
        torch.set_num_threads(1)
    d = plan.d_models[0]
    mode = a.mode if plan.device == "cuda" or a.mode == "eager" else "compiled"
    timed = a.timed or (3 if a.smoke else 10)
    profiled = a.profiled or (2 if a.smoke else 3)
    data = bench_gpu.token_batches(plan, d)
    specs = [s for s in a.variants.split(",") if s]
    for s in specs:
        variant(s)
    say(
        f"profile d_model {d} batch {plan.batch[d]} {mode} ({plan.scope}) on {bench_gpu.machine(plan).get('gpu', 'cpu')}"
    )
    rows = []
    for spec in specs + (["clean"] if specs and specs[0] == "clean" else []):
        t0 = time.perf_counter()
        try:
            row = measure(plan, d, mode, spec, data, timed, profiled)
        except Exception as exc:
            row = dict(variant=spec, error=bench_gpu.failure(exc))
            bench_gpu.release()
        rows.append(row)
        say(f"{spec}: {row.get('ms_median', row.get('error'))} ms ({time.perf_counter() - t0:.0f} s)")
    clean = [r for r in rows if r["variant"] == "clean" and "ms_median" in r]
    base_ms = statistics.fmean(r["ms_median"] for r in clean) if clean else None
    out = dict(machine=bench_gpu.machine(plan), d_model=d, batch=plan.batch[d], mode=mode, scope=plan.scope, rows=rows)
    path = a.json or (os.path.join(os.environ["OUT"], "profile_probes.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(out, indent=1))
    for r in rows:
        if clean and "kernels" in r and r is not clean[0]:
            print(f"\n{r['variant']}: kernels added to the clean step (ms a step, launches a step)")
            for k, ms, n in added(r, clean[0], a.top):
                print(f"  {ms:+8.3f} ms {n:+6.1f}  {k[:110]}")
    print("\n| variant | step ms | vs clean | kernel ms | vs clean | launches | host ms | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    k0 = clean[0].get("kernel_ms") if clean else None
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:120]} | | | | | | |")
            continue
        vs = f"{100 * (r['ms_median'] / base_ms - 1):+.2f}%" if base_ms else ""
        kv = f"{100 * (r['kernel_ms'] / k0 - 1):+.2f}%" if k0 and "kernel_ms" in r else ""
        print(
            f"| {r['variant']} | {r['ms_median']} | {vs} | {r.get('kernel_ms', '')} | {kv} | "
            f"{r.get('kernel_launches', '')} | {r['host_ms_median']} | {r.get('peak_mem_gib', '')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
