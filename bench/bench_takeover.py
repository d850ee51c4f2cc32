"""Takeover after a SIGKILL: a successor with an EMPTY state folder, with and without the state topic.

Instance A (`sdcwatch serve`, state folder X) watches a 4-rank run for 70 steps (past the spike
detector's 59-step warm-up) and snapshots every second; it is SIGKILLed while the run goes on at
``--rate`` steps/s, with a x3 loss spike at step 110. Instance B starts at once in the same group
with an empty folder Y (another machine): with ``--state-topic`` (mode ``changelog``) it loads A's
last snapshot from the compacted topic; without (mode ``cold``) it starts afresh from the group's
committed offsets. Reported per mode: seconds from B's start to its banner and to its first
processed record, the history it resumed (records), and the step at which it opened the spike's
incident (None: missed)::

    .venv/bin/python bench/bench_takeover.py --trials 3 --out bench/results/takeover.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from sdcwatch.broker import EmbeddedBroker, free_port
from sdcwatch.service.changelog import StateChangelog
from sdcwatch.telemetry import Emitter, KafkaTransport

WARM_STEPS, SPIKE_STEP, LAST_STEP, WORLD = 70, 110, 160, 4


def _serve(bootstrap: str, tag: str, state: Path, port: int, state_topic: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sdcwatch.cli", "serve", "--bus-bootstrap", bootstrap]
    cmd += ["--bus-telemetry-topic", f"tel.{tag}", "--bus-anomalies-topic", f"anom.{tag}"]
    cmd += ["--bus-deadletter-topic", f"dead.{tag}", "--bus-group", f"g.{tag}", "--metrics-port", str(port)]
    cmd += ["--state-dir", str(state), "--state-snapshot-interval-s", "1", "--no-alerts-log"]
    cmd += ["--state-topic", state_topic] if state_topic else []
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _lines(proc: subprocess.Popen) -> list[tuple[float, str]]:
    """The process's stderr lines with the time each came, collected in the background."""
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in iter(proc.stderr.readline, ""):
            lines.append((time.monotonic(), line))

    threading.Thread(target=read, daemon=True).start()
    return lines


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(what)


def _records(port: int) -> float | None:
    """sdcwatch_pipeline_records_total on the instance's /metrics, None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    m = re.search(r"^sdcwatch_pipeline_records_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _train(emitters: list, steps: range, rate: float) -> None:
    for step in steps:
        t = time.monotonic()
        for em in emitters:
            loss = 2.0 + 0.01 * ((step * 7 + em.rank) % 5)
            em.emit(step, loss=loss * (3 if step == SPIKE_STEP else 1), grad_norm_local=1.0, grad_norm_global=1.0)
        if rate:
            time.sleep(max(0.0, 1 / rate - (time.monotonic() - t)))
    for em in emitters:
        em.flush(60)


def _committed(bootstrap: str, group: str, topic: str) -> bool:
    """Whether ``group`` has committed every partition of ``topic`` to its end (read without joining)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=[bootstrap], group_id=group, enable_auto_commit=False)
    try:
        parts = consumer.partitions_for_topic(topic) or ()
        ends = consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        return bool(ends) and all((consumer.committed(tp) or 0) >= end for tp, end in ends.items())
    finally:
        consumer.close()


def _spike_step(bootstrap: str, topic: str) -> int | None:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        topic, bootstrap_servers=[bootstrap], auto_offset_reset="earliest", consumer_timeout_ms=2000
    )
    events = [json.loads(m.value) for m in consumer]
    consumer.close()
    return next((e["first_step"] for e in events if e["change"] == "opened" and e["kind"] == "loss_spike"), None)


