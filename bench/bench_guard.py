"""Cost of the guard on a clean training step of the reference model (CPU).

Two identical replicas of the reference GPT train side by side in one process, one updating through
``Guard.step`` (local checks, the agreement all-reduce over a real gloo process group of one, the
RNG state kept for a rerun, a snapshot of model and optimizer every ``snapshot_every`` steps), one
with a plain ``optimizer.step()``; their steps are interleaved so machine noise hits both alike.
Reported per guard mode: the median over pairs of (guarded step) / (plain step), and the ratio of
total times (which includes the snapshots the median passes over). On a shared machine those
ratios carry a noise of a percent or two, more than the guard costs, so the guard's own time is also
measured directly: ``Guard.step`` around a no-op compute and update (median of 2,000 calls, the
``zero_grad`` a plain loop does anyway subtracted) plus one snapshot's time divided by the snapshot
interval, as a share of the plain step. ``device_skip`` is :class:`DeviceSkip` (the verdict on the
device, no host read) in place of ``optimizer.step()``, against the same plain step::

    .venv/bin/python bench/bench_guard.py --steps 400 --out bench/results/guard.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_step import reference_model, side_by_side  # noqa: E402
from sdcwatch.telemetry.guard.config import GuardConfig  # noqa: E402
from sdcwatch.telemetry.guard.device_skip import DeviceSkip, DeviceSkipConfig  # noqa: E402
from sdcwatch.telemetry.guard.guard import Guard  # noqa: E402
from sdcwatch.testbed.model import GPTConfig  # noqa: E402

CONFIGS = {
    "report": GuardConfig(),  # the default: decides and reports, changes nothing
    "act": GuardConfig(mode="act"),  # actions on, snapshot every 10 steps
    "act_snapshot_every_step": GuardConfig(mode="act", snapshot_every=1),
    # the skip decided on the device (no host read, no collective): AdamW as it is (restore path)
    "device_skip": DeviceSkipConfig(),
    # the same with AdamW(fused=True), against a plain fused AdamW: the optimizer skips itself (found_inf)
    "device_skip_fused": DeviceSkipConfig(how="found_inf"),
}


class _Replica:
    def __init__(self, model_cfg: GPTConfig, guard: GuardConfig | DeviceSkipConfig | None, fused: bool = False) -> None:
        self.model, self.opt = reference_model(model_cfg)
        if fused:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.opt.defaults["lr"], fused=True)
        self.skip = DeviceSkip(self.opt, guard) if isinstance(guard, DeviceSkipConfig) else None
        self.guard = Guard(self.model, self.opt, guard) if isinstance(guard, GuardConfig) else None

    def step(self, step: int, batch: torch.Tensor) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.thread_time()

        def compute():
            loss = self.model.loss(batch)
            loss.backward()
            return loss.detach(), torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

        if self.skip is not None:
            self.opt.zero_grad(set_to_none=True)
            loss, norm = compute()
            self.skip.step(norm, loss=loss)
        elif self.guard is None:
            self.opt.zero_grad(set_to_none=True)
            compute()
            self.opt.step()
        else:
            out = self.guard.step(step, compute)
            assert out.action == "none", out.message  # a clean run: the guard must not act
        return time.perf_counter() - t0, time.thread_time() - c0


def measure(guard: GuardConfig, steps: int, warmup: int, batch_size: int, model_cfg: GPTConfig) -> dict:
    fused = isinstance(guard, DeviceSkipConfig) and guard.how == "found_inf"
    guarded, plain = _Replica(model_cfg, guard, fused), _Replica(model_cfg, None, fused)
    timed = side_by_side(guarded, plain, batch_size, model_cfg.seq_len, steps, warmup)
    (g_t, g_cpu), (p_t, p_cpu) = (list(zip(*t)) for t in timed)
    ratios = [a / b for a, b in zip(g_t, p_t)]
    cpu_ratios = [a / b for a, b in zip(g_cpu, p_cpu)]
    assert torch.equal(
        torch.cat([p.reshape(-1) for p in guarded.model.parameters()]),
        torch.cat([p.reshape(-1) for p in plain.model.parameters()]),
    ), "the guard changed the training"
    return {
        "guard": guard.__dict__,
        "steps": steps,
        "median_step_ms_plain": 1e3 * statistics.median(p_t),
        "median_step_ms_guarded": 1e3 * statistics.median(g_t),
        "overhead_pct": 100.0 * (statistics.median(ratios) - 1.0),
        "total_time_overhead_pct": 100.0 * (sum(g_t) / sum(p_t) - 1.0),
        "cpu_overhead_pct": 100.0 * (statistics.median(cpu_ratios) - 1.0),
        "total_cpu_overhead_pct": 100.0 * (sum(g_cpu) / sum(p_cpu) - 1.0),
        "snapshots": guarded.guard.snapshots.taken if guarded.guard is not None else 0,
        "device_skips": guarded.skip.skipped()["skips"] if guarded.skip is not None else None,
        "identical_parameters_after": True,
    }


def own_cost(guard: GuardConfig, model_cfg: GPTConfig, calls: int = 2000) -> dict:
    """The guard's own time per clean step, without the training around it (see the module docstring)."""
    model, opt = reference_model(model_cfg)
    model.loss(torch.randint(0, model_cfg.vocab, (2, model_cfg.seq_len + 1))).backward()
    opt.step()  # the optimizer has its state: a snapshot copies it
    g = Guard(model, opt, replace(guard, snapshot_every=1 << 40))  # snapshots timed apart, below
    loss, norm = torch.tensor(2.5), torch.tensor(1.0)
    steps, zeros = [], []
    for s in range(calls):
        t = time.perf_counter()
        g.step(s + 1, lambda: (loss, norm), update=lambda: None)
        steps.append(time.perf_counter() - t)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        zeros.append(time.perf_counter() - t)
    snaps = []
    for _ in range(50):
        t = time.perf_counter()
        g.snapshots.take(0, 0, model, opt)
        snaps.append(time.perf_counter() - t)
    per_step = max(statistics.median(steps) - statistics.median(zeros), 0.0)
    snapshot = statistics.median(snaps) if guard.mode == "act" else 0.0
    return {
        "step_us": 1e6 * per_step,
        "snapshot_ms": 1e3 * snapshot,
        "per_step_us": 1e6 * (per_step + snapshot / guard.snapshot_every),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="timed step pairs per configuration")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model_cfg = GPTConfig(d_model=args.d_model, n_layer=args.layers, seq_len=args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        # the guard agrees through torch.distributed when it is initialised: a real gloo group of one
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rdzv')}", rank=0, world_size=1)
        try:
            results = {
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "torch": torch.__version__,
                "machine": platform.processor() or platform.machine(),
                "threads": 1,
                "model": model_cfg.__dict__,
                "batch_size": args.batch_size,
                "results": {},
            }
            for name in args.configs.split(","):
                if name not in CONFIGS:
                    ap.error(f"unknown config {name!r}; known: {list(CONFIGS)}")
                r = measure(CONFIGS[name], args.steps, args.warmup, args.batch_size, model_cfg)
                if isinstance(CONFIGS[name], DeviceSkipConfig):  # its cost is in the step it makes: no own time
                    results["results"][name] = r
                    print(
                        f"{name:26s} step {r['median_step_ms_plain']:.2f} ms -> {r['median_step_ms_guarded']:.2f} ms; "
                        f"overhead {r['overhead_pct']:+.2f}% (median of paired ratios), "
                        f"{r['total_time_overhead_pct']:+.2f}% of total time; {r['device_skips']} skips"
                    )
                    continue
                own = r["own"] = own_cost(CONFIGS[name], model_cfg)
                r["own_overhead_pct"] = 100.0 * own["per_step_us"] / (1e3 * r["median_step_ms_plain"])
                results["results"][name] = r
                print(
                    f"{name:26s} step {r['median_step_ms_plain']:.2f} ms -> {r['median_step_ms_guarded']:.2f} ms; "
                    f"overhead {r['overhead_pct']:+.2f}% (median of paired ratios), {r['total_time_overhead_pct']:+.2f}% "
                    f"of total time; training-thread CPU {r['cpu_overhead_pct']:+.2f}% / "
                    f"{r['total_cpu_overhead_pct']:+.2f}%; {r['snapshots']} snapshots; measured directly: "
                    f"{own['step_us']:.0f} us a step + {own['snapshot_ms']:.2f} ms a snapshot = "
                    f"{r['own_overhead_pct']:.2f}% of the plain step"
                )
        finally:
            dist.destroy_process_group()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
