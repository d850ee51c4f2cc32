"""End-to-end benchmark: N simulated ranks -> several producer processes -> real broker -> detector service.

    python bench/bench_e2e.py [--ranks 1024 16384] [--duration 60] [--rate R] [--producers P]
                              [--wire v2|v1] [--per-message K] [--split|--no-split]
                              [--out results/e2e.json] [--quick]

For each N, P producer processes (each owning a slice of the ranks) send one record per rank per
step into an embedded Tansu broker, paced at ``rate`` steps/s. With ``--wire v2`` (the default, as
the emitter's) a producer batches ``--per-message`` simulated ranks (default 2048) into one v2
message packed straight from numpy arrays, keyed like the emitters' records (run and 16-step
window); with ``--wire v1`` it sends :class:`~sdcwatch.core.record.Record` objects through
:class:`~sdcwatch.telemetry.KafkaTransport` (256 a message). The detection service
(:class:`~sdcwatch.detectors.DetectorService` reading a
:class:`~sdcwatch.service.bus.KafkaSource` consumer group, default pipeline) runs in this
process; with ``--split`` (the default above 16,384 ranks) it runs as one *spatial* instance
publishing step summaries to a summaries topic on the broker and one *temporal* instance reading
them, both in this process, and the CPU time of each is measured apart: the spatial instance's
steps per CPU second is the rate one spatial instance sustains, from which the number of
instances a job needs follows (``bench/README.md``). Every ``fault_every`` steps one rank
reports a NaN loss; the service must open a non-finite incident for it. Measured:

- ``produced_steps_per_s`` and ``processed_steps_per_s`` (steps the service closed, per second,
  while the producers ran), consumer lag sampled every 0.5 s (Kafka messages behind the topic's
  end; a message holds up to 256 records of one step); ``bounded_lag``: the lag when the producers
  stopped was at most 3 steps' worth of messages;
- emit-to-incident latency of each injected fault: from the producer's wall time when it built the
  faulty record to the service's wall time when the incident was opened (p50, p99, max; a fault
  with no incident counts as missed).

Targets: 16,384 ranks at >= 5 steps/s sustained with bounded lag and p99 latency < 1 s;
100,000 ranks at >= 1 step/s with the split (one spatial instance's rate measured, the rest derived).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from sdcwatch.core.vocabulary import LAYER_METRICS

N_LAYERS = 2
RUN = "e2e"


def fault_rank(step: int, world: int) -> int:
    """The rank that reports the NaN at a fault step (spread over ranks and so over producers)."""
    return (step * 7919) % world


# -- producer process ------------------------------------------------------------------------------

SCALARS = ("loss", "loss_global", "grad_norm_local", "grad_norm_global", "grad_cosine", "step_time", "nonfinite", "lr")


def synthetic_step(rng: np.random.Generator, step: int, n: int, rate: float) -> tuple[np.ndarray, np.ndarray, dict]:
    """One healthy step of ``n`` ranks: scalars (n, SCALARS), layer values (n, metrics x layers)
    in ``LAYER_METRICS`` order, and the fingerprints every rank shares (``param_fp`` every 50 steps)."""
    base = 2.0 + 0.5 * math.exp(-step / 500)
    sc = np.empty((n, len(SCALARS)))
    sc[:, 0] = base + 0.05 * rng.standard_normal(n)
    sc[:, 1] = base
    sc[:, 2] = 1.0 + 0.1 * rng.standard_normal(n)
    sc[:, 3] = 1.0
    sc[:, 4] = 0.9 + 0.01 * rng.standard_normal(n)
    sc[:, 5] = 1.0 / rate
    sc[:, 6] = 0.0
    sc[:, 7] = 3e-4
    layers = 1.0 + 0.01 * rng.standard_normal((n, len(LAYER_METRICS) * N_LAYERS))
    gfp = (step * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    fps = {"grad_fp": gfp}
    if step % 50 == 0:
        fps["param_fp"] = (gfp ^ 0xABCDEF) & 0xFFFF_FFFF_FFFF_FFFF
    return sc, layers, fps


class V1Sender:
    """Sends a step as :class:`~sdcwatch.core.record.Record` objects through the emitters'
    :class:`~sdcwatch.telemetry.KafkaTransport` (256 records a message)."""

    def __init__(self, a: argparse.Namespace) -> None:
        from sdcwatch.telemetry import KafkaTransport

        self.a = a
        self.transport = KafkaTransport(
            a.bootstrap,
            a.topic,
            partitions=a.partitions,
            linger_ms=5,
            flush_timeout=30.0,
            request_timeout_ms=10_000,
            delivery_timeout_ms=30_000,
        )
        self.transport.send([])  # connect (and create the topic) before the clock starts

    def send(self, step: int, ranks: np.ndarray, sc: np.ndarray, layers: np.ndarray, fps: dict, now: float) -> None:
        from sdcwatch.core.record_type import Record

        per = layers.reshape(len(ranks), len(LAYER_METRICS), N_LAYERS)
        records = [
            Record(
                RUN,
                step,
                r,
                self.a.world,
                f"node{r // 8}",
                now,
                r % 8,
                dict(zip(SCALARS, sc[i].tolist())),
                dict(fps),
                {m: per[i, j].tolist() for j, m in enumerate(LAYER_METRICS)},
            )
            for i, r in enumerate(ranks.tolist())
        ]
        self.transport.send(records)

    def close(self) -> None:
        self.transport.close()


class V2Sender:
    """Sends a step as v2 rows packed straight from the arrays, ``per_message`` ranks a message,
    keyed like the emitters' records (run and 16-step window); the schema rides in the first
    message of each key."""

    def __init__(self, a: argparse.Namespace) -> None:
        from kafka import KafkaProducer
        from sdcwatch.core.record_layout import schema_for
        from sdcwatch.telemetry.wire.transports import ensure_topic

        self.a = a
        layers = [(m, N_LAYERS) for m in LAYER_METRICS]
        self.schemas = {
            fp_names: schema_for(SCALARS, fp_names, layers) for fp_names in (("grad_fp",), ("grad_fp", "param_fp"))
        }
        ensure_topic(a.bootstrap, a.topic, a.partitions)
        self.producer = KafkaProducer(
            bootstrap_servers=a.bootstrap.split(","), linger_ms=5, acks=1, max_request_size=16 << 20, batch_size=1 << 20
        )
        self.producer.partitions_for(a.topic)
        self.sent_keys: set = set()

    def send(self, step: int, ranks: np.ndarray, sc: np.ndarray, layers: np.ndarray, fps: dict, now: float) -> None:
        from sdcwatch.core.columnar import encode_rows
        from sdcwatch.core.record import KEY_WINDOW

        a, n = self.a, len(ranks)
        sch = self.schemas[tuple(fps)]
        rows = np.zeros(n, sch.dtype)
        rows["step"] = step
        rows["rank"] = ranks
        rows["world"] = a.world
        rows["local_rank"] = ranks % 8
        rows["time"] = now
        rows["scalars"] = sc
        rows["fingerprints"] = list(fps.values())
        rows["layers"] = layers
        hosts_of = ranks // 8
        key = f"{RUN}/{step // KEY_WINDOW}".encode()
        futures = []
        for i in range(0, n, a.per_message):
            part = rows[i : i + a.per_message]
            h0 = int(hosts_of[i])
            part["host"] = hosts_of[i : i + a.per_message] - h0
            hosts = [f"node{h}" for h in range(h0, int(hosts_of[min(i + a.per_message, n) - 1]) + 1)]
            first = (key, sch.id) not in self.sent_keys
            self.sent_keys.add((key, sch.id))
            value = encode_rows(sch, RUN, hosts, part.tobytes(), len(part), with_schema=first)
            futures.append(self.producer.send(a.topic, key=key, value=value))
        self.producer.flush(timeout=30)
        failed = sum(1 for f in futures if not f.succeeded())
        if failed:
            raise RuntimeError(f"the broker did not confirm {failed} messages at step {step}")

    def close(self) -> None:
        self.producer.close()


def produce(argv: list[str]) -> int:
    """One producer process: ranks [lo, hi) of ``world``, ``steps`` steps at ``rate`` steps/s from
    the ``t0`` the parent writes to stdin; prints one JSON line of what it did."""
    ap = argparse.ArgumentParser()
    for name, typ in (
        ("--bootstrap", str),
        ("--topic", str),
        ("--world", int),
        ("--lo", int),
        ("--hi", int),
        ("--steps", int),
        ("--rate", float),
        ("--fault-every", int),
        ("--partitions", int),
        ("--wire", str),
        ("--per-message", int),
    ):
        ap.add_argument(name, type=typ, required=True)
    a = ap.parse_args(argv)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    sender = V2Sender(a) if a.wire == "v2" else V1Sender(a)
    print("ready", flush=True)
    t0 = float(sys.stdin.readline())  # the parent starts every producer's clock together
    rng = np.random.default_rng(a.lo)
    ranks = np.arange(a.lo, a.hi)
    fault_times: dict[int, list] = {}
    send_seconds = []
    behind = 0
    for step in range(a.steps):
        wait = t0 + step / a.rate - time.time()
        if wait > 0:
            time.sleep(wait)
        else:
            behind += 1
        now = time.time()
        sc, layers, fps = synthetic_step(rng, step, len(ranks), a.rate)
        bad = fault_rank(step, a.world) if a.fault_every and step and step % a.fault_every == 0 else -1
        if a.lo <= bad < a.hi:
            sc[bad - a.lo, SCALARS.index("loss")] = np.nan
            sc[bad - a.lo, SCALARS.index("nonfinite")] = 1.0
        if bad >= 0:  # every producer notes when it built this step: the step is whole only at the last one
            fault_times[step] = [now, a.lo <= bad < a.hi]
        t_send = time.perf_counter()
        sender.send(step, ranks, sc, layers, fps, now)
        send_seconds.append(time.perf_counter() - t_send)
    sender.close()
    print(
        json.dumps(
            {
                "lo": a.lo,
                "hi": a.hi,
                "steps": a.steps,
                "elapsed": time.time() - t0,
                "steps_behind_schedule": behind,
                "send_seconds_p50": float(np.median(send_seconds)),
                "fault_times": fault_times,
            }
        )
    )
    return 0


# -- one scale ------------------------------------------------------------------------------------


class LatencySink:
    """Notes when each non-finite incident opened (service wall clock), and every other incident."""

    def __init__(self) -> None:
        self.opened: dict[int, float] = {}
        self.other: list[str] = []

    def publish(self, event) -> None:
        inc = event.incident
        if event.change != "opened":
            return
        if inc.kind == "nonfinite":
            self.opened.setdefault(inc.first_step, time.time())
        else:
            self.other.append(f"{inc.kind} at step {inc.first_step}: {inc.message}")

    def close(self) -> None:
        pass


class ServicesUnderTest:
    """The detection service as ``sdcwatch serve`` builds it (the benchmark's sink only, no periodic
    snapshot): one instance, or with ``split`` a spatial one publishing step summaries and a
    temporal one reading them; both stepped in this process, the CPU time of each counted apart."""

    def __init__(self, bootstrap: str, topic: str, *, fault_every: int, split: bool, sink: LatencySink) -> None:
        import tempfile
        from dataclasses import replace

        from sdcwatch.telemetry.wire.transports import ensure_topic

        from sdcwatch.config import BusConfig, DetectorsConfig, MetricsConfig, ServeConfig, StateConfig
        from sdcwatch.serve import build_service

        # incidents resolve quickly, so each injected fault opens its own incident
        sum_topic = f"{topic}.summaries"
        cfg = ServeConfig(
            bus=BusConfig(
                bootstrap=bootstrap,
                telemetry_topic=topic,
                group=f"bench-{uuid.uuid4().hex[:8]}",
                summaries_topic=sum_topic,
            ),
            metrics=MetricsConfig(port=0),
            state=StateConfig(dir=Path(tempfile.mkdtemp(prefix="sdcwatch-bench-")), snapshot_interval_s=1e9),
            detectors=DetectorsConfig(align_timeout_s=10.0, resolve_after_steps=max(1, fault_every // 2)),
        )
        self.split = split
        self.cpu = {"spatial": 0.0, "temporal": 0.0}
        self.temporal = self.temporal_pipeline = None
        self.state_dirs = [cfg.state.dir]
        if split:
            ensure_topic(bootstrap, sum_topic, 1)
            spatial_cfg = replace(cfg, detectors=replace(cfg.detectors, stage="spatial"))
            self.service, _ = build_service(spatial_cfg, poll_timeout=0.05)
            temporal_dir = Path(tempfile.mkdtemp(prefix="sdcwatch-bench-"))
            self.state_dirs.append(temporal_dir)
            temporal_cfg = replace(
                cfg, detectors=replace(cfg.detectors, stage="temporal"), state=replace(cfg.state, dir=temporal_dir)
            )
            self.temporal, _ = build_service(temporal_cfg, sinks=[sink], poll_timeout=0.01)
            self.temporal_pipeline = self.temporal.pipeline
        else:
            self.service, _ = build_service(cfg, sinks=[sink], poll_timeout=0.05)
        self.source, self.pipeline = self.service.source, self.service.pipeline

    def step(self) -> None:
        """One poll of each instance, its CPU time counted."""
        c0 = time.process_time()
        self.service.step()
        c1 = time.process_time()
        self.cpu["spatial"] += c1 - c0
        if self.temporal is not None:
            self.temporal.step()
            self.cpu["temporal"] += time.process_time() - c1

    def join(self, timeout: float = 20.0) -> None:
        """Wait for the consumer-group joins, so that the first steps are not measured as lag; the
        CPU time counts from here."""
        deadline = time.monotonic() + timeout
        while (
            not self.source.assigned or (self.temporal is not None and not self.temporal.source.assigned)
        ) and time.monotonic() < deadline:
            self.step()
        self.cpu = {"spatial": 0.0, "temporal": 0.0}

    def steps_done(self) -> int:
        """Steps the (temporal) service has closed."""
        runs = (self.temporal or self.service).view().runs
        return runs[0].steps_total if runs else 0

    def sample(self, t: float) -> dict:
        """One lag sample at ``t`` seconds after the producers' start."""
        return {
            "t": round(t, 2),
            "lag": int(self.source.lag()),
            "steps": self.steps_done(),
            "records": self.pipeline.records_total,
            "spatial_cpu_s": round(self.cpu["spatial"], 3),
            "temporal_cpu_s": round(self.cpu["temporal"], 3),
            "summaries": self.temporal_pipeline.summaries_total if self.temporal_pipeline else None,
            "summaries_published": self.service.summary_sink.published if self.split else None,
        }

    def close(self) -> None:
        self.service.close()
        if self.temporal is not None:
            for _ in range(5):
                self.temporal.step()
            self.temporal.close()
        for d in self.state_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def counters(self) -> dict:
        """What the service dropped, waited for or saw twice."""
        source, aligner = self.source, self.pipeline.aligner
        return {
            "dead_letters": source.dead_letters,
            "incomplete_steps": aligner.incomplete_steps,
            "late_records": aligner.late_records,
            "duplicates": aligner.duplicates,
            "waiting_for_schema": source.ingest.pending,
            "offset_gaps": dict(source.gaps.counts),
        }


