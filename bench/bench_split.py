"""The scale-out split: what a step summary costs and saves, and what sparse summaries cost in detection.

    .venv/bin/python bench/bench_split.py [--ranks 1024 16384] [--wire v2|v1] [--out results/split.json]

Side by side in one process, step by step on the same frames (the machine is shared; ratios
taken in one run are what to read):

- ``both``: one process runs everything (``process_frame``, the default);
- ``spatial``: the cross-rank half of every detector plus encoding the step summary (what each
  spatial instance does per step);
- ``temporal``: decoding a summary plus the detectors over time, attribution and incidents
  (what the single temporal instance does per step).

``temporal / spatial`` CPU per step says how many spatial instances one temporal instance keeps
up with; ``summary bytes`` against the records' bytes is what crosses the bus a second time.
The detection part injects a persistent shift of 2, 3 and 6 noise scales into one rank's q-norm
of one layer and counts the steps to the first incident naming the rank, whole (dense z) against
split (two spatial instances taking alternate 16-step windows; only the cells with |z| >= 2 or
with evidence building up over the instance's consecutive steps travel).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_detectors import LAYERS, SCALARS, make_frames  # noqa: E402
from sdcwatch.service.aligner import StepAligner  # noqa: E402
from sdcwatch.service.pipeline import DetectionPipeline  # noqa: E402
from sdcwatch.service.summary import decode_summary, encode_summary  # noqa: E402


def bench_ingest(world: int, n_layers: int, wire: str = "v2", steps: int = 3) -> dict:
    """CPU per step of what comes before the detectors: decoding the bus messages with the
    service's decoder (256 records a message, as ``sdcwatch bench ingest``) and aligning the records
    into a frame; ``wire`` is the format the ranks send (v2, the emitter's default, or v1)."""
    from bench_ingest import layout_coords, messages_v1, messages_v2, step_arrays
    from sdcwatch.service.ingest import IngestDecoder

    decoder = IngestDecoder()
    al = StepAligner(timeout=1e9, reorder_grace=1e9)
    decode_cpu = align_cpu = 0.0
    nbytes = 0
    for step in range(steps + 1):  # the first step learns the schema and allocates: not timed
        a = step_arrays(world, n_layers, step)
        a["coords"] = layout_coords(None, world)  # pure data parallel
        if wire == "v2":
            msgs = messages_v2("bench", world, a, 256, n_layers, first=step == 0)
        else:
            msgs = messages_v1("bench", world, a, 256)
        c0 = time.process_time()
        items, rejected = decoder.decode([("bench/0/0", b"k", m) for m in msgs])
        c1 = time.process_time()
        assert not rejected and len(al.add(items)) == 1, rejected[:1]
        if step:
            align_cpu += time.process_time() - c1
            decode_cpu += c1 - c0
            nbytes += sum(map(len, msgs))
    return {
        "wire": wire,
        "decode_ms_per_step": 1e3 * decode_cpu / steps,
        "align_ms_per_step": 1e3 * align_cpu / steps,
        "record_bytes_per_step": nbytes / steps,
    }


def bench_costs(world: int, n_layers: int, steps: int, wire: str = "v2") -> dict:
    both, spatial, temporal = (DetectionPipeline(stage=r) for r in ("both", "spatial", "temporal"))
    cpu = {"both": 0.0, "spatial": 0.0, "temporal": 0.0}
    sizes = []
    n = 0
    for step in range(steps + 3):
        (fr,) = make_frames(world, n_layers, 1, seed=step)
        fr.step = step
        timed = step >= 3  # the first steps allocate state
        c0 = time.process_time()
        both.process_frame(fr)
        c1 = time.process_time()
        blob = encode_summary(spatial.observe_step(fr))
        c2 = time.process_time()
        temporal.judge_step(decode_summary(blob))
        c3 = time.process_time()
        if timed:
            cpu["both"] += c1 - c0
            cpu["spatial"] += c2 - c1
            cpu["temporal"] += c3 - c2
            sizes.append(len(blob))
            n += 1
    values = world * (len(SCALARS) + len(LAYERS) * n_layers)
    ingest = bench_ingest(world, n_layers, wire)
    raw = ingest["record_bytes_per_step"]
    detect_ms = {k: 1e3 * v / n for k, v in cpu.items()}
    front = ingest["decode_ms_per_step"] + ingest["align_ms_per_step"]  # both and spatial read the records
    ms = {"both": front + detect_ms["both"], "spatial": front + detect_ms["spatial"], "temporal": detect_ms["temporal"]}
    return {
        "ranks": world,
        "metrics": values // world,
        "steps": n,
        "ingest": ingest,
        "detect_cpu_ms_per_step": detect_ms,
        "cpu_ms_per_step": ms,
        "detect_values_per_s": {k: values / (v / 1e3) for k, v in detect_ms.items()},
        "spatial_instances_one_temporal_keeps_up_with": ms["spatial"] / ms["temporal"],
        "steps_per_s_one_process": 1e3 / ms["both"],
        "summary_bytes_mean": float(np.mean(sizes)),
        "summary_bytes_max": int(max(sizes)),
        "record_bytes_per_step": raw,
        "bytes_ratio": raw / float(np.mean(sizes)),
        "incidents_on_clean_stream": {"both": len(both.incidents()), "split": len(temporal.incidents())},
    }


def bench_detection(
    world: int, n_layers: int, shifts: list[float], seeds: int, onset: int = 60, horizon: int = 140
) -> list[dict]:
    rows = []
    q = LAYERS.index("q_norm_mean")
    for sigmas in shifts:
        delays = {"both": [], "split": []}
        for seed in range(seeds):
            frames = make_frames(world, n_layers, onset + horizon, seed=1000 * seed + 7)
            rank, layer = 5, 2
            for fr in frames[onset:]:
                fr.layers[rank, q, layer] *= 1 + 0.01 * sigmas  # the layer metric's noise is 1%
            both = DetectionPipeline()
            # two spatial instances take alternate 16-step windows, as two consumers of the
            # telemetry partitions would (records are keyed by run and step // 16)
            spatial = [DetectionPipeline(stage="spatial") for _ in range(2)]
            temporal = DetectionPipeline(stage="temporal")
            found = {"both": None, "split": None}
            for fr in frames:
                both.process_frame(fr)
                sp = spatial[(fr.step // 16) % 2]
                temporal.judge_step(decode_summary(encode_summary(sp.observe_step(fr))))
                for e in both.incidents():
                    if rank in e.ranks and found["both"] is None:
                        found["both"] = e.first_step - onset
                for e in temporal.incidents():
                    if rank in e.ranks and found["split"] is None:
                        found["split"] = e.first_step - onset
            for k in delays:
                delays[k].append(found[k])
        row = {"shift_sigmas": sigmas, "seeds": seeds}
        for k, v in delays.items():
            hit = [d for d in v if d is not None]
            row[k] = {"found": len(hit), "median_delay_steps": float(np.median(hit)) if hit else None, "delays": v}
        rows.append(row)
    return rows


def _llama_names(layers: range) -> dict[str, list[str]]:
    """The lists a Llama-style pipeline stage holding ``layers`` sends (the probes' families)."""
    proj = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    proj += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    products = [f"model.layers.{i}.{p}" for i in layers for p in proj]
    leaves = ["input_layernorm", "post_attention_layernorm", "mlp.act_fn", *proj]
    return {
        "products": products,
        "blocks": [f"model.layers.{i}" for i in layers],
        "layers": [f"model.layers.{i}.self_attn" for i in layers],
        "modules": [f"model.layers.{i}.{p}" for i in layers for p in leaves],
        "canary_products": products,
    }


def bench_names(world: int, n_layers: int = 32, stages: int = 4, period: float = 300.0, step_s: float = 1.0) -> list:
    """What re-sending every rank's layer names costs a summary (``LayerNameBook.stamp``): a
    ``world``-rank job of a ``n_layers``-layer Llama in ``stages`` pipeline stages, one summary a
    ``step_s`` seconds over one ``period``. Bytes are the encoded summary with its names less the
    same summary without them (zlib compresses the two together). Layouts: one list (pure data
    parallel), the stages in contiguous rank blocks (pipeline outermost, as Megatron orders it),
    and interleaved (rank % stages: every summary's ranks point at every list, the worst case)."""
    from sdcwatch.core.rank_notes import LayerNames
    from sdcwatch.service.layer_name_book import LayerNameBook
    from sdcwatch.service.summary import StepSummary

    per = n_layers // stages
    tables = [
        LayerNames.build("bench", 0, world, 0, _llama_names(range(k * per, (k + 1) * per))) for k in range(stages)
    ]
    whole = LayerNames.build("bench", 0, world, 0, _llama_names(range(n_layers)))
    layouts = {
        "one list": lambda r: whole,
        f"{stages} stages, contiguous": lambda r: tables[r * stages // world],
        f"{stages} stages, interleaved": lambda r: tables[r % stages],
    }
    rows = []
    for layout, of in layouts.items():
        now = [0.0]
        spatial = LayerNameBook(resend=period, clock=lambda: now[0])
        temporal = LayerNameBook()
        for r in range(world):
            t = of(r)
            spatial.learn(LayerNames("bench", r, world, 0, t.names, t.digest, t.payload))
        added, cpu_stamp, cpu_take, seen, first = [], 0.0, 0.0, set(), 0
        for i in range(int(period / step_s) + 1):
            now[0] = i * step_s
            s = StepSummary(run="bench", step=i, world=world, n_present=world)
            c0 = time.process_time()
            spatial.stamp([s])
            c1 = time.process_time()
            blob = encode_summary(s)
            bare = len(blob) if s.names is None else len(encode_summary(StepSummary("bench", i, world, world)))
            c2 = time.process_time()
            temporal.take([decode_summary(blob)])
            c3 = time.process_time()
            if i == 0:  # every rank's list is new: the burst a (re)start sends, not the re-send
                first = len(blob) - bare
                temporal = LayerNameBook()  # a temporal stage that starts after it, with no state
                continue
            added.append(len(blob) - bare)
            cpu_stamp += c1 - c0
            cpu_take += c3 - c2
            seen.update(int(r) for rs in (s.names or {}).get("ranks", {}).values() for r in rs)
        n = len(added)
        rows.append(
            {
                "layout": layout,
                "ranks": world,
                "lists": len({id(of(r)) for r in range(0, world, max(world // 64, 1))}),
                "period_s": period,
                "step_s": step_s,
                "first_summary_added_bytes": first,
                "added_bytes_mean": float(np.mean(added)),
                "added_bytes_max": int(max(added)),
                "stamp_cpu_ms_per_summary": 1e3 * cpu_stamp / n,
                "take_cpu_ms_per_summary": 1e3 * cpu_take / n,
                "ranks_resent_in_one_period": len(seen),
                "fresh_temporal_knows_every_rank": all(temporal.names_of("bench", r) for r in range(world)),
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--layers", type=int, default=6, help="layers per layer metric (32 metrics with 6)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per world size")
    ap.add_argument("--detect-ranks", type=int, default=256, help="world size of the detection part")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument(
        "--wire", choices=("v2", "v1"), default="v2", help="format of the records the ranks send (default v2)"
    )
    ap.add_argument(
        "--parts", nargs="+", choices=("costs", "detection", "names"), default=["costs", "detection", "names"]
    )
    ap.add_argument("--names-layers", type=int, default=32, help="layers of the model whose names are re-sent")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    results = {
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "threads": 1},
        "command": "bench/bench_split.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "costs": [],
        "detection": [],
    }
    for world in args.ranks if "costs" in args.parts else ():
        row = bench_costs(world, args.layers, args.steps, args.wire)
        results["costs"].append(row)
        ms, dm, ing = row["cpu_ms_per_step"], row["detect_cpu_ms_per_step"], row["ingest"]
        print(
            f"{world:>6} ranks x {row['metrics']} metrics, wire {ing['wire']}: CPU ms/step (decode "
            f"{ing['decode_ms_per_step']:.0f} + "
            f"align {ing['align_ms_per_step']:.0f} + detectors) one process {ms['both']:.0f} "
            f"(detectors {dm['both']:.1f}), spatial {ms['spatial']:.0f} (detectors and summary {dm['spatial']:.1f}), "
            f"temporal {ms['temporal']:.2f} -> one temporal keeps up with "
            f"{row['spatial_instances_one_temporal_keeps_up_with']:.0f} spatial; summary "
            f"{row['summary_bytes_mean'] / 1e3:.1f} kB (max {row['summary_bytes_max'] / 1e3:.1f}) vs records "
            f"{row['record_bytes_per_step'] / 1e6:.2f} MB = {row['bytes_ratio']:.0f}x smaller; "
            f"incidents on the clean stream {row['incidents_on_clean_stream']}",
            flush=True,
        )
    for world in args.ranks if "names" in args.parts else ():
        for row in bench_names(world, args.names_layers):
            results.setdefault("names", []).append(row)
            print(
                f"{world:>6} ranks, {row['layout']}: names re-sent over {row['period_s']:.0f} s add "
                f"{row['added_bytes_mean'] / 1e3:.2f} kB a summary (max {row['added_bytes_max'] / 1e3:.2f}; "
                f"all new on the first: {row['first_summary_added_bytes'] / 1e3:.0f} kB), "
                f"stamp {row['stamp_cpu_ms_per_summary']:.2f} ms, take {row['take_cpu_ms_per_summary']:.2f} ms; "
                f"{row['ranks_resent_in_one_period']} ranks re-sent, a fresh temporal stage knows all: "
                f"{row['fresh_temporal_knows_every_rank']}",
                flush=True,
            )
    if "detection" in args.parts:
        results["detection"] = bench_detection(args.detect_ranks, args.layers, [2.0, 3.0, 6.0], args.seeds)
    for row in results["detection"]:
        b, s = row["both"], row["split"]
        print(
            f"shift {row['shift_sigmas']:.0f} sigma on one rank ({args.detect_ranks} ranks, {row['seeds']} seeds): "
            f"one process found {b['found']}, median delay {b['median_delay_steps']} steps; split found "
            f"{s['found']}, median delay {s['median_delay_steps']} steps",
            flush=True,
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
