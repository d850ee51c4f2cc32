"""Emitter benchmark: emit() latency, sustained records/s to the local broker, memory in an outage.

    python bench/bench_emitter.py [--emits 1000000] [--rate 10000] [--records 200000] [--out results/emitter.json]
    python bench/bench_emitter.py --mode outage [--outage-emits 120000] [--outage-rate 20000] [--old OLD_EMITTER.py]
    python bench/bench_emitter.py --mode signing [--records 200000] [--emits 200000]

1. emit() latency with the sender active: ``--emits`` calls per wire format (v2, the default, and
   v1), paced at ``--rate`` emits/s in bursts of 20 (the sender drains to the embedded broker
   meanwhile, its thread and kafka-python's competing for the GIL as in a training process);
   p50/p99/p99.9/max of each call's ``perf_counter_ns``.
2. Sustained throughput per wire: ``--records`` emitted as fast as possible, until the broker
   confirmed them all.
3. Memory during a broker outage (default wire): RSS flat while drops grow.

Targets: emit p99 <= 10 us and p99.9 <= 50 us over >= 1M emits; >= 20,000
records/s per process; memory flat at the configured buffer during a broker outage.

``--mode outage``: emit() latency while the bus is down (a transport that refuses every send)
and the 100,000-record buffer fills, garbage collection on as a training process has it; each
emit builds its layer lists afresh, as the probes do. Reports max and p99.9 of emit(), the longest
collection pass and the objects the collector tracks; ``--old path/to/emitter.py`` runs an older
emitter module side by side (copy it out of the tree first). Target: worst emit() <= 1 ms.

``--mode signing``: the sender's records/s with and without a job key (an in-memory bus, so the
sender thread is what is timed), side by side in one run, and emit() latency for each.
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

import gc
import importlib.util

from sdcwatch.core.errors import TransportError
from sdcwatch.core.signing import JobKey
from sdcwatch.telemetry import Emitter, KafkaTransport, MemoryBus, MemoryTransport

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


class DownTransport:
    """A bus that is down: every send is refused, nothing confirmed."""

    def send(self, records) -> None:
        raise TransportError("bus down (bench)", unsent=records)

    def close(self) -> None:
        pass


def load_emitter(path: str | None):
    """The Emitter class of ``path`` (an older copy of emitter.py), or the current one."""
    if not path:
        return Emitter
    spec = importlib.util.spec_from_file_location("bench_old_emitter", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Emitter


def outage_latency(emitter_cls, emits: int, rate: float, buffer: int = 100_000) -> dict:
    """emit() latency while the bus is down and the buffer fills (gc enabled, as a training process)."""
    gc.collect()
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    em = emitter_cls(DownTransport(), run="bench", rank=0, world=1, host="h", buffer=buffer)
    lat = array("q", bytes(8 * emits))
    step_max = 0  # the longest step of this loop (build the lists, emit): a pause in any thread shows here
    burst = 20
    gc.callbacks.append(on_gc)
    t_start = time.perf_counter()
    try:
        for step in range(emits):
            s0 = time.perf_counter_ns()
            layers = {name: [float(step), 2.0, 3.0, 4.0] for name in LAYERS}  # the probes' fresh lists
            t0 = time.perf_counter_ns()
            em.emit(step, layers=layers, fingerprints={"param_fp": step, "grad_fp": 42}, **SCALARS)
            t1 = time.perf_counter_ns()
            lat[step] = t1 - t0
            step_max = max(step_max, t1 - s0)
            if step % burst == burst - 1:
                wait = t_start + (step + 1) / rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
        elapsed = time.perf_counter() - t_start
        tracked = len(gc.get_objects())
    finally:
        gc.callbacks.remove(on_gc)
    pending, dropped = em.pending, em.dropped
    em.close(timeout=0.2)
    ordered = sorted(lat)
    full = [d for g, d in pauses if g == 2]
    return {
        "emitter": emitter_cls.__module__,
        "emits": emits,
        "offered_per_s": round(emits / elapsed),
        "buffer": buffer,
        "pending_at_end": pending,
        "dropped": dropped,
        "p50_us": pct(ordered, 0.5),
        "p99_us": pct(ordered, 0.99),
        "p999_us": pct(ordered, 0.999),
        "max_us": ordered[-1] / 1000,
        "over_1ms": sum(1 for x in lat if x > 1_000_000),
        "step_max_us": step_max / 1000,
        "gc_passes": len(pauses),
        "gc_full_passes": len(full),
        "gc_max_pause_ms": round(max((d for _, d in pauses), default=0.0) * 1000, 3),
        "gc_tracked_objects_at_end": tracked,
    }


def run_outage(args) -> dict:
    rows = {}
    for label, path in (("before", args.old), ("after", None)):
        if label == "before" and not path:
            continue
        rows[label] = row = outage_latency(load_emitter(path), args.outage_emits, args.outage_rate)
        print(
            f"outage {label}: emit() max {row['max_us']:.0f} us, p99.9 {row['p999_us']:.1f} us, p99 "
            f"{row['p99_us']:.1f} us, {row['over_1ms']} over 1 ms; longest loop step {row['step_max_us']:.0f} us; gc {row['gc_passes']} passes "
            f"({row['gc_full_passes']} full), longest {row['gc_max_pause_ms']} ms; {row['gc_tracked_objects_at_end']} "
            f"objects tracked; {row['pending_at_end']} buffered, {row['dropped']} dropped",
            file=sys.stderr,
            flush=True,
        )
    return rows


def sender_rate(key: JobKey | None, records: int, cls=Emitter) -> float:
    """Records a second the sender moves to an in-memory bus (emit as fast as possible, then flush)."""
    em = cls(MemoryTransport(MemoryBus(), key=key), run="bench", rank=0, world=1, host="h", buffer=records + 1)
    t0 = time.perf_counter()
    for step in range(records):
        em.emit(step, layers=LAYERS, fingerprints=FPS, **SCALARS)
    ok = em.flush(300)
    dt = time.perf_counter() - t0
    em.close()
    return records / dt if ok else 0.0


def emit_latency_memory(key: JobKey | None, emits: int, rate: float, cls=Emitter) -> dict:
    em = cls(MemoryTransport(MemoryBus(), key=key), run="bench", rank=0, world=1, host="h", buffer=emits + 1)
    lat = array("q", bytes(8 * emits))
    t_start = time.perf_counter()
    for step in range(emits):
        t0 = time.perf_counter_ns()
        em.emit(step, layers=LAYERS, fingerprints=FPS, **SCALARS)
        lat[step] = time.perf_counter_ns() - t0
        if step % 20 == 19:
            wait = t_start + (step + 1) / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
    em.close()
    ordered = sorted(lat)
    return {"p50": pct(ordered, 0.5), "p99": pct(ordered, 0.99), "p999": pct(ordered, 0.999)}


def run_signing(args) -> dict:
    key = JobKey("bench", b"0123456789abcdef0123456789abcdef")
    out: dict = {"sender_records_per_s": {}, "emit_us": {}}
    runs = [("unsigned", None, Emitter), ("signed", key, Emitter)]
    if args.old:  # the older emitter, unsigned: the hot path and the sender before this change
        runs.insert(0, ("before (unsigned)", None, load_emitter(args.old)))
    for rep in range(3):  # interleaved, best of three each: the machine is shared
        for label, k, cls in runs:
            rate = sender_rate(k, args.records, cls)
            out["sender_records_per_s"][label] = max(out["sender_records_per_s"].get(label, 0.0), rate)
    for label, k, cls in runs:
        out["emit_us"][label] = emit_latency_memory(k, args.emits, args.rate, cls)
    t0 = time.perf_counter()
    msg = bytes(256 * 150)  # a message of 256 v2 rows
    for _ in range(10_000):
        key.sign(msg)
    out["sign_us_per_256_row_message"] = (time.perf_counter() - t0) / 10_000 * 1e6
    s, u = out["sender_records_per_s"]["signed"], out["sender_records_per_s"]["unsigned"]
    print(
        f"sender: unsigned {u:,.0f} records/s, signed {s:,.0f} records/s ({(1 - s / u) * 100:+.1f}% cost); "
        f"emit() p50/p99 unsigned {out['emit_us']['unsigned']['p50']:.2f}/{out['emit_us']['unsigned']['p99']:.2f} us, "
        f"signed {out['emit_us']['signed']['p50']:.2f}/{out['emit_us']['signed']['p99']:.2f} us; "
        f"one signature over a 256-row message {out['sign_us_per_256_row_message']:.1f} us",
        file=sys.stderr,
        flush=True,
    )
    if args.old:
        b, e = out["sender_records_per_s"]["before (unsigned)"], out["emit_us"]["before (unsigned)"]
        print(f"before: sender {b:,.0f} records/s; emit() p50/p99 {e['p50']:.2f}/{e['p99']:.2f} us", file=sys.stderr)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emits", type=int, default=1_000_000, help="emit() calls timed per wire format")
    ap.add_argument("--rate", type=float, default=10_000, help="emits a second while timing")
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--mode", choices=("all", "outage", "signing"), default="all")
    ap.add_argument("--outage-emits", type=int, default=120_000, help="emits while the bus is down")
    ap.add_argument("--outage-rate", type=float, default=20_000, help="emits a second while the bus is down")
    ap.add_argument("--old", default=None, help="an older emitter.py to run beside this one (outage mode)")
    args = ap.parse_args(argv)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    logging.getLogger("sdcwatch").setLevel(logging.ERROR)
    if args.mode != "all":
        result = run_outage(args) if args.mode == "outage" else run_signing(args)
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
        return result
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