def start_producers(bootstrap: str, topic: str, world: int, slices: list[tuple[int, int]], **options) -> list:
    """One producer process a slice of ranks (``options``: steps, rate, fault_every, partitions,
    wire, per_message); returns once every one is connected, their clocks not yet started."""
    procs = []
    for lo, hi in slices:
        cmd = [sys.executable, __file__, "--produce", "--bootstrap", bootstrap, "--topic", topic, "--world", str(world)]
        cmd += ["--lo", str(lo), "--hi", str(hi)]
        for name, value in options.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        procs.append(
            subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        )
    for p in procs:  # wait until every producer is connected
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"producer did not start: {line!r} {p.stderr.read()[-2000:]}")
    return procs


def start_clocks(procs: list) -> float:
    """Start every producer's clock together, half a second from now; returns that start time."""
    t0 = time.time() + 0.5
    for p in procs:
        p.stdin.write(f"{t0!r}\n")
        p.stdin.flush()
    return t0


def measure(services: ServicesUnderTest, procs: list, t0: float, steps: int, world: int) -> tuple[list, float, float]:
    """Step the services while the producers run, sampling the lag every 0.5 s, then until every
    step is closed (or a drain deadline passes). Returns (samples, when the producers ended, when
    the drain ended)."""
    samples = []
    next_sample = time.time()
    producing_end = None
    drain_deadline = None
    while True:
        services.step()
        now = time.time()
        if now >= next_sample:
            next_sample = now + 0.5
            samples.append(services.sample(now - t0))
        if producing_end is None and all(p.poll() is not None for p in procs):
            producing_end = now
            sample = services.sample(now - t0)
            samples.append({k: sample[k] for k in ("t", "lag", "steps", "records")} | {"producers_done": True})
            drain_deadline = now + max(30.0, 5 * world / 5000)
        if producing_end is not None and (services.steps_done() >= steps or now > drain_deadline):
            break
    return samples, producing_end, time.time()


