"""Overhead of sdcwatch at its default settings on a Hugging Face Llama under 2-rank DDP (gloo, CPU),
or under FSDP2 (``--fsdp``: ``fully_shard`` on every decoder layer and the root, the probes
attached with the mesh, ``attach(model, emitter, optimizer=opt, mesh=mesh)``).

Each rank holds two identical replicas of a randomly initialised ``LlamaForCausalLM`` (SDPA
attention, grouped-query heads), each in its own DDP wrapper on the same process group: one with
the probes and an emitter attached by ``attach(model, emitter, optimizer=opt, ddp=ddp)`` and no
other setting, one without. Their steps alternate (A, B, then B, A, ...), both ranks start each
step together (a barrier outside the timed region), and the overhead is taken per pair as
(step with) / (step without). Reported: the median of the paired ratios with its spread
(quartiles, 10th-90th percentile) over both ranks, and the ratio of total times, which includes
the sampled steps (attention, activations, fingerprints) at their real frequency::

    .venv/bin/python bench/bench_overhead_llama.py --steps 320 --out bench/results/overhead_llama.json
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
from pathlib import Path

import torch


def _model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.seq_len,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _rank(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    import torch.distributed as dist
    from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport, attach
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=args.world)
    replicas = []
    bus = MemoryBus()
    emitter = Emitter(MemoryTransport(bus), run="bench", rank=rank, world=args.world, host="bench")
    mesh = None
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (args.world,), mesh_dim_names=("dp_shard",))
    for watched in (True, False):
        model = _model(args)
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            ddp = fully_shard(model, mesh=mesh)
        else:
            ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        watch = None
        if watched:  # the defaults
            watch = (
                attach(model, emitter, optimizer=opt, mesh=mesh)
                if mesh
                else attach(model, emitter, optimizer=opt, ddp=ddp)
            )
        replicas.append((ddp, model, opt, watch))
    g = torch.Generator().manual_seed(rank)
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for step in range(args.warmup + args.steps):
        batch = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=g)
        for index in (0, 1) if step % 2 else (1, 0):  # alternate who goes first
            ddp, model, opt, watch = replicas[index]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = ddp(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if watch is not None:
                watch.step(step, loss=loss)
            if step >= args.warmup:
                times[watch is not None].append(time.perf_counter() - t0)
                cpu[watch is not None].append(time.thread_time() - c0)
    replicas[0][3].close()
    emitter.close()
    layers = [r.layers.get("attn_entropy") for r in bus.records() if r.layers]
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "with": times[True],
                "without": times[False],
                "cpu_with": cpu[True],
                "cpu_without": cpu[False],
                "records": len(bus.records()),
                "attention_records": len(layers),
                "layers_per_record": sorted({len(v) for v in layers if v}),
            }
        )
    )
    dist.destroy_process_group()


def _quantiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=20)
    return {"p10": q[1], "p25": q[4], "median": statistics.median(values), "p75": q[14], "p90": q[17]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=320, help="timed step pairs per rank")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of wrapping in DDP")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="sdcwatch-bench-") as tmp:
        mp.spawn(_rank, args=(args, f"file://{tmp}/rendezvous", tmp), nprocs=args.world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]
    ratios = [a / b for r in ranks for a, b in zip(r["with"], r["without"])]
    total_with = sum(sum(r["with"]) for r in ranks)
    total_without = sum(sum(r["without"]) for r in ranks)
    spread = _quantiles(ratios)
    cpu_ratios = [a / b for r in ranks for a, b in zip(r["cpu_with"], r["cpu_without"])]
    cpu_spread = _quantiles(cpu_ratios)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "seq_len", "batch_size")},
        "world": args.world,
        "parallel": "fsdp2" if args.fsdp else "ddp",
        "steps": args.steps,
        "median_step_ms_without": 1e3 * statistics.median([t for r in ranks for t in r["without"]]),
        "median_step_ms_with": 1e3 * statistics.median([t for r in ranks for t in r["with"]]),
        "paired_ratio": spread,
        "overhead_pct_median": 100.0 * (spread["median"] - 1.0),
        "overhead_pct_total_time": 100.0 * (total_with / total_without - 1.0),
        # the training thread's CPU time: blind to other processes preempting the ranks (a shared
        # machine) and to the emitter's own threads
        "cpu_paired_ratio": cpu_spread,
        "cpu_overhead_pct_median": 100.0 * (cpu_spread["median"] - 1.0),
        "cpu_overhead_pct_total": 100.0
        * (sum(sum(r["cpu_with"]) for r in ranks) / sum(sum(r["cpu_without"]) for r in ranks) - 1.0),
        "overhead_pct_per_rank": [
            100.0 * (statistics.median([a / b for a, b in zip(r["with"], r["without"])]) - 1.0) for r in ranks
        ],
        "records": [r["records"] for r in ranks],
        "attention_records": [r["attention_records"] for r in ranks],
        "layers_per_record": ranks[0]["layers_per_record"],
    }
    print(
        f"step {result['median_step_ms_without']:.1f} ms -> {result['median_step_ms_with']:.1f} ms; overhead "
        f"median {result['overhead_pct_median']:+.2f}% (paired ratios, quartiles "
        f"{100 * (spread['p25'] - 1):+.2f}%..{100 * (spread['p75'] - 1):+.2f}%, p10-p90 "
        f"{100 * (spread['p10'] - 1):+.2f}%..{100 * (spread['p90'] - 1):+.2f}%), "
        f"total time {result['overhead_pct_total_time']:+.2f}%; training-thread CPU median "
        f"{result['cpu_overhead_pct_median']:+.2f}% (quartiles {100 * (cpu_spread['p25'] - 1):+.2f}%.."
        f"{100 * (cpu_spread['p75'] - 1):+.2f}%), total {result['cpu_overhead_pct_total']:+.2f}%; per rank "
        f"{', '.join(f'{x:+.2f}%' for x in result['overhead_pct_per_rank'])}; "
        f"{sum(result['attention_records'])} records with attention for {args.layers} layers"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
