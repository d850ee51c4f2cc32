"""Ingest cost: CPU per step to decode the bus messages, align them into a frame and run the detectors,
wire format v1 and v2 side by side in one process.

    sdcwatch bench ingest --ranks 16384 [--metrics 32] [--steps 5] [--per-message 256] [--parallel L] [--signed] [--json]
    python bench/bench_ingest.py --ranks 1024 16384 100000 --json

Each step is W records of M metric values (8 scalars + 4 layer metrics x L layers, M = 8 + 4L, and
2 fingerprints), packed ``--per-message`` records to a bus message as the emitters' transport or a
batching producer packs them. Per step and format: ``decode_ms`` (bytes to records or to column
blocks: ``IngestDecoder.decode``, the service's decoder, for both), ``align_ms`` (``StepAligner.add``
until the step's frame is out) and ``detect_ms`` (``DetectionPipeline.process_frame``, the default
detectors). ``us_per_record`` = (decode + align) / W. CPU time of this process
(``time.process_time``), one thread; the formats alternate step by step so a busy neighbour on a
shared machine weighs on both alike, and a garbage collection runs before each timed part so
that one format's garbage is not collected on the other's time. Targets: decode + align <= 2 us a record; 16,384
ranks x 32 metrics <= 100 ms a step in one process, 100,000 ranks <= 500 ms. With ``--parallel``
(a layout such as ``tp=8,pp=16,dp=128`` of ``--ranks`` ranks) every record carries its rank's mesh
coordinates and the detectors compare ranks within peer groups. With ``--signed`` a third format,
``v2-signed``, is the v2 messages each signed with a job key and verified (and its run bound) at
ingest, as the service reads them with ``[auth]`` keys.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path too (sdcwatch bench ingest)
from healthy_steps import FPS, LAYERS, SCALARS, fingerprints, healthy_values  # noqa: E402

FORMATS = ("v1", "v2")


def step_arrays(world: int, n_layers: int, step: int) -> dict:
    """One step of healthy values for every rank (what the ranks' probes would report)."""
    scalars, layers = healthy_values(np.random.default_rng(step), world, n_layers)
    return {"step": step, "scalars": scalars, "layers": layers.astype(np.float32), "fps": fingerprints(world, step)}


def layout_coords(layout, world: int) -> tuple[tuple[str, ...], np.ndarray]:
    """(the layout's dims, (world, dims) coordinates of every rank); no dims without a layout."""
    if layout is None:
        return (), np.zeros((world, 0), np.uint32)
    dims = tuple(layout.sizes)
    return dims, np.array([[c[d] for d in dims] for c in map(layout.coords, range(world))], np.uint32)


def messages_v1(run: str, world: int, a: dict, per_message: int) -> list[bytes]:
    from sdcwatch.core.record import encode, encode_batch
    from sdcwatch.core.record_type import Record

    dims, coords = a["coords"]

    recs = [
        Record(
            run,
            a["step"],
            r,
            world,
            f"node{r // 8}",
            1e9 + a["step"],
            r % 8,
            dict(zip(SCALARS, a["scalars"][r].tolist())),
            dict(zip(FPS, a["fps"][r].tolist())),
            {n: tuple(a["layers"][r, i].tolist()) for i, n in enumerate(LAYERS)},
            dict(zip(dims, coords[r].tolist())),
        )
        for r in range(world)
    ]
    return [
        encode(recs[i]) if per_message == 1 else encode_batch(recs[i : i + per_message])
        for i in range(0, world, per_message)
    ]


def messages_v2(run: str, world: int, a: dict, per_message: int, n_layers: int, first: bool) -> list[bytes]:
    """Rows packed straight from the arrays, as a producer holding many ranks packs them."""
    from sdcwatch.core.columnar import encode_rows
    from sdcwatch.core.record_layout import schema_for

    dims, coords = a["coords"]
    sch = schema_for(SCALARS, FPS, [(n, n_layers) for n in LAYERS], dims)
    rows = np.zeros(world, sch.dtype)
    if dims:
        rows["coords"] = coords
    rows["step"] = a["step"]
    rows["rank"] = np.arange(world)
    rows["world"] = world
    rows["local_rank"] = np.arange(world) % 8
    rows["time"] = 1e9 + a["step"]
    rows["scalars"] = a["scalars"]
    rows["fingerprints"] = a["fps"]
    rows["layers"] = a["layers"].reshape(world, -1)
    out = []
    for i in range(0, world, per_message):
        part = rows[i : i + per_message]
        hosts = sorted({f"node{r // 8}" for r in range(i, min(world, i + per_message))}, key=lambda h: int(h[4:]))
        part["host"] = np.arange(i, i + len(part)) // 8 - i // 8
        out.append(encode_rows(sch, run, hosts, part.tobytes(), len(part), with_schema=first and i == 0))
    return out


def bench(
    world: int, metrics: int, steps: int, per_message: int, warmup: int = 1, layout=None, signed: bool = False
) -> list[dict]:
    from sdcwatch.core.signing import JobKey, Keyring
    from sdcwatch.service.aligner import StepAligner
    from sdcwatch.service.auth import Authenticator
    from sdcwatch.service.ingest import IngestDecoder
    from sdcwatch.service.pipeline import DetectionPipeline

    n_layers = max(1, (metrics - len(SCALARS)) // len(LAYERS))
    metrics = len(SCALARS) + len(LAYERS) * n_layers
    formats = ("v1", "v2", "v2-signed") if signed else ("v1", "v2")
    key = JobKey("bench", b"a bench key of 32 bytes, not a secret")
    decoders = {f: IngestDecoder() for f in formats}
    decoders["v2-signed"] = IngestDecoder(auth=Authenticator(Keyring([key])))
    aligners = {f: StepAligner(timeout=1e9, reorder_grace=1e9) for f in formats}
    pipes = {f: DetectionPipeline() for f in formats}
    cpu = {f: {"decode": 0.0, "align": 0.0, "detect": 0.0} for f in formats}
    nbytes = {f: 0 for f in formats}
    timed = 0
    for step in range(warmup + steps):
        a = step_arrays(world, n_layers, step)
        a["coords"] = layout_coords(layout, world)
        msgs = {
            "v1": messages_v1("bench", world, a, per_message),
            "v2": messages_v2("bench", world, a, per_message, n_layers, first=step == 0),
        }
        if signed:  # the same messages, each signed by the rank (the job key) and verified at ingest
            msgs["v2-signed"] = [key.sign(m) for m in msgs["v2"]]
        frames = {}
        for f in formats if step % 2 == 0 else formats[::-1]:
            batch = [("bench/0/0", b"k", m) for m in msgs[f]]
            items = rejected = frame = None  # free the other format's records before, not inside, the timing
            gc.collect()  # each format pays for its own garbage, not for the other's
            c0 = time.process_time()
            items, rejected = decoders[f].decode(batch)
            c1 = time.process_time()
            (frame,) = aligners[f].add(items)
            c2 = time.process_time()
            pipes[f].process_frame(frame)
            c3 = time.process_time()
            assert not rejected, rejected[:1]
            frames[f] = frame
            if step >= warmup:
                cpu[f]["decode"] += c1 - c0
                cpu[f]["align"] += c2 - c1
                cpu[f]["detect"] += c3 - c2
                nbytes[f] += sum(map(len, msgs[f]))
        a1, a2 = frames["v1"], frames["v2"]  # the two formats must give the same frame
        assert a1.scalar_names == a2.scalar_names and np.array_equal(a1.scalars, a2.scalars, equal_nan=True)
        assert np.array_equal(a1.layers, a2.layers, equal_nan=True) and a1.hosts == a2.hosts
        assert np.array_equal(a1.coords, a2.coords)
        if signed:
            assert np.array_equal(frames["v2-signed"].scalars, a2.scalars, equal_nan=True)
        if step >= warmup:
            timed += 1
    rows = []
    for f in formats:
        ms = {k: 1e3 * v / timed for k, v in cpu[f].items()}
        rows.append(
            {
                "format": f,
                "ranks": world,
                "metrics": metrics,
                "decode_ms": round(ms["decode"], 3),
                "align_ms": round(ms["align"], 3),
                "detect_ms": round(ms["detect"], 3),
                "us_per_record": round(1e3 * (ms["decode"] + ms["align"]) / world, 3),
                "records_per_message": per_message,
                "bytes_per_record": round(nbytes[f] / timed / world, 1),
                "steps": timed,
                "incidents": len(pipes[f].incidents()),
                "parallel": "" if layout is None else str(layout),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="sdcwatch bench ingest", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16384], help="world sizes (default 16384)")
    ap.add_argument(
        "--metrics",
        type=int,
        default=32,
        help="metric values a rank (8 scalars + 4 layer metrics x layers; default 32)",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps a format (default 5, after 1 warm-up step)")
    ap.add_argument("--per-message", type=int, default=256, help="records a bus message (default 256)")
    ap.add_argument(
        "--parallel",
        metavar="LAYOUT",
        help="records carry mesh coordinates of this layout of --ranks ranks, e.g. tp=8,pp=16,dp=128",
    )
    ap.add_argument(
        "--signed", action="store_true", help="also v2 signed with a job key and verified at ingest (v2-signed)"
    )
    ap.add_argument("--json", action="store_true", help="one JSON object a line a format")
    ap.add_argument("--out", help="also write the rows as a JSON array here")
    args = ap.parse_args(argv)
    for key in ("steps", "per_message", "metrics"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be positive")
    if any(w < 1 for w in args.ranks):
        ap.error("--ranks must be positive")
    layout = None
    if args.parallel:
        from sdcwatch.core.errors import ConfigError
        from sdcwatch.core.mesh import Layout

        try:
            layout = Layout.parse(args.parallel, key="--parallel")
        except ConfigError as exc:
            ap.error(str(exc))
        if args.ranks != [layout.world]:
            ap.error(f"--parallel {layout} has {layout.world} ranks: give --ranks {layout.world}")
    out = []
    for world in args.ranks:
        rows = bench(world, args.metrics, args.steps, args.per_message, layout=layout, signed=args.signed)
        out += rows
        for r in rows:
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                print(
                    f"{r['format']}: {r['ranks']:>6} ranks x {r['metrics']} metrics, {r['records_per_message']} "
                    f"records a message: decode {r['decode_ms']:.1f} ms + align {r['align_ms']:.1f} ms + detect "
                    f"{r['detect_ms']:.1f} ms a step = {1e3 / max(r['decode_ms'] + r['align_ms'] + r['detect_ms'], 1e-9):.1f} "
                    f"steps/s of CPU; {r['us_per_record']:.2f} us a record (decode + align), "
                    f"{r['bytes_per_record']:.0f} bytes a record",
                    flush=True,
                )
        if not args.json:
            v1, v2 = rows[:2]
            print(
                f"       v2 decode + align {v1['us_per_record'] / max(v2['us_per_record'], 1e-9):.0f}x faster than v1",
                flush=True,
            )
            if args.signed:
                sig = rows[2]
                print(
                    f"       signed v2: {sig['us_per_record'] - v2['us_per_record']:+.3f} us a record for the "
                    f"signature check ({sig['us_per_record'] / max(v2['us_per_record'], 1e-9):.2f}x v2)",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