def producer_stats(procs: list) -> list[dict]:
    """What each producer process reported on exit (its last line)."""
    stats = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"producer failed ({p.returncode}): {err.strip()[-2000:]}")
        stats.append(json.loads(out.strip().splitlines()[-1]))
    return stats


def fault_latencies(stats: list[dict], opened: dict[int, float]) -> tuple[dict[int, float], list[float], list[float]]:
    """(each fault step's faulty-record build time, emit-to-incident latencies, latencies from when
    the last producer built the fault step), the latencies sorted; a fault without incident has none."""
    fault_times: dict[int, float] = {}  # the faulty record's build time
    step_built: dict[int, float] = {}  # when the last producer built the fault step
    for st in stats:
        for s, (t, owner) in st["fault_times"].items():
            s = int(s)
            if owner:
                fault_times[s] = t
            step_built[s] = max(step_built.get(s, 0.0), t)
    latencies = sorted(opened[s] - t for s, t in fault_times.items() if s in opened)
    from_whole = sorted(opened[s] - step_built[s] for s in fault_times if s in opened)
    return fault_times, latencies, from_whole


def processed_rate(samples: list[dict], producing_end: float, t0: float) -> float | None:
    """The service's rate while producing: from the sample taken when the first step closed to the
    first sample that shows the most steps closed before the producers ended (not to their exit:
    the producer processes' shutdown is not the service's time)."""
    during = [s for s in samples if s["t"] <= producing_end - t0 + 1e-6]
    first = next((s for s in during if s["steps"] > 0), None)
    most = max((s["steps"] for s in during), default=0)
    last = next((s for s in during if s["steps"] == most), None)
    if first is not None and last is not None and last["t"] > first["t"]:
        return (last["steps"] - first["steps"]) / (last["t"] - first["t"])
    return None


