"""A flood of junk runs against one real `sdcwatch serve`: how late a real NaN, how slow a scrape, how much memory.

One `sdcwatch serve` (its own topics, group, state folder and metrics port) on the embedded broker
watches a real ``--world``-rank run (4) emitting at ``--rate`` steps/s with the Emitter. After
``WARM_S`` seconds an attacker process (kafka-python, one record a message) sends ``--records``
records for ``--runs`` run names over ``--seconds`` seconds (each run: steps 0.. of a 4-rank job,
step-major so every junk run is live through the flood); ``--nan-after`` seconds into the flood (1)
rank 2 of the real run reports a NaN. Measured per arm: the seconds from the NaN's emit() to its
incident on the anomalies topic (and its step and rank), the longest and p99 /metrics scrape (one
scraper, every 0.5 s) during and after the flood, the service's CPU (and its detection loop's), peak
RSS (VmHWM) and RSS at the end, the runs it still holds ``--after`` seconds after the flood
(``sdcwatch_pipeline_runs``) with the settings that say how long they stay; whether the consumer was thrown out of its group (offset
commits failed or partitions lost, in serve's log; the fewest partitions a scrape showed); and, once
the run has stopped and the service caught up, the records consumed and dead-lettered against those
sent (more: re-reads), by reason, and the real run's dead letters. Arms: ``open`` (no keys: the
attack as found), ``signed`` (``--auth-key-file``, the real run signs, the junk does not) and
``tenant`` (keys on, the junk signed with another tenant's valid key, each junk rank with a start of
its own, so all of it is verified and reaches the detectors: issue 36's signed flood)::

    .venv/bin/python bench/bench_flood.py [--records 200000] [--runs 500] [--seconds 5] [--world 4]
        [--nan-after 1] [--arms open signed tenant] [--json] [--out F]

``--queued``: a flood read *ahead of* a real run instead (``--runs`` one-rank junk runs x
``--junk-steps`` steps, a message a record, all on the topic before the run starts), then an 8-rank
run at ``--rate`` with a NaN at step 30 on rank 5; measured: the seconds from the run's start and
from the NaN's emit to its incident, and the dead letters. One arm per ``--serve-python`` (an
interpreter with sdcwatch installed, run outside the checkout; the current one if none), side by
side on one broker: give the previous release's and this one's to compare them::

    .venv/bin/python bench/bench_flood.py --queued --runs 1000 --junk-steps 40 --serve-python OLD_PY NEW_PY
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from sdcwatch.broker import EmbeddedBroker, free_port
from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.messages import decode_message
from sdcwatch.core.record import record_key
from sdcwatch.core.signing import JobKey, Keyring, is_signed
from sdcwatch.service.pipeline import PipelineSettings
from sdcwatch.telemetry import Emitter, KafkaTransport, Record, encode

WORLD, NAN_RANK = 4, 2
WARM_S = 4.0  # the real run trains alone this long (past probation) before the flood
KEY = "bench:" + "k" * 32
DEAD = "sdcwatch_pipeline_dead_letters_total"
TENANT_KEY = "tenant:" + "t" * 32  # another tenant's valid key (the ``tenant`` arm's junk signs with it)


# ---------------------------------------------------------------------------------------------
# the attacker, in a process of its own (its sending must not share the GIL with the measuring)


def _attacker(
    bootstrap: str, topic: str, records: int, runs: int, seconds: float, go, done, world=WORLD, key=None
) -> None:
    """Sends ``records`` junk records, one a message; signed with job key text ``key`` when given, each
    junk rank with a start of its own (as a job's processes do: every message is then taken)."""
    from kafka import KafkaProducer

    signers = {}
    steps = math.ceil(records / (runs * world))
    msgs = []
    for step in range(steps):  # step-major: every junk run is live for the whole flood
        for i in range(runs):
            for rank in range(world):
                if len(msgs) < records:
                    rec = Record(f"junk-{i}", step, rank, world, "evil", time.time(), 0, {"loss": 1.0}, {}, {})
                    value = encode(rec)
                    if key:
                        value = signers.setdefault((i, rank), JobKey.parse(key)).sign(value)
                    msgs.append((record_key(rec), value))
    producer = KafkaProducer(bootstrap_servers=[bootstrap], linger_ms=5, batch_size=1 << 20, acks=1)
    producer.partitions_for(topic)  # metadata before the clock starts
    go.wait()
    t0 = time.monotonic()
    slices = max(1, int(seconds * 20))
    for s in range(slices):  # an even rate: 1/20 s of records at a time
        for key, value in msgs[s * len(msgs) // slices : (s + 1) * len(msgs) // slices]:
            producer.send(topic, key=key, value=value)
        time.sleep(max(0.0, t0 + (s + 1) * seconds / slices - time.monotonic()))
    producer.flush(120)
    done.put((len(msgs), time.monotonic() - t0))
    producer.close()


# ---------------------------------------------------------------------------------------------
# the service and what is read from it


def _serve(
    bootstrap: str, tag: str, state: Path, port: int, key_file: Path | None, python: str = sys.executable
) -> subprocess.Popen:
    cmd = [python, "-m", "sdcwatch.cli", "serve", "--bus-bootstrap", bootstrap]
    cmd += ["--bus-telemetry-topic", f"tel.{tag}", "--bus-anomalies-topic", f"anom.{tag}"]
    cmd += ["--bus-deadletter-topic", f"dead.{tag}", "--bus-group", f"g.{tag}", "--metrics-port", str(port)]
    cmd += ["--state-dir", str(state), "--no-alerts-log"]
    cmd += ["--auth-key-file", str(key_file)] if key_file else []
    # from the state folder's parent: an interpreter given imports its own install, not the checkout
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=state.parent)


def _serve_and_attacker(
    bootstrap: str, tag: str, workdir: Path, key_file: Path | None, python: str, attack: tuple
) -> tuple[subprocess.Popen, int, list[str], Any, Any, Any]:
    """A fresh service (topics named by ``tag``) that is consuming, and an attacker process that sends
    ``attack`` (records, runs, seconds[, world, key] of :func:`_attacker`) once ``go`` is set:
    (serve, its metrics port, its log lines, go, done, attacker)."""
    port = free_port()
    serve = _serve(bootstrap, tag, workdir / tag, port, key_file, python)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(serve.stderr.readline, "")), daemon=True).start()
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Queue()
    records, runs, seconds, *rest = attack
    attacker = ctx.Process(target=_attacker, args=(bootstrap, f"tel.{tag}", records, runs, seconds, go, done, *rest))
    attacker.start()
    deadline = time.monotonic() + 90
    while not any("consuming" in ln for ln in lines):
        if time.monotonic() > deadline or serve.poll() is not None:
            raise RuntimeError("serve did not start: " + "".join(lines)[-2000:])
        time.sleep(0.1)
    return serve, port, lines, go, done, attacker


