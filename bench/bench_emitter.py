"""Emitter benchmark: emit() latency, sustained records/s to the local broker, memory in an outage.

    python bench/bench_emitter.py [--emits 1000000] [--rate 10000] [--records 200000] [--out results/emitter.json]

1. emit() latency with the sender active: ``--emits`` calls per wire format (v2, the default, and
   v1), paced at ``--rate`` emits/s in bursts of 20 (the sender drains to the embedded broker
   meanwhile, its thread and kafka-python's competing for the GIL as in a training process);
   p50/p99/p99.9/max of each call's ``perf_counter_ns``.
2. Sustained throughput per wire: ``--records`` emitted as fast as possible, until the broker
   confirmed them all.
3. Memory during a broker outage (default wire): RSS flat while drops grow.

Targets: emit p99 <= 10 us and p99.9 <= 50 us over >= 1M emits; >= 20,000
records/s per process; memory flat at the configured buffer during a broker outage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from array import array
from pathlib import Path

from sdcwatch.telemetry import Emitter, KafkaTransport

from sdcwatch.broker import EmbeddedBroker

LAYERS = {name: [1.0, 2.0, 3.0, 4.0] for name in ("attn_entropy", "q_norm_max", "k_norm_max", "attn_logit_max")}
SCALARS = dict(loss=2.5, grad_norm_local=1.1, grad_norm_global=1.0, grad_cosine=0.93, step_time=0.2, nonfinite=0.0)
FPS = {"param_fp": 0x1234_5678_9ABC_DEF0, "grad_fp": 42}


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pct(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(len(sorted_ns) * q))] / 1000


def emit_latency(bootstrap: str, wire: str, emits: int, rate: float) -> dict:
    """emit() latency percentiles over ``emits`` calls paced at ``rate`` a second (sender active)."""
    em = Emitter(
        KafkaTransport(bootstrap, f"bench.latency.{wire}"),
        run="bench",
        rank=0,
        world=1,
        host="h",
        wire=wire,
        buffer=200_000,
    )
    lat = array("q", bytes(8 * emits))
    burst = 20
    t_start = time.perf_counter()
    for step in range(emits):
        t0 = time.perf_counter_ns()
        em.emit(step, layers=LAYERS, fingerprints=FPS, **SCALARS)
        lat[step] = time.perf_counter_ns() - t0
        if step % burst == burst - 1:
            due = t_start + (step + 1) / rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
    elapsed = time.perf_counter() - t_start
    em.flush(60)
    em.close()
    ordered = sorted(lat)
    return {
        "wire": wire,
        "emits": emits,
        "offered_per_s": emits / elapsed,
        "sent": em.sent,
        "dropped": em.dropped,
        "max_pending": em.max_pending,
        "p50": pct(ordered, 0.5),
        "p99": pct(ordered, 0.99),
        "p999": pct(ordered, 0.999),
        "max": ordered[-1] / 1000,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emits", type=int, default=1_000_000, help="emit() calls timed per wire format")
    ap.add_argument("--rate", type=float, default=10_000, help="emits a second while timing")
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    logging.getLogger("sdcwatch").setLevel(logging.ERROR)
    out: dict = {
        "machine": f"{os.cpu_count()} cores",
        "records": args.records,
        "load_1min_at_start": os.getloadavg()[0],
    }
    with EmbeddedBroker(port=0) as broker:
        # 1. emit() latency while the sender is draining to the broker, per wire format
        out["emit_us_by_wire"] = {}
        for wire in ("v2", "v1"):
            out["emit_us_by_wire"][wire] = row = emit_latency(broker.bootstrap, wire, args.emits, args.rate)
            print(
                f"{wire}: emit() p50 {row['p50']:.2f} us, p99 {row['p99']:.2f} us, p99.9 {row['p999']:.2f} us, "
                f"max {row['max']:.0f} us over {row['emits']} emits at {row['offered_per_s']:.0f}/s "
                f"(dropped {row['dropped']})",
                file=sys.stderr,
                flush=True,
            )
        out["emit_us"] = {k: out["emit_us_by_wire"]["v2"][k] for k in ("p50", "p99", "p999", "max")}

        # 2. sustained throughput: emit as fast as possible, time until the broker confirmed all
        out["throughput_records_per_s_by_wire"] = {}
        for wire in ("v2", "v1"):
            em = Emitter(
                KafkaTransport(broker.bootstrap, f"bench.throughput.{wire}"),
                run="bench",
                rank=0,
                world=1,
                host="h",
                buffer=args.records + 1,
                wire=wire,
            )
            t0 = time.perf_counter()
            for step in range(args.records):
                em.emit(step, layers=LAYERS, fingerprints=FPS, **SCALARS)
            ok = em.flush(300)
            dt = time.perf_counter() - t0
            em.close()
            out["throughput_records_per_s_by_wire"][wire] = args.records / dt if ok else None
        out["throughput_records_per_s"] = out["throughput_records_per_s_by_wire"]["v2"]

        # 3. memory during an outage: the buffer bound holds, RSS stays flat while drops grow
        buffer = 50_000
        em = Emitter(
            KafkaTransport(broker.bootstrap, "bench.outage"), run="bench", rank=0, world=1, host="h", buffer=buffer
        )
        em.emit(0, **SCALARS)
        em.flush(10)
        broker.kill()
        samples = []
        step = 1
        for phase in range(6):
            for _ in range(buffer):
                em.emit(step, layers=LAYERS, fingerprints=FPS, **SCALARS)
                step += 1
            samples.append(
                {"emitted": em.emitted, "pending": em.pending, "dropped": em.dropped, "rss_mib": round(rss_mib(), 1)}
            )
        em.close(timeout=0.5)
        out["outage"] = {
            "buffer": buffer,
            "samples": samples,
            "rss_growth_after_fill_mib": round(samples[-1]["rss_mib"] - samples[1]["rss_mib"], 1),
            "max_pending": max(s["pending"] for s in samples),
        }
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