def producer_slices(world: int, producers: int) -> list[tuple[int, int]]:
    """The ranks [lo, hi) of each producer process: ``world`` cut into ``producers`` even slices."""
    per = -(-world // producers)
    return [(p * per, min(world, (p + 1) * per)) for p in range(producers) if p * per < world]


def cpu_result(services: ServicesUnderTest, spatial_steps: float) -> dict:
    """Steps per CPU second of each instance (the temporal one's in summaries), and its CPU time."""
    spatial_cpu, temporal_cpu = services.cpu["spatial"], services.cpu["temporal"]
    temporal_pipeline = services.temporal_pipeline
    return {
        "spatial_steps_per_cpu_s": spatial_steps / spatial_cpu if spatial_cpu > 0 else None,
        "spatial_cpu_s": round(spatial_cpu, 2),
        "temporal_steps_per_cpu_s": (
            temporal_pipeline.summaries_total / temporal_cpu
            if temporal_pipeline is not None and temporal_cpu > 0
            else None
        ),
        "temporal_cpu_s": round(temporal_cpu, 2),
    }


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def latency_result(sink: LatencySink, stats: list[dict]) -> dict:
    """The faults injected and found, and the emit-to-incident latencies."""
    opened = sink.opened
    fault_times, latencies, from_whole = fault_latencies(stats, opened)
    return {
        "faults_injected": len(fault_times),
        "faults_detected": len(latencies),
        "latency_s": {
            "p50": _percentile(latencies, 50),
            "p99": _percentile(latencies, 99),
            "max": latencies[-1] if latencies else None,
        },
        "latency_from_whole_step_s": {"p50": _percentile(from_whole, 50), "p99": _percentile(from_whole, 99)},
        "fault_latencies": [
            {"step": s, "latency_s": opened[s] - t if s in opened else None} for s, t in sorted(fault_times.items())
        ],
        "other_incidents": sink.other[:20],
        "other_incidents_total": len(sink.other),
    }


def lag_result(samples: list[dict], messages_per_step: int) -> dict:
    """The consumer lag: its most, and when the producers stopped (bounded: at most 3 steps' worth)."""
    lag_at_stop = next((s["lag"] for s in samples if s.get("producers_done")), None)
    return {
        "messages_per_step": messages_per_step,
        "lag_max": max((s["lag"] for s in samples), default=None),
        "lag_at_producers_done": lag_at_stop,
        "lag_at_producers_done_steps": None if lag_at_stop is None else lag_at_stop / messages_per_step,
        "bounded_lag": lag_at_stop is not None and lag_at_stop <= 3 * messages_per_step,
    }


def run_scale(
    bootstrap: str,
    world: int,
    *,
    rate: float,
    duration: float,
    producers: int,
    fault_every: int,
    partitions: int = 4,
    wire: str = "v2",
    per_message: int = 2048,
    split: bool = False,
    log=print,
) -> dict:
    """Run the producers and the service for one world size; returns the measurements."""
    from sdcwatch.telemetry.wire.transports import ensure_topic

    topic = f"bench.e2e.{world}.{uuid.uuid4().hex[:6]}"
    ensure_topic(bootstrap, topic, partitions)
    steps = max(2, int(round(duration * rate)))
    sink = LatencySink()
    services = ServicesUnderTest(bootstrap, topic, fault_every=fault_every, split=split, sink=sink)
    services.join()
    slices = producer_slices(world, producers)
    # v1: KafkaTransport packs up to 256 records of one step window a message; lag counts messages
    per_msg = per_message if wire == "v2" else 256
    messages_per_step = sum(-(-(hi - lo) // per_msg) for lo, hi in slices)
    procs = start_producers(
        bootstrap,
        topic,
        world,
        slices,
        steps=steps,
        rate=rate,
        fault_every=fault_every,
        partitions=partitions,
        wire=wire,
        per_message=per_message,
    )
    t0 = start_clocks(procs)
    log(
        f"e2e: {world} ranks, {len(procs)} producer processes, {steps} steps at {rate:g} steps/s, wire {wire}"
        f"{', split (one spatial, one temporal instance)' if split else ''}"
    )
    samples, producing_end, drain_end = measure(services, procs, t0, steps, world)
    spatial_steps = services.pipeline.view().pipeline.records_total / world  # records read, in steps
    services.pipeline.flush()
    stats = producer_stats(procs)
    services.close()
    done = services.steps_done()
    produce_seconds = max(st["elapsed"] for st in stats)
    return {
        "ranks": world,
        "wire": wire,
        "split": split,
        "records_per_message": per_msg,
        **cpu_result(services, spatial_steps),
        "load_1min_at_end": os.getloadavg()[0],
        "service_counters": services.counters(),
        "producers": len(procs),
        "target_rate_steps_per_s": rate,
        "steps": steps,
        "records": steps * world,
        "produced_steps_per_s": steps / produce_seconds,
        "producers_behind_schedule_steps": max(st["steps_behind_schedule"] for st in stats),
        "producer_send_seconds_p50": max(st["send_seconds_p50"] for st in stats),
        "processed_steps_per_s": processed_rate(samples, producing_end, t0),
        "steps_processed": done,
        "drain_seconds_after_producers": round(drain_end - producing_end, 2),
        "overall_steps_per_s": done / max(drain_end - t0, 1e-9),
        **lag_result(samples, messages_per_step),
        **latency_result(sink, stats),
        "lag_samples": samples,
    }


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--produce"]:
        raise SystemExit(produce(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="world sizes (default 1024 16384)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of producing per world size (default 60)")
    ap.add_argument(
        "--rate", type=float, default=None, help="steps/s the producers aim for (default 5 at <= 1,024 ranks, 1 above)"
    )
    ap.add_argument("--producers", type=int, default=None, help="producer processes (default 2, 4 above 4,096 ranks)")
    ap.add_argument("--fault-every", type=int, default=8, help="a NaN on one rank every this many steps")
    ap.add_argument("--wire", choices=("v2", "v1"), default="v2", help="wire format of the producers (default v2)")
    ap.add_argument("--per-message", type=int, default=2048, help="v2: simulated ranks a message (default 2048)")
    ap.add_argument(
        "--split",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run one spatial and one temporal instance (default: above 16,384 ranks)",
    )
    ap.add_argument("--bootstrap", default=None, help="use this broker instead of starting an embedded one")
    ap.add_argument("--quick", action="store_true", help="CI size: 256 ranks, 10 s")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    ranks = args.ranks or ([256] if args.quick else [1024, 16384])
    duration = args.duration or (10.0 if args.quick else 60.0)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def measure(bootstrap: str) -> list[dict]:
        out = []
        for world in ranks:
            rate = args.rate or (5.0 if world <= 16384 else 1.0)
            producers = args.producers or (2 if world <= 4096 else 4)
            split = args.split if args.split is not None else world > 16384
            r = run_scale(
                bootstrap,
                world,
                rate=rate,
                duration=duration,
                producers=producers,
                fault_every=args.fault_every,
                wire=args.wire,
                per_message=args.per_message,
                split=split,
                log=log,
            )
            log(
                f"e2e: {world} ranks: produced {r['produced_steps_per_s']:.2f} steps/s, processed "
                f"{(r['processed_steps_per_s'] or 0):.2f} steps/s, lag at stop {r['lag_at_producers_done']}, "
                f"faults {r['faults_detected']}/{r['faults_injected']}, p99 {r['latency_s']['p99']}; spatial "
                f"{r['spatial_steps_per_cpu_s'] or 0:.2f} steps per CPU second"
            )
            out.append(r)
        return out

    if args.bootstrap:
        scales = measure(args.bootstrap)
    else:
        from sdcwatch.broker import EmbeddedBroker

        with EmbeddedBroker(port=0) as broker:
            scales = measure(broker.bootstrap)
    result = {
        "benchmark": "e2e",
        "machine": f"{os.cpu_count()} cores",
        "command": "bench/bench_e2e.py " + " ".join(argv),
        "scales": scales,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    res = main()
    print(
        json.dumps(
            {k: v for k, v in res.items() if k != "scales"}
            | {"scales": [{k: v for k, v in s.items() if k != "lag_samples"} for s in res["scales"]]},
            indent=2,
        )
    )