def _proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _cpu_s(pid: int, main_thread: bool = False) -> float:
    """CPU seconds (user + system) the process has used (its main thread's only: serve's detection loop)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat").read_text()
    fields = fields.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sample(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else math.nan


def _labelled(text: str, name: str) -> dict[str, float]:
    """The samples of ``name`` by their labels (``key="k",reason="r"`` -> ``k,r``)."""
    found = re.findall(rf"^{name}{{(.*)}} (\S+)$", text, re.M)
    return {",".join(re.findall(r'="([^"]*)"', labels)): float(v) for labels, v in found}


class _Scraper:
    """GET /metrics every ``every`` seconds (one at a time): (start, seconds, text) of each."""

    def __init__(self, url: str, every: float = 0.5) -> None:
        self.url, self.every, self.got = url, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=60) as resp:
                    text = resp.read().decode()
            except OSError:
                text = ""
            self.got.append((t, time.monotonic() - t, text))
            self._stop.wait(max(0.0, self.every - (time.monotonic() - t)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(90)


class _Incidents:
    """The anomalies topic read as it is written: (time seen, event) of each incident change."""

    def __init__(self, bootstrap: str, topic: str, key: JobKey | None = None) -> None:
        from kafka import KafkaConsumer

        self.key = key  # the service's key for the topic when it has keys: it signs each message
        self.events: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._consumer = KafkaConsumer(
            topic, bootstrap_servers=[bootstrap], auto_offset_reset="earliest", group_id=None, fetch_max_wait_ms=50
        )
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for msgs in self._consumer.poll(100).values():
                now = time.monotonic()
                self.events += [(now, json.loads(self.key.open(m.value) if self.key else m.value)) for m in msgs]

    def first(self, kind: str, run: str) -> tuple[float, dict] | None:
        return next(((t, e) for t, e in list(self.events) if e["kind"] == kind and e["run"] == run), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


def _train(
    emitters: list, rate: float, nan_at: threading.Event, stop: threading.Event, out: dict, nan_rank: int = NAN_RANK
) -> None:
    """The real run: a step every 1/rate s; the first step after ``nan_at`` is set has ``nan_rank``'s NaN."""
    step = 0
    while not stop.is_set():
        t = time.monotonic()
        nan = nan_at.is_set() and "nan_step" not in out
        for em in emitters:
            loss = math.nan if nan and em.rank == nan_rank else 2.0 + 0.01 * ((step * 7 + em.rank) % 5)
            em.emit(step, loss=loss, grad_norm_local=1.0 + 0.01 * em.rank, grad_norm_global=1.0)
        if nan:
            out["nan_step"], out["nan_sent"] = step, time.monotonic()
        step += 1
        time.sleep(max(0.0, 1 / rate - (time.monotonic() - t)))
    out["last_step"] = step - 1


