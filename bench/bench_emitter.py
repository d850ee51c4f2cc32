"""Emitter benchmark: emit() latency, sustained records/s to the local broker, memory in an outage.

    python bench/bench_emitter.py [--records 200000] [--out results/emitter.json]

Targets: emit p99 <= 20 us; >= 20,000 records/s per process; memory flat at
the configured buffer during a broker outage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

from sdcwatch.broker import EmbeddedBroker
from sdcwatch.telemetry import Emitter, KafkaTransport

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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    logging.getLogger("sdcwatch").setLevel(logging.ERROR)
    out: dict = {"machine": f"{os.cpu_count()} cores", "records": args.records}
    with EmbeddedBroker(port=0) as broker:
        # 1. emit() latency while the sender is draining to the broker (a training loop at ~5 kHz)
        em = Emitter(KafkaTransport(broker.bootstrap, "bench.latency"), run="bench", rank=0, world=1, host="h")
        lat = []
        for step in range(50_000):
            t0 = time.perf_counter_ns()
            em.emit(step, layers=LAYERS, fingerprints=FPS, **SCALARS)
            lat.append(time.perf_counter_ns() - t0)
            if step % 50 == 0:
                time.sleep(0.01)
        em.close()
        lat.sort()
        out["emit_us"] = {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "p999": pct(lat, 0.999), "max": lat[-1] / 1000}

        # 2. sustained throughput: emit as fast as possible, time until the broker confirmed all
        em = Emitter(KafkaTransport(broker.bootstrap, "bench.throughput"), run="bench", rank=0, world=1, host="h",
                     buffer=args.records + 1)
        t0 = time.perf_counter()
        for step in range(args.records):
            em.emit(step, layers=LAYERS, fingerprints=FPS, **SCALARS)
        ok = em.flush(300)
        dt = time.perf_counter() - t0
        em.close()
        out["throughput_records_per_s"] = args.records / dt if ok else None
        out["throughput_sent"] = em.sent

        # 3. memory during an outage: the buffer bound holds, RSS stays flat while drops grow
        buffer = 50_000
        em = Emitter(KafkaTransport(broker.bootstrap, "bench.outage"), run="bench", rank=0, world=1, host="h",
                     buffer=buffer)
        em.emit(0, **SCALARS)
        em.flush(10)
        broker.kill()
        samples = []
        step = 1
        for phase in range(6):
            for _ in range(buffer):
                em.emit(step, layers=LAYERS, fingerprints=FPS, **SCALARS)
                step += 1
            samples.append({"emitted": em.emitted, "pending": em.pending, "dropped": em.dropped, "rss_mib": round(rss_mib(), 1)})
        em.close(timeout=0.5)
        out["outage"] = {"buffer": buffer, "samples": samples,
                         "rss_growth_after_fill_mib": round(samples[-1]["rss_mib"] - samples[1]["rss_mib"], 1),
                         "max_pending": max(s["pending"] for s in samples)}
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
