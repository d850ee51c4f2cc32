"""Behaviour comparison: run the same workloads under two interpreters (two installs of sdcwatch)
and say which outputs are identical and how the others differ. A refactoring that must not change
behaviour is checked with this script: the base install first (its outputs are kept), then the new.

What runs, in a fresh process per workload, under each interpreter:

- ``records``: the testbed's tiny GPT trained a few dozen steps on the CPU (eager, seeded, one
  thread), one bit flipped in one product's output at one step, with ``attach`` under the probe
  presets ``default``, ``forward-checksums`` and ``checksums``, through an ``Emitter`` into the
  in-memory bus, wire v2 and v1: every message's bytes (key and value, in bus order) are kept,
  with their sha256 and, for reading a difference, the records decoded as JSON lines;
- ``replays``: ``sdcwatch replay --json`` of the 4 shared real training logs;
- ``demos``: ``sdcwatch demo --fault PRESET --json`` for the 7 demo presets;
- ``campaign``: ``sdcwatch bench campaign --quick`` (its table on stdout and its ``--out`` JSON).

Volatile values are normalised so that two runs of the same code compare equal; each is named here:

- the record's ``time`` (the emitter's wall clock): the workload gives ``emit`` a fixed time per
  step (1.7e9 + step), the end-of-run marker's clock is fixed while the emitter closes, and
  ``step_time`` is passed to ``Watch.step`` (0.25 s) instead of measured;
- the emitter's batching (which records share a message depends on thread timing): ``batch=1``;
- incidents' ``opened_at`` and ``resolved_at`` (wall clock), in replays and demos;
- the demo's ``latency_seconds`` and ``wall_seconds`` (durations), ``metrics_url`` (a free port)
  and its output folder where it appears in a value (``report``, ``records``): ``<out>``;
- the campaign JSON's ``seconds`` (durations, top level and checkpoint), ``machine`` (CPU, load,
  platform) and ``command`` (the command line, with its temporary ``--out`` path); the campaign's
  progress lines on stderr (durations and estimates) are kept but not compared;
- hash randomisation: every process runs with ``PYTHONHASHSEED=0``, and without the caller's
  ``SDCWATCH_*`` variables (a job key or wire in the environment would change the records).

Usage (each interpreter has sdcwatch installed; the script runs from any directory, and its
processes run in a temporary directory so the checkout is not imported by mistake)::

    python bench/compare_behaviour.py --base BASE_PY --new NEW_PY --out DIR [--only records,replays]
    python bench/compare_behaviour.py --base BASE_PY --out DIR     # the base side only, kept in DIR/base
    python bench/compare_behaviour.py --new NEW_PY --out DIR       # the new side, compared with DIR/base

A side given runs again (its folder replaced) unless ``--reuse``: then a group whose outputs are
already in ``DIR/<side>`` is kept. Exit status: 0 when every output compared is identical, else 1.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
REAL_LOGS = REPO.parent / "shared" / "data" / "real-logs"
PRESETS = ("default", "forward-checksums", "checksums")
WIRES = ("v2", "v1")
LOGS = ("llmc_gpt2_124m_nan.csv", "llmc_gpt2_124m_ok.csv", "modded_nanogpt_muon_124m.csv", "pythia160m_seed5_clean.csv")
DEMOS = ("bitflip", "nan", "near_inf", "unhealthy-node", "bad-batch", "lr-spike", "none")
GROUPS = ("records", "replays", "demos", "campaign")
STEPS = 30
FLIP = (12, "blocks.0.mlp.fc", 23)  # step, product whose output gets one bit flipped, the bit
VOLATILE_KEYS = frozenset(
    {"opened_at", "resolved_at", "latency_seconds", "wall_seconds", "metrics_url", "seconds", "machine", "command"}
)
VOLATILE = "<volatile>"


# -- the records workload: runs inside the interpreter under test -----------------------------------
class FixedClock:
    """An emitter stand-in that gives every record a time fixed by its step, and passes the rest on."""

    def __init__(self, emitter: Any) -> None:
        self.emitter = emitter

    def emit(self, step: int, *, time: float | None = None, **fields: Any) -> None:
        self.emitter.emit(step, time=1.7e9 + step, **fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.emitter, name)


def record_workload(preset: str, wire: str, out: Path) -> None:
    """Train the tiny GPT under ``preset`` and write the bus's messages and the decoded records."""
    import torch
    from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport, attach, probe_config, to_json
    from sdcwatch.testbed.model import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bus = MemoryBus()
    transport = MemoryTransport(bus)
    emitter = Emitter(transport, run="compare", rank=0, world=1, host="host0", wire=wire, env={}, batch=1)
    _, config = probe_config(preset)
    watch = attach(model, FixedClock(emitter), optimizer=opt, config=config)

    def flip_output(module: Any, args: Any, output: Any) -> Any:
        output = output.clone()
        flat = output.detach().view(-1)
        flat.view(torch.int32)[int(flat.abs().argmax())] ^= 1 << FLIP[2]
        return output

    g = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        hook = model.get_submodule(FLIP[1]).register_forward_hook(flip_output) if step == FLIP[0] else None
        loss = model.loss(torch.randint(0, model.cfg.vocab, (2, model.cfg.seq_len + 1), generator=g))
        if hook is not None:
            hook.remove()
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(step, loss=loss, step_time=0.25)
    watch.close()
    if not emitter.flush(60):
        raise SystemExit("the emitter did not flush in 60 s")
    with mock.patch("time.time", lambda: 1.7e9 + STEPS):  # the end-of-run marker's time
        emitter.close(60)
    messages = bus.messages(transport.topic)
    with open(out / f"{preset}-{wire}.bin", "wb") as f:
        for key, value in messages:
            key = key or b""
            f.write(struct.pack(">II", len(key), len(value)) + key + bytes(value))
    try:
        decoded = "".join(to_json(r) + "\n" for r in bus.records(transport.topic))
    except Exception as exc:  # the bytes are what is compared; the dump only helps to read a difference
        decoded = f"records could not be decoded: {type(exc).__name__}: {exc}\n"
    (out / f"{preset}-{wire}.jsonl").write_text(decoded)