def _caught_up(url: str, timeout: float = 120.0) -> str:
    """/metrics once the service has no lag and its records count held still for a second (or at ``timeout``)."""
    deadline, before = time.monotonic() + timeout, None
    while True:
        with urllib.request.urlopen(url, timeout=60) as resp:
            text = resp.read().decode()
        now = (_sample(text, "sdcwatch_pipeline_records_total"), _sample(text, DEAD))
        if (
            now == before and _sample(text, "sdcwatch_pipeline_consumer_lag_records") == 0
        ) or time.monotonic() > deadline:
            return text
        before = now
        time.sleep(1.0)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.nan


def _scrape_stats(scrapes: list, lo: float, hi: float) -> dict:
    secs = [s for t, s, _ in scrapes if lo <= t < hi]
    return {"n": len(secs), "max_s": round(max(secs, default=math.nan), 3), "p99_s": round(_quantile(secs, 0.99), 3)}


# ---------------------------------------------------------------------------------------------
# one arm


def flood(bootstrap: str, arm: tuple[str, str], args: argparse.Namespace, workdir: Path) -> dict:
    """One flood against a fresh service (``arm``: open, signed or tenant, and the interpreter that
    serves); what it measured."""
    arm, python = arm
    tag = uuid.uuid4().hex[:8]
    key_file = None
    if arm != "open":
        key_file = workdir / f"{tag}.keys"
        key_file.write_text(KEY + "\n" + (TENANT_KEY + "\n" if arm == "tenant" else ""))
        key_file.chmod(0o600)
    attack = (args.records, args.runs, args.seconds, WORLD, TENANT_KEY if arm == "tenant" else None)
    serve, port, lines, go, done, attacker = _serve_and_attacker(bootstrap, tag, workdir, key_file, python, attack)
    rss_start = _proc_kib(serve.pid, "VmRSS")
    keyring = Keyring.from_file(key_file) if key_file else None
    emitters = [  # each rank its own key object, as each rank process has
        Emitter(
            KafkaTransport(bootstrap, f"tel.{tag}"),
            run="victim",
            rank=r,
            world=args.world,
            host=f"h{r // 2}",
            key=JobKey.parse(KEY) if key_file else None,
        )
        for r in range(args.world)
    ]
    service_key = keyring.service_key("anomalies") if keyring else None
    incidents = _Incidents(bootstrap, f"anom.{tag}", service_key)
    scraper = _Scraper(f"http://127.0.0.1:{port}/metrics")
    nan_at, stop, trained = threading.Event(), threading.Event(), {}
    trainer = threading.Thread(target=_train, args=(emitters, args.rate, nan_at, stop, trained), daemon=True)
    trainer.start()
    time.sleep(WARM_S)
    rss_before, cpu_before, loop_before = _proc_kib(serve.pid, "VmRSS"), _cpu_s(serve.pid), _cpu_s(serve.pid, True)
    flood_start = time.monotonic()
    go.set()
    time.sleep(args.nan_after)
    nan_at.set()
    sent, send_s = done.get(timeout=300)
    flood_end = flood_start + send_s
    attacker.join(30)
    found = None
    while found is None and time.monotonic() < flood_end + 120:
        found = incidents.first("nonfinite", "victim")
        time.sleep(0.05)
    time.sleep(max(0.0, flood_end + args.after - time.monotonic()))  # the service's state a while after
    stop.set()
    trainer.join(10)
    scraper.stop()
    incidents.stop()
    rss_end, peak = _proc_kib(serve.pid, "VmRSS"), _proc_kib(serve.pid, "VmHWM")
    cpu, loop_cpu = _cpu_s(serve.pid) - cpu_before, _cpu_s(serve.pid, True) - loop_before
    last = next((text for _, _, text in reversed(scraper.got) if text), "")
    for em in emitters:
        em.flush(10)
    try:
        settled = _caught_up(f"http://127.0.0.1:{port}/metrics")
    except OSError as exc:  # the service is gone: say how it ended rather than lose the arm
        raise RuntimeError(f"serve ended ({serve.poll()}): {exc}; its log ends:\n" + "".join(lines[-30:])) from None
    serve.terminate()
    serve.wait(60)
    for em in emitters:
        em.close(5)
    settings = PipelineSettings()
    ev = found[1] if found else {}
    run_records = (trained["last_step"] + 1) * args.world
    consumed, dead = _sample(settled, "sdcwatch_pipeline_records_total"), _sample(settled, DEAD)
    partitions = [_sample(text, "sdcwatch_pipeline_consumer_partitions") for _, _, text in scraper.got if text]
    partitions = partitions[next((i for i, n in enumerate(partitions) if n > 0), len(partitions)) :]  # once joined
    return {
        "arm": arm,
        "serve_python": python,
        "world": args.world,
        "records_sent": sent,
        "send_s": round(send_s, 2),
        "nan_step": trained.get("nan_step"),
        "incident_delay_s": round(found[0] - trained["nan_sent"], 2) if found else None,
        "incident_step": ev.get("first_step"),
        "incident_ranks": ev.get("ranks"),
        "incident_right": bool(found) and ev.get("first_step") == trained.get("nan_step") and ev.get("ranks") == [2],
        "scrape_during": _scrape_stats(scraper.got, flood_start, flood_end),
        "scrape_after": _scrape_stats(scraper.got, flood_end, math.inf),
        "scrape_all": _scrape_stats(scraper.got, flood_start, math.inf),
        "service_cpu_s": round(cpu, 1),
        "loop_cpu_s": round(loop_cpu, 1),  # of which the detection loop's (the rest: the reader, scrapes, clients)
        "rss_start_mib": round(rss_start / 1024, 1),
        "rss_before_flood_mib": round(rss_before / 1024, 1),
        "rss_peak_mib": round(peak / 1024, 1),
        "rss_end_mib": round(rss_end / 1024, 1),
        "runs_held_after": _sample(last, "sdcwatch_pipeline_runs"),
        "after_s": args.after,
        # thrown out of its group: commits refused (CommitFailedError), partitions lost, a scrape without any
        "commit_failures": sum("offset commit failed" in ln for ln in lines),
        "partitions_lost": sum("lost its partitions" in ln for ln in lines),
        "fewest_partitions": min(partitions, default=math.nan),
        # once the run stopped and the service caught up: taken (consumed or dead-lettered) minus sent
        "run_records_sent": run_records,
        "records_consumed": consumed,
        "dead_letters": dead,
        "records_reread": consumed + dead - sent - run_records,
        "duplicates": _sample(settled, "sdcwatch_pipeline_duplicates_total"),
        "dead_letter_reasons": _labelled(settled, "sdcwatch_pipeline_dead_letters_by_reason_total"),
        "auth_refused": _labelled(settled, "sdcwatch_auth_runs_refused_total"),
        "run_dead_letters": _dead_letters_of(bootstrap, f"dead.{tag}", "victim", keyring),
        "run_log": [ln.strip()[:400] for ln in lines if "'victim'" in ln][:5],  # serve's lines naming it
        "run_probation_idle_s": settings.run_probation_idle_s,
        "run_idle_expiry_s": settings.run_idle_expiry_s,
        "max_runs": settings.max_runs,
    }


