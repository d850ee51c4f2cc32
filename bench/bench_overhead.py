"""Overhead of sdcwatch probes plus emitter on the reference model's training step (CPU).

Two identical replicas of the reference GPT train side by side in one process, one with probes
and an emitter attached, one without; their steps are interleaved (A, B, A, B, ...) so machine
noise hits both alike. The overhead is reported two ways: the median over pairs of
(step with) / (step without), and the ratio of the mean step times, which counts the work of
sampled steps (a check every 16th step is invisible in a median, not in a mean). Wall-clock ratios
suffer from other processes on a shared machine; the training thread's CPU time is reported too. Measured at the default sampling and with every probe on every step::

    .venv/bin/python bench/bench_overhead.py --steps 400 --out bench/overhead.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path too (sdcwatch bench)
from reference_step import reference_model, side_by_side, train_step, write_result  # noqa: E402
from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport, NullEmitter  # noqa: E402
from sdcwatch.telemetry.probes.config import ProbeConfig  # noqa: E402
from sdcwatch.telemetry.probes.presets import PROBE_PRESETS, probe_config  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.testbed.model import GPTConfig  # noqa: E402

# the campaign's names (sdcwatch.telemetry.probes.presets): the cost and the detection of one configuration
CONFIGS = dict(PROBE_PRESETS)


class _Replica:
    """One model + optimizer, optionally watched, that can run one timed training step."""

    def __init__(
        self,
        seed: int,
        model_cfg: GPTConfig,
        probes: ProbeConfig | None,
        bus: MemoryBus | None,
        null_emitter: bool = False,
    ):
        self.model, self.opt = reference_model(model_cfg, seed)
        self.emitter = None
        self.watch = None
        if probes is not None:
            self.emitter = (
                NullEmitter()
                if null_emitter
                else Emitter(MemoryTransport(bus), run="bench", rank=0, world=1, host="bench")
            )
            canary = None
            if probes.canary_every:  # a fixed input, as a user would pass
                canary = torch.randint(
                    0, model_cfg.vocab, (2, model_cfg.seq_len), generator=torch.Generator().manual_seed(0x5DC)
                )
            self.watch = attach(self.model, self.emitter, optimizer=self.opt, config=probes, canary_input=canary)

    def step(self, step: int, batch: torch.Tensor) -> tuple[float, float]:
        """Run one step; returns its wall time and the training thread's CPU time."""
        t0 = time.perf_counter()
        c0 = time.thread_time()
        loss = train_step(self.model, self.opt, batch, clip=1.0)
        if self.watch is not None:
            self.watch.step(step, loss=loss)
        return time.perf_counter() - t0, time.thread_time() - c0

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.emitter.close()


def measure(
    probes: ProbeConfig, steps: int, warmup: int, batch_size: int, model_cfg: GPTConfig, null_emitter: bool = False
) -> dict:
    bus = MemoryBus()
    watched = _Replica(0, model_cfg, probes, bus, null_emitter)
    plain = _Replica(0, model_cfg, None, None)
    timed = side_by_side(watched, plain, batch_size, model_cfg.seq_len, steps, warmup)
    (with_t, with_cpu), (without_t, without_cpu) = (list(zip(*t)) for t in timed)
    ratios = [a / b for a, b in zip(with_t, without_t)]
    cpu_ratios = [a / b for a, b in zip(with_cpu, without_cpu)]
    watched.close()
    records = len(bus.records())
    return {
        "probes": probes.__dict__,
        "steps": steps,
        "median_step_ms_with": 1e3 * statistics.median(with_t),
        "median_step_ms_without": 1e3 * statistics.median(without_t),
        "median_ratio": statistics.median(ratios),
        "overhead_pct": 100.0 * (statistics.median(ratios) - 1.0),
        "ratio_of_medians": statistics.median(with_t) / statistics.median(without_t),
        "ratio_of_means": statistics.fmean(with_t) / statistics.fmean(without_t),
        "mean_cpu_ratio": statistics.fmean(cpu_ratios),
        # CPU time of the training thread only: blind to other processes preempting us (this
        # machine is shared), and to work done on other threads (the emitter's sender)
        "median_cpu_ratio": statistics.median(cpu_ratios),
        "cpu_overhead_pct": 100.0 * (statistics.median(cpu_ratios) - 1.0),
        # means: the sampled steps' work counts (one step in 16 that costs 20% more adds 1.25%)
        "mean_step_ms_with": 1e3 * statistics.fmean(with_t),
        "mean_step_ms_without": 1e3 * statistics.fmean(without_t),
        "mean_overhead_pct": 100.0 * (sum(with_t) / sum(without_t) - 1.0),
        "mean_cpu_overhead_pct": 100.0 * (sum(with_cpu) / sum(without_cpu) - 1.0),
        "records_emitted": records,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="timed step pairs per configuration")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument(
        "--d-model",
        type=int,
        nargs="+",
        default=[64],
        help="model width(s); several measure how the overhead falls as the model grows",
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--probes",
        "--configs",
        dest="configs",
        default=",".join(CONFIGS),
        help=f"comma-separated presets ({', '.join(CONFIGS)}) or JSON/TOML files of probe settings "
        "(the names sdcwatch bench campaign --probes takes)",
    )
    ap.add_argument(
        "--null-emitter",
        action="store_true",
        help="probes only: records go to a do-nothing emitter (isolates the emitter's share)",
    )
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "model": GPTConfig(d_model=args.d_model[0], n_layer=args.layers, seq_len=args.seq_len).__dict__,
        "batch_size": args.batch_size,
        "emitter": "NullEmitter" if args.null_emitter else "Emitter(MemoryTransport)",
        "results": {},
    }
    configs = []
    for spec in args.configs.split(","):
        try:
            configs.append(probe_config(spec))
        except Exception as exc:  # ConfigError: name the bad preset or file
            ap.error(str(exc))
    for width in args.d_model:
        model_cfg = GPTConfig(
            d_model=width, n_layer=args.layers, seq_len=args.seq_len, n_head=max(4, width // 64)
        )  # d_head 16 at the reference width, 64 from 256 on
        for name, probes in configs:
            r = measure(probes, args.steps, args.warmup, args.batch_size, model_cfg, args.null_emitter)
            r["d_model"] = width
            key = name if len(args.d_model) == 1 else f"{name}@d{width}"
            results["results"][key] = r
            print(
                f"{key:15s} step {r['median_step_ms_without']:.2f} ms -> {r['median_step_ms_with']:.2f} ms; "
                f"overhead median {r['overhead_pct']:+.2f}% wall, {r['cpu_overhead_pct']:+.2f}% CPU; "
                f"mean {r['mean_overhead_pct']:+.2f}% wall, {r['mean_cpu_overhead_pct']:+.2f}% CPU "
                f"(training thread; {r['steps']} step pairs); {r['records_emitted']} records",
                flush=True,
            )
    write_result(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