# -- running the workloads under an interpreter ------------------------------------------------------
def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDCWATCH_") and k != "PYTHONPATH"}
    env.update(PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1")
    return env


def _run(python: str, code: str, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -c code args`` in ``cwd`` (outside the checkout: its ``''`` path entry is ``cwd``)."""
    return subprocess.run(
        [python, "-c", code, *args],
        cwd=cwd,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _cli(python: str, args: list[str], cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    code = "import sys; from sdcwatch.cli import main; sys.argv[0] = 'sdcwatch'; sys.exit(main())"
    return _run(python, code, args, cwd, timeout)


def _scrub(value: Any, out_dir: str | None = None) -> Any:
    """``value`` with the volatile keys' values replaced and the output folder named ``<out>``."""
    if isinstance(value, dict):
        return {k: VOLATILE if k in VOLATILE_KEYS else _scrub(v, out_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, out_dir) for v in value]
    if isinstance(value, str) and out_dir:
        return value.replace(out_dir, "<out>")
    return value


def _scrub_lines(text: str, out_dir: str | None = None) -> str:
    """JSON lines (or one JSON document) normalised and printed one key per line for diffing; text
    that is not JSON (an error) as it is."""
    text = text.strip()
    if not text:
        return ""
    try:
        docs = [json.loads(text)]
    except json.JSONDecodeError:
        try:
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError:
            return text + "\n"
    return "".join(json.dumps(_scrub(d, out_dir), indent=1) + "\n" for d in docs)


def _status(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n"


def run_records(python: str, side: Path, cwd: Path) -> None:
    out = side / "records"
    out.mkdir(parents=True, exist_ok=True)
    code = (
        "import runpy, sys; sys.argv = ['compare_behaviour', '--workload'] + sys.argv[1:]; "
        f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
    )
    for preset in PRESETS:
        for wire in WIRES:
            proc = _run(python, code, [preset, wire, str(out)], cwd, timeout=1800)
            (out / f"{preset}-{wire}.status").write_text(_status(proc) + proc.stderr[-4000:])
            blob = out / f"{preset}-{wire}.bin"
            digest = hashlib.sha256(blob.read_bytes()).hexdigest() if blob.exists() else "missing"
            (out / f"{preset}-{wire}.sha256").write_text(digest + "\n")
            print(f"  records {preset} {wire}: {_status(proc).strip()}, sha256 {digest[:16]}", flush=True)


def run_replays(python: str, side: Path, cwd: Path, logs: Path) -> None:
    out = side / "replays"
    out.mkdir(parents=True, exist_ok=True)
    for name in LOGS:
        proc = _cli(python, ["replay", "--json", str(logs / name)], cwd)
        (out / f"{name}.json").write_text(_status(proc) + _scrub_lines(proc.stdout))
        (out / f"{name}.stderr").write_text(proc.stderr)
        print(f"  replay {name}: {_status(proc).strip()}", flush=True)


def run_demos(python: str, side: Path, cwd: Path) -> None:
    out = side / "demos"
    out.mkdir(parents=True, exist_ok=True)
    for preset in DEMOS:
        work = Path(tempfile.mkdtemp(prefix="demo-", dir=cwd))
        proc = _cli(python, ["demo", "--fault", preset, "--json", "--out-dir", str(work)], cwd)
        (out / f"{preset}.json").write_text(_status(proc) + _scrub_lines(proc.stdout, str(work)))
        (out / f"{preset}.stderr").write_text(proc.stderr)
        shutil.rmtree(work, ignore_errors=True)
        print(f"  demo {preset}: {_status(proc).strip()}", flush=True)


def run_campaign(python: str, side: Path, cwd: Path) -> None:
    out = side / "campaign"
    out.mkdir(parents=True, exist_ok=True)
    result = cwd / "campaign.json"
    proc = _cli(python, ["bench", "campaign", "--quick", "--out", str(result)], cwd)
    (out / "stdout.txt").write_text(_status(proc) + proc.stdout)
    (out / "result.json").write_text(_scrub_lines(result.read_text()) if result.exists() else "missing\n")
    (out / "progress.stderr").write_text(proc.stderr)
    print(f"  campaign: {_status(proc).strip()}", flush=True)


def run_side(python: str, side: Path, groups: list[str], reuse: bool, logs: Path) -> None:
    """Run ``groups`` under ``python``, writing into ``side`` (a group already there is kept with ``reuse``)."""
    runners: dict[str, Callable[[str, Path, Path], None]] = {
        "records": run_records,
        "replays": lambda py, s, c: run_replays(py, s, c, logs),
        "demos": run_demos,
        "campaign": run_campaign,
    }
    for group in groups:
        done = side / group / ".done"
        if reuse and done.exists():
            print(f"{side.name}: {group} kept from an earlier run", flush=True)
            continue
        shutil.rmtree(side / group, ignore_errors=True)
        print(f"{side.name}: {group} with {python}", flush=True)
        with tempfile.TemporaryDirectory(prefix="sdcwatch-compare-") as cwd:
            runners[group](python, side, Path(cwd))
        done.write_text("")


# -- comparing ---------------------------------------------------------------------------------------
def _compared_files(base: Path, new: Path, group: str) -> list[str]:
    names = {p.name for d in (base / group, new / group) if d.is_dir() for p in d.iterdir()}
    return sorted(n for n in names if not n.endswith((".stderr", ".status", ".jsonl", ".bin")) and n != ".done")


def _text(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True) if path.exists() else ["<missing>\n"]


def compare(base: Path, new: Path, groups: list[str]) -> bool:
    """Print, per output, identical or a diff; True when every one is identical."""
    same_all = True
    for group in groups:
        for name in _compared_files(base, new, group):
            a, b = base / group / name, new / group / name
            same = a.exists() and b.exists() and a.read_bytes() == b.read_bytes()
            if group == "records":  # the digest names the bytes: a difference shows in the decoded records
                stem = name.removesuffix(".sha256")
                a, b = base / group / f"{stem}.jsonl", new / group / f"{stem}.jsonl"
                for status in (base / group / f"{stem}.status", new / group / f"{stem}.status"):
                    if status.exists() and not status.read_text().startswith("exit 0"):
                        same = False
                        print(f"{status}:\n{status.read_text()}")
            print(f"{'identical' if same else 'DIFFERENT'}  {group}/{name}")
            if not same:
                same_all = False
                diff = difflib.unified_diff(_text(a), _text(b), str(a), str(b), n=2)
                sys.stdout.writelines(list(diff)[:200])
    return same_all


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--workload"]:  # inside the interpreter under test
        preset, wire, out = argv[1:]
        record_workload(preset, wire, Path(out))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", help="the interpreter of the install before the change")
    p.add_argument("--new", help="the interpreter of the install after the change")
    p.add_argument("--out", required=True, type=Path, help="folder for the outputs: OUT/base and OUT/new")
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups (default {','.join(GROUPS)})")
    p.add_argument("--reuse", action="store_true", help="keep a group whose outputs are already in OUT/<side>")
    p.add_argument("--real-logs", type=Path, default=REAL_LOGS, help="folder of the shared real training logs")
    args = p.parse_args(argv)
    groups = [g for g in args.only.split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        p.error(f"unknown group(s) {', '.join(unknown)} (known: {', '.join(GROUPS)})")
    if "replays" in groups and not args.real_logs.is_dir():
        p.error(f"real training logs not found at {args.real_logs} (--real-logs)")
    for name, python in (("base", args.base), ("new", args.new)):
        if python:
            run_side(python, args.out / name, groups, args.reuse, args.real_logs)
    if not (args.out / "base").is_dir() or not (args.out / "new").is_dir():
        print(f"one side only: outputs in {args.out}")
        return 0
    return 0 if compare(args.out / "base", args.out / "new", groups) else 1


if __name__ == "__main__":
    sys.exit(main())