def _dead_letters_of(bootstrap: str, topic: str, run: str, keyring: Keyring | None = None) -> dict[str, int]:
    """The records of ``run`` on the dead-letter topic, by reason (read whole from its start; signed
    ones opened with ``keyring``)."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=[bootstrap], auto_offset_reset="earliest", group_id=None)
    out: dict[str, int] = {}
    idle = 0
    while idle < 3:
        batches = consumer.poll(1000)
        idle = 0 if batches else idle + 1
        for m in (m for msgs in batches.values() for m in msgs):
            reason = dict(m.headers).get("sdcwatch.reason_code", b"?").decode()
            try:
                value = keyring.verify(m.value)[1] if keyring and is_signed(m.value) else m.value
                n = sum(r.run == run for r in decode_message(value, RecordLimits()) if hasattr(r, "run"))
            except Exception:  # a dead letter that is not a record (the reason says why)
                n = 0
            if n:
                out[reason] = out.get(reason, 0) + n
    consumer.close()
    return out


def queued(bootstrap: str, python: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Junk runs read ahead of a real 8-rank run by a fresh service of ``python``: how late its NaN."""
    tag, world, nan_rank, nan_step = uuid.uuid4().hex[:8], 8, 5, 30
    attack = (args.runs * args.junk_steps, args.runs, 1.0, 1)
    serve, port, _, go, done, attacker = _serve_and_attacker(bootstrap, tag, workdir, None, python, attack)
    go.set()
    sent, _ = done.get(timeout=300)  # every junk record is on the topic before the run starts
    attacker.join(30)
    emitters = [
        Emitter(KafkaTransport(bootstrap, f"tel.{tag}"), run="victim", rank=r, world=world, host=f"h{r // 4}")
        for r in range(world)
    ]
    incidents = _Incidents(bootstrap, f"anom.{tag}")
    scraper = _Scraper(f"http://127.0.0.1:{port}/metrics", every=1.0)
    nan_at, stop, trained = threading.Event(), threading.Event(), {}
    started = time.monotonic()
    threading.Timer(nan_step / args.rate, nan_at.set).start()
    trainer = threading.Thread(target=_train, args=(emitters, args.rate, nan_at, stop, trained, nan_rank), daemon=True)
    trainer.start()
    found = None
    while found is None and time.monotonic() < started + args.wait:
        found = incidents.first("nonfinite", "victim")
        time.sleep(0.05)
    stop.set()
    trainer.join(10)
    scraper.stop()
    incidents.stop()
    last = next((text for _, _, text in reversed(scraper.got) if text), "")
    serve.terminate()
    serve.wait(60)
    for em in emitters:
        em.close(5)
    ev = found[1] if found else {}
    return {
        "serve_python": python,
        "run_dead_letters": _dead_letters_of(bootstrap, f"dead.{tag}", "victim"),
        "junk_records": sent,
        "junk_runs": args.runs,
        "nan_step": trained.get("nan_step"),
        "found_after_start_s": round(found[0] - started, 1) if found else None,
        "incident_delay_s": round(found[0] - trained["nan_sent"], 1) if found else None,
        "incident_right": bool(found) and ev.get("first_step") == trained.get("nan_step") and ev.get("ranks") == [5],
        "records_consumed": _sample(last, "sdcwatch_pipeline_records_total"),
        "dead_letters": _sample(last, "sdcwatch_pipeline_dead_letters_total"),
    }


