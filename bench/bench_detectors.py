"""Detector throughput: metric values per second through the default detector pipeline, side by
side with river's HalfSpaceTrees on the same per-rank stream.

    .venv/bin/python bench/bench_detectors.py [--ranks 1024 16384] [--metrics 32] [--out results.json]

Each step is one frame of W ranks x 32 metric values (8 scalars + 4 layer metrics x 6 layers, plus
2 fingerprints); the pipeline runs non-finite, spike, rank-outlier (median/MAD + CUSUM),
replica, straggler and missing-rank detectors, attribution and the incident book. River gets the
same values, one dict of 32 features per rank per step (``score_one`` + ``learn_one``), which is
how river's API is used; its rate is measured on a slice of ranks and is per value, so the ratio
does not depend on W. One process, one thread (the targets are per core): rates are per CPU
second of this process (``time.process_time``), wall-clock rates are reported beside them (on a
shared machine they are lower).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path too (sdcwatch bench)
from healthy_steps import FPS, LAYERS, SCALARS, fingerprints, healthy_values  # noqa: E402
from sdcwatch.detectors import StepFrame  # noqa: E402
from sdcwatch.service.pipeline import DetectionPipeline  # noqa: E402


def make_frames(world: int, n_layers: int, count: int, seed: int = 0) -> list[StepFrame]:
    """``count`` distinct healthy frames (cycled by the benchmark)."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(count):
        S, L = healthy_values(rng, world, n_layers)
        frames.append(
            StepFrame(
                run="bench",
                step=i,
                world=world,
                hosts=tuple(f"node{r // 8}" for r in range(world)),
                present=np.ones(world, bool),
                scalar_names=SCALARS,
                scalars=S,
                layer_names=LAYERS,
                layers=L,
                fp_names=FPS,
                fingerprints=fingerprints(world, i),
                fp_present=np.ones((world, len(FPS)), bool),
            )
        )
    return frames


def bench_pipeline(world: int, n_layers: int, min_seconds: float) -> dict:
    """Time only ``process_frame``; every step is a fresh random frame (made outside the timing)."""
    pipe = DetectionPipeline()
    values = world * (len(SCALARS) + len(LAYERS) * n_layers)
    wall = cpu = 0.0
    n = 0
    for step in range(100_000):
        (fr,) = make_frames(world, n_layers, 1, seed=step)
        fr.step = step
        w0, c0 = time.perf_counter(), time.process_time()
        pipe.process_frame(fr)
        if step >= 3:  # the first steps allocate state
            wall += time.perf_counter() - w0
            cpu += time.process_time() - c0
            n += 1
        if cpu >= min_seconds and n >= 5:
            break
    return {
        "steps": n,
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "steps_per_s": n / cpu,
        "values_per_s": n * values / cpu,
        "values_per_s_wall": n * values / wall,
        "values_per_step": values,
        "incidents_on_clean_stream": len(pipe.incidents()),
    }


def bench_river(world: int, n_layers: int, rank_records: int) -> dict:
    from river.anomaly import HalfSpaceTrees

    frames = make_frames(min(world, 1024), n_layers, 4, seed=1)
    hst = HalfSpaceTrees(n_trees=10, height=8, window_size=250, seed=42)
    names = [f"f{i}" for i in range(len(SCALARS) + len(LAYERS) * n_layers)]
    rows = []
    for fr in frames:
        X = np.concatenate([fr.scalars, fr.layers.reshape(fr.world, -1)], axis=1)
        X = (X - X.min(axis=0)) / (np.ptp(X, axis=0) + 1e-12)  # HST expects [0, 1]
        rows += [dict(zip(names, row)) for row in X.tolist()]
    for x in rows[:300]:  # build the trees and fill the first window outside the timing
        hst.learn_one(x)
    w0, c0 = time.perf_counter(), time.process_time()
    for i in range(rank_records):
        x = rows[i % len(rows)]
        hst.score_one(x)
        hst.learn_one(x)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {
        "rank_records": rank_records,
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "values_per_s": rank_records * len(names) / cpu,
        "values_per_s_wall": rank_records * len(names) / wall,
    }


def bench_alignment(world: int, n_layers: int, steps: int = 3) -> dict:
    """Records -> StepAligner -> StepFrame: the per-record Python cost in front of the detectors."""
    from sdcwatch.core.record_type import Record
    from sdcwatch.service.aligner import StepAligner

    (fr,) = make_frames(world, n_layers, 1, seed=99)
    records = [
        [
            Record(
                run="bench",
                step=s,
                rank=r,
                world=world,
                host=fr.hosts[r],
                scalars=dict(zip(SCALARS, fr.scalars[r].tolist())),
                fingerprints={"param_fp": s + 1, "grad_fp": s + 2},
                layers={n: fr.layers[r, i].tolist() for i, n in enumerate(LAYERS)},
            )
            for r in range(world)
        ]
        for s in range(steps)
    ]
    al = StepAligner(timeout=1e9)
    c0 = time.process_time()
    n = sum(len(al.add(recs)) for recs in records)
    cpu = time.process_time() - c0
    assert n == steps
    return {"records_per_s": world * steps / cpu, "steps_per_s": steps / cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--layers", type=int, default=6, help="layers per layer metric (32 metrics with 6)")
    ap.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per world size")
    ap.add_argument("--river-records", type=int, default=4000, help="rank records timed for river")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    results = {
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "numpy": np.__version__,
            "threads": 1,
        },
        "runs": [],
    }
    for world in args.ranks:
        ours = bench_pipeline(world, args.layers, args.seconds)
        river = bench_river(world, args.layers, args.river_records)
        align = bench_alignment(world, args.layers)
        row = {
            "ranks": world,
            "metrics": ours["values_per_step"] // world,
            "sdcwatch": ours,
            "river_hst": river,
            "ratio": ours["values_per_s"] / river["values_per_s"],
            "alignment": align,
        }
        results["runs"].append(row)
        print(
            f"{world:>6} ranks x {row['metrics']} metrics: sdcwatch {ours['values_per_s'] / 1e6:8.2f} M values/s "
            f"({ours['steps_per_s']:.1f} steps/s)  river HST {river['values_per_s'] / 1e3:8.1f} k values/s  "
            f"ratio {row['ratio']:.0f}x  incidents on clean stream: {ours['incidents_on_clean_stream']}  "
            f"alignment {align['records_per_s'] / 1e3:.0f} k records/s ({align['steps_per_s']:.1f} steps/s)"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