def takeover(bootstrap: str, mode: str, rate: float, workdir: Path) -> dict:
    """One takeover (``mode`` changelog or cold); what B did, timed from its start."""
    tag = uuid.uuid4().hex[:8]
    state_topic = f"state.{tag}" if mode == "changelog" else None
    emitters = [
        Emitter(KafkaTransport(bootstrap, f"tel.{tag}"), run="r", rank=r, world=WORLD, host=f"h{r // 2}")
        for r in range(WORLD)
    ]
    a = _serve(bootstrap, tag, workdir / f"{tag}-x", free_port(), state_topic)
    a_lines = _lines(a)
    _wait(lambda: any("consuming" in ln for _, ln in a_lines), 60, "A to start")
    _train(emitters, range(WARM_STEPS), 0)
    state_file = workdir / f"{tag}-x" / "pipeline-state.json"

    def snapshot_taken() -> bool:  # A's snapshot of the warm-up steps, where B will look for it
        if state_topic:
            snap = StateChangelog(bootstrap, state_topic, group=f"g.{tag}", stage="both").read()
            return snap is not None and snap.state["records_total"] >= WARM_STEPS * WORLD
        return state_file.exists() and json.loads(state_file.read_text())["records_total"] >= WARM_STEPS * WORLD

    _wait(snapshot_taken, 60, "A's snapshot")
    _wait(lambda: _committed(bootstrap, f"g.{tag}", f"tel.{tag}"), 60, "A's commit after it")
    a.send_signal(signal.SIGKILL)
    a.wait()
    trainer = threading.Thread(target=_train, args=(emitters, range(WARM_STEPS, LAST_STEP + 1), rate))
    port = free_port()
    started = time.monotonic()
    b = _serve(bootstrap, tag, workdir / f"{tag}-y", port, state_topic)
    trainer.start()
    b_lines = _lines(b)
    try:
        banner = _wait(lambda: next((t for t, ln in b_lines if "consuming" in ln), None), 60, "B to start")
        resumed = next((ln for _, ln in b_lines if "resuming from state topic" in ln), "")
        history = int(re.search(r"(\d+) records\)", resumed).group(1)) if resumed else 0
        _wait(lambda: (_records(port) or 0) > history, 120, "B's first record")
        first = time.monotonic()
        trainer.join()
        _wait(lambda: (_records(port) or 0) >= history + (LAST_STEP + 1 - WARM_STEPS) * WORLD, 120, "B to catch up")
        time.sleep(3)  # steps close, incidents go out
        spike = _spike_step(bootstrap, f"anom.{tag}")
    finally:
        b.send_signal(signal.SIGTERM)
        b.wait(60)
        for em in emitters:
            em.close(5)
    return {
        "mode": mode,
        "to_banner_s": round(banner - started, 2),
        "to_first_record_s": round(first - started, 2),
        "resumed_records": history,
        "spike_found_at_step": spike,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3, help="takeovers per mode")
    ap.add_argument("--rate", type=float, default=10.0, help="steps per second the run trains during the takeover")
    ap.add_argument("--quick", action="store_true", help="one takeover per mode")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    trials = 1 if args.quick else args.trials
    results = []
    with EmbeddedBroker(port=0) as broker, tempfile.TemporaryDirectory() as tmp:
        for mode in ("changelog", "cold"):
            for _ in range(trials):
                res = takeover(broker.bootstrap, mode, args.rate, Path(tmp))
                print(json.dumps(res), flush=True)
                results.append(res)
    summary = {}
    for mode in ("changelog", "cold"):
        rows = [r for r in results if r["mode"] == mode]
        summary[mode] = {
            "to_first_record_s_median": statistics.median(r["to_first_record_s"] for r in rows),
            "to_banner_s_median": statistics.median(r["to_banner_s"] for r in rows),
            "spike_found": sum(r["spike_found_at_step"] == SPIKE_STEP for r in rows),
            "trials": len(rows),
        }
    out = {
        "machine": platform.platform(),
        "command": " ".join(["bench/bench_takeover.py", *(argv or sys.argv[1:])]),
        "spike_step": SPIKE_STEP,
        "rate_steps_per_s": args.rate,
        "summary": summary,
        "takeovers": results,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 0 if summary["changelog"]["spike_found"] == trials else 1


if __name__ == "__main__":
    sys.exit(main())