def _table(rows: list[dict]) -> str:
    head = "arm     sent in  NaN delay  step,rank ok  scrape max/p99 during  after        RSS start/peak/end MiB  runs held"
    out = [head]
    for r in rows:
        d, a = r["scrape_during"], r["scrape_after"]
        out.append(
            f"{r['arm']:<7} {r['send_s']:>5.1f}s  {r['incident_delay_s']!s:>8}s  {r['incident_right']!s:<12} "
            f"{d['max_s']:>5.2f}/{d['p99_s']:<5.2f}s  {a['max_s']:>5.2f}/{a['p99_s']:<5.2f}s  "
            f"{r['rss_before_flood_mib']:>6.0f}/{r['rss_peak_mib']:.0f}/{r['rss_end_mib']:.0f}"
            f"{'':>10}{r['runs_held_after']:.0f} after {r['after_s']:.0f} s"
        )
        out.append(
            f"{'':<8}group: {r['commit_failures']} commits failed, partitions lost {r['partitions_lost']} times "
            f"(fewest {r['fewest_partitions']:.0f}); records consumed {r['records_consumed']:.0f} + dead-lettered "
            f"{r['dead_letters']:.0f} of {r['records_sent'] + r['run_records_sent']} sent: "
            f"{r['records_reread']:.0f} read again"
        )
    s = rows[0]
    out.append(
        f"settings: max_runs {s['max_runs']}, run_probation_idle_s {s['run_probation_idle_s']:g}, "
        f"run_idle_expiry_s {s['run_idle_expiry_s']:g} ({s['run_idle_expiry_s'] / 3600:g} h)"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000, help="junk records in the flood")
    ap.add_argument("--runs", type=int, default=500, help="junk run names")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds over which the junk is sent")
    ap.add_argument("--rate", type=float, default=10.0, help="steps a second of the real run")
    ap.add_argument("--after", type=float, default=60.0, help="seconds after the flood at which the runs are counted")
    ap.add_argument("--arms", nargs="+", default=["open", "signed"], choices=["open", "signed", "tenant"])
    ap.add_argument("--world", type=int, default=WORLD, help="ranks of the real run")
    ap.add_argument("--nan-after", type=float, default=1.0, help="seconds into the flood at which the NaN comes")
    ap.add_argument("--queued", action="store_true", help="the flood read ahead of the real run (see above)")
    ap.add_argument("--junk-steps", type=int, default=40, help="--queued: steps of each one-rank junk run")
    ap.add_argument(
        "--serve-python", nargs="+", default=[sys.executable], help="one arm per interpreter (each --arms arm)"
    )
    ap.add_argument("--wait", type=float, default=300.0, help="--queued: seconds to wait for the NaN's incident")
    ap.add_argument("--json", action="store_true", help="print each arm as one JSON line, not the table")
    ap.add_argument("--out", type=Path, help="write the results as JSON here (bench/results/flood.json)")
    args = ap.parse_args(argv)
    rows = []
    load = os.getloadavg()
    with EmbeddedBroker(port=0) as broker, tempfile.TemporaryDirectory() as tmp:
        if args.queued:
            arms = [(queued, py) for py in args.serve_python]
        else:  # each arm served by each interpreter in turn, side by side
            arms = [(flood, (arm, py)) for arm in args.arms for py in args.serve_python]
        for measure, arm in arms:
            row = measure(broker.bootstrap, arm, args, Path(tmp))
            rows.append(row)
            if args.json or args.queued:
                print(json.dumps(row), flush=True)
    if not args.json and not args.queued:
        print(_table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg_at_start": [round(x, 2) for x in load],
            "command": " ".join(["bench/bench_flood.py", *(argv if argv is not None else sys.argv[1:])]),
            "arms": rows,
        }
        args.out.write_text(json.dumps(out, indent=1))
    return 0 if all(r["incident_right"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
