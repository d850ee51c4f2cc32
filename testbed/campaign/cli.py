"""``sdcwatch bench``: the benchmarks from the command line (the product's ``sdcwatch bench`` runs this).

    sdcwatch bench campaign [--faults FILE] [--trials N] [--seed S] [--ranks W] [--steps PRE BRANCH]
                            [--out results.json] [--quick]
    sdcwatch bench clean [--steps N] [--runs R] [--workers P] [--probes NAME|FILE] [--parallel LAYOUT]
                         [--out results.json]
    sdcwatch bench e2e [--ranks N ...] [--duration S] [--out e2e.json] [--quick]
    sdcwatch bench ingest [--ranks N ...] [--metrics M] [--json]
    sdcwatch bench all [--quick] [--out-dir results/]

``all`` runs the campaign, the end-to-end benchmark and the scripts ``bench/bench_emitter.py``,
``bench/bench_overhead.py``, ``bench/bench_detectors.py`` and ``bench/bench_split.py`` (those present), writes every result as
JSON into ``--out-dir`` and the table ``benchmarks.md`` generated from them, with the machine and
the command.

``campaign``, ``clean`` and ``fleet`` run from the installed package (:mod:`sdcwatch.testbed.campaign`, the
``sdcwatch-campaign`` distribution); ``e2e``, ``ingest`` and ``all`` run scripts of the repository's
``bench/`` folder, which no wheel holds: from an installed sdcwatch they need a clone
(``SDCWATCH_BENCH_DIR`` names its ``bench/``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from sdcwatch.core.errors import ConfigError

__all__ = [
    "bench_main",
    "campaign_main",
    "clean_main",
    "e2e_main",
    "ingest_main",
    "all_main",
    "bench_dir",
    "bench_usage",
    "BENCH_DIR_ENV",
    "FROM_PACKAGE",
    "FROM_CLONE",
    "machine",
    "write_markdown",
]

#: Campaign size of ``--quick`` (CI): a few trials on 4 ranks, enough to keep the runner tested.
QUICK_CAMPAIGN = dict(
    world=4,
    trials=3,
    pretrain_steps=90,
    branch_steps=24,
    fault_offset=(2, 4),
    classes=("nan_attn", "bad_batch_all", "unhealthy_node"),
)
SCRIPTS = ("bench_emitter.py", "bench_overhead.py", "bench_detectors.py", "bench_split.py", "bench_ingest.py")
#: Options that make a script CI-sized when it has no ``--quick`` of its own.
QUICK_SCRIPT_ARGS = {
    "bench_emitter.py": ["--records", "20000", "--emits", "50000"],
    "bench_overhead.py": ["--steps", "60", "--warmup", "10"],
    "bench_detectors.py": ["--ranks", "1024", "--seconds", "1", "--river-records", "1000"],
    "bench_split.py": ["--ranks", "1024", "--steps", "5", "--detect-ranks", "64", "--seeds", "1"],
    "bench_ingest.py": ["--ranks", "1024", "--steps", "2"],
}


#: Names a clone's ``bench/`` folder: the clone-only benchmarks then run from an installed sdcwatch.
BENCH_DIR_ENV = "SDCWATCH_BENCH_DIR"
#: The benchmarks the installed package runs itself (:mod:`sdcwatch.testbed.campaign`), with what they measure.
FROM_PACKAGE = {
    "campaign": "fault-injection campaign: sdcwatch and the baselines on faulted branches and their clean twins",
    "clean": "false alarms on fault-free simulated training",
    "fleet": "a simulated cluster with one bad host: runs until the host ledger names it, clean hosts named",
}
#: The benchmarks that run scripts of the repository's ``bench/`` folder (not in the wheel).
FROM_CLONE = {
    "e2e": "end to end through a broker at scale: runs bench/bench_e2e.py",
    "ingest": "decode, align and detect cost per record: runs bench/bench_ingest.py",
    "all": "every benchmark and the table benchmarks.md: the campaign, bench/bench_e2e.py and the other bench/ scripts",
}


def _bench_dir_candidate() -> Path:
    """Where the ``bench/`` folder should be: ``$SDCWATCH_BENCH_DIR``, else beside the package (a clone's)."""
    named = os.environ.get(BENCH_DIR_ENV)
    return Path(named) if named else Path(__file__).resolve().parents[2] / "bench"


def _missing_bench_dir() -> str | None:
    """Why the clone-only benchmarks cannot run here, in one sentence; None when they can."""
    d = _bench_dir_candidate()
    if (d / "bench_e2e.py").is_file():
        return None
    return (
        f"needs a clone of the repository: it runs scripts of its bench/ folder, which the installed package "
        f"does not include (none at {d}); run it from a clone, or set {BENCH_DIR_ENV} to a clone's bench/ folder "
        "('sdcwatch bench campaign', 'clean' and 'fleet' run from the installed package)"
    )


def bench_dir() -> Path:
    """The repository's ``bench/`` folder (the scripts live beside the package, not inside it):
    ``$SDCWATCH_BENCH_DIR`` when set, else the clone's beside the package."""
    missing = _missing_bench_dir()
    if missing:
        raise ConfigError("bench", missing)
    return _bench_dir_candidate()


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_1min_at_start": load,
    }


def _write(path: str | Path | None, result: dict) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(result, indent=2, allow_nan=False))


_FROM_PACKAGE_NOTE = (
    "Runs from the installed package (sdcwatch.testbed.campaign; needs torch): no clone of the repository needed. "
    "'sdcwatch bench e2e', 'ingest' and 'all' need a clone: they run its bench/ scripts."
)


def _campaign_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sdcwatch bench campaign",
        description=(
            "Fault-injection campaign: train W simulated ranks to a checkpoint, then per fault a faulted branch and its "
            "clean twin; score sdcwatch and the baselines (Megatron-LM rules, ZClip, NaN check, river HalfSpaceTrees)."
        ),
        epilog=_FROM_PACKAGE_NOTE,
    )
    ap.add_argument(
        "--faults",
        help="faults file in the injector's JSON format (array or JSON lines), one trial "
        "per fault; steps count from the checkpoint (0 = first branch step)",
    )
    ap.add_argument(
        "--trials",
        type=int,
        help="trials from the seeded generator (default 169: 13 per class, 10,140 clean twin steps)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the model, data and generator (default 0)")
    ap.add_argument("--ranks", type=int, help="simulated data-parallel ranks (default 8)")
    ap.add_argument(
        "--parallel",
        metavar="LAYOUT",
        help="simulate a tensor x pipeline x data parallel layout instead, e.g. tp=2,pp=2,dp=4 "
        "(16 ranks; a fault's rank is a global rank)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        nargs=2,
        metavar=("PRETRAIN", "BRANCH"),
        help="steps to the checkpoint and steps per branch (default 150 60)",
    )
    ap.add_argument("--batch-size", type=int, help="sequences per rank per step (default 4)")
    ap.add_argument("--detectors", nargs="+", help="detectors to score (default: sdcwatch and every baseline)")
    ap.add_argument(
        "--probes",
        default="default",
        help="probe configuration of the ranks: default (what attach() ships), checksums (the default "
        "with the checksums on every step), every-step, scalars-only, or a JSON/TOML file of probe "
        "settings; bench/bench_overhead.py --probes takes the same",
    )
    ap.add_argument("--classes", nargs="+", help="fault classes of the generator (default: all)")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument(
        "--wire",
        choices=("v1", "v2"),
        help="send the records through this wire format and the "
        "service's decoder before detection (default: records as built)",
    )
    ap.add_argument("--quick", action="store_true", help="CI size: 3 trials on 4 ranks")
    ap.add_argument(
        "--guard",
        action="store_true",
        help="also run every trial guarded (the clean twin too) and measure the damage the guard saves",
    )
    ap.add_argument(
        "--guard-mitigations",
        nargs="+",
        choices=("lr", "clip", "lr+clip"),
        default=[],
        help="with --guard: run the benign and spike classes' trials guarded once more per spike mitigation "
        "(GuardConfig.spike_mitigation) and compare them with the guard without one and with no guard",
    )
    return ap


def campaign_main(argv: Sequence[str]) -> dict:
    """``sdcwatch bench campaign``; returns the result (also written to ``--out``)."""
    from dataclasses import replace

    args = _campaign_parser().parse_args(list(argv))  # before the imports: --help needs no torch
    from sdcwatch.testbed.campaign.run import CampaignConfig, run_campaign
    from sdcwatch.testbed.campaign.summary import summary_table

    config = CampaignConfig(**QUICK_CAMPAIGN) if args.quick else CampaignConfig()
    changes: dict[str, Any] = {"seed": args.seed, "probes": args.probes}
    if args.classes:
        changes["classes"] = tuple(args.classes)
    if args.trials is not None:
        changes["trials"] = args.trials
    if args.ranks is not None and args.parallel is not None:
        raise ConfigError("ranks", "give --ranks or --parallel, not both (the layout sets the rank count)")
    if args.ranks is not None:
        changes["world"] = args.ranks
    if args.parallel is not None:
        changes["parallel"] = args.parallel
    if args.batch_size is not None:
        changes["batch_size"] = args.batch_size
    if args.wire is not None:
        changes["wire"] = args.wire
    if args.steps is not None:
        pre, branch = args.steps
        changes.update(pretrain_steps=pre, branch_steps=branch)
        lo, hi = config.fault_offset
        if hi >= branch:  # keep the generator's fault inside a short branch
            changes["fault_offset"] = (min(lo, max(branch // 4, 0)), max(branch // 4, 0))
    config = replace(config, **changes)
    faults = None
    if args.faults:
        from sdcwatch.testbed.faultspec import load_faults

        faults = load_faults(args.faults)
    from sdcwatch.telemetry.probes.presets import probe_config

    result = run_campaign(
        config, faults, detectors=args.detectors, guard=args.guard, mitigations=args.guard_mitigations
    )
    result["config"]["probe_settings"] = dict(probe_config(config.probes)[1].__dict__)
    result["machine"] = machine()
    result["command"] = "sdcwatch bench campaign " + " ".join(argv)
    _write(args.out, result)
    print(summary_table(result))
    if args.guard:
        from sdcwatch.testbed.campaign.guarded import guard_table

        print()
        print(guard_table(result))
    return result


def _clean_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sdcwatch bench clean",
        description=(
            "False alarms on clean training: fault-free simulated runs from step 0 (one per seed), every step "
            "through the campaign's detectors; reports each alarm with its step, rank and message."
        ),
        epilog=_FROM_PACKAGE_NOTE,
    )
    ap.add_argument("--steps", type=int, default=10_000, help="clean steps in all, split over the runs (default 10000)")
    ap.add_argument("--runs", type=int, default=4, help="independent runs, seeds SEED..SEED+RUNS-1 (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first run (default 0)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2; 1: in this process)")
    ap.add_argument("--ranks", type=int, help="simulated data-parallel ranks (default 8)")
    ap.add_argument(
        "--parallel", metavar="LAYOUT", help="a tensor x pipeline x data parallel layout, e.g. tp=2,pp=2,dp=4"
    )
    ap.add_argument("--batch-size", type=int, help="sequences per rank per step (default 4)")
    ap.add_argument(
        "--probes", default="default", help="probe configuration: a preset name or a JSON/TOML file (as campaign)"
    )
    ap.add_argument("--detectors", nargs="+", help="detectors to run (default: sdcwatch and every baseline)")
    ap.add_argument("--wire", choices=("v1", "v2"), help="send the records through this wire format first")
    ap.add_argument("--out", help="write the JSON result here")
    return ap


def clean_main(argv: Sequence[str]) -> dict:
    """``sdcwatch bench clean``; returns the result (also written to ``--out``)."""
    args = _clean_parser().parse_args(list(argv))  # before the imports: --help needs no torch
    import torch  # noqa: F401  (without it, fail here rather than in the worker processes)

    from sdcwatch.testbed.campaign.clean_run import CleanRunConfig, clean_table, run_clean

    if args.ranks is not None and args.parallel is not None:
        raise ConfigError("ranks", "give --ranks or --parallel, not both (the layout sets the rank count)")
    options = {
        k: v
        for k, v in dict(
            steps=args.steps,
            runs=args.runs,
            seed=args.seed,
            workers=args.workers,
            world=args.ranks,
            parallel=args.parallel,
            batch_size=args.batch_size,
            probes=args.probes,
            detectors=tuple(args.detectors) if args.detectors else None,
            wire=args.wire,
        ).items()
        if v is not None
    }
    at_start = machine()
    command = "sdcwatch bench clean " + " ".join(argv)

    def written(result: dict) -> None:  # after every run: a measurement cut short keeps its runs
        result["machine"] = {**at_start, "load_1min_at_end": machine()["load_1min_at_start"]}
        result["command"] = command
        _write(args.out, result)

    result = run_clean(CleanRunConfig(**options), on_run=written)
    print(clean_table(result))
    return result


def fleet_main(argv: Sequence[str]) -> dict:
    """``sdcwatch bench fleet`` (:mod:`.fleet`: the host ledger across the runs of a simulated cluster)."""
    from sdcwatch.testbed.campaign.fleet import fleet_main as run_fleet_main

    return run_fleet_main(argv)


def _load_script(name: str) -> Any:
    path = bench_dir() / name
    if not path.is_file():
        raise ConfigError("bench", f"{path} not found: the benchmark runs from a full clone of the repository")
    spec = importlib.util.spec_from_file_location(f"sdcwatch_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def e2e_main(argv: Sequence[str]) -> dict:
    """``sdcwatch bench e2e``: runs ``bench/bench_e2e.py`` (its options: ``--help``)."""
    result = _load_script("bench_e2e.py").main(list(argv))
    result["machine"] = machine()
    result["command"] = "sdcwatch bench e2e " + " ".join(argv)
    out = _option(argv, "--out")
    _write(out, result)
    for s in result["scales"]:
        print(
            f"{s['ranks']} ranks: {s['processed_steps_per_s'] or 0:.2f} steps/s processed "
            f"(produced {s['produced_steps_per_s']:.2f}), lag at stop {s['lag_at_producers_done']}, "
            f"latency p50 {s['latency_s']['p50']} s p99 {s['latency_s']['p99']} s, "
            f"faults {s['faults_detected']}/{s['faults_injected']}"
        )
    return result


def ingest_main(argv: Sequence[str]) -> list:
    """``sdcwatch bench ingest``: runs ``bench/bench_ingest.py`` (its options: ``--help``)."""
    return _load_script("bench_ingest.py").main(list(argv))


def _option(argv: Sequence[str], name: str) -> str | None:
    argv = list(argv)
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _run_script(name: str, out: Path, quick: bool) -> dict:
    """Run one ``bench/`` script in its own process with ``--out`` (and ``--quick`` when it has one)."""
    path = bench_dir() / name
    if not path.exists():
        return {"status": "missing", "script": str(path)}
    help_text = subprocess.run(
        [sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    cmd = [sys.executable, str(path), "--out", str(out)]
    if quick and "--quick" in help_text:
        cmd.append("--quick")
    elif quick:
        cmd += QUICK_SCRIPT_ARGS.get(name, [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    status = {
        "status": "ok" if proc.returncode == 0 else f"failed ({proc.returncode})",
        "command": " ".join(["python", f"bench/{name}", *cmd[2:]]),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if proc.returncode != 0:
        status["stderr"] = proc.stderr[-2000:]
    return status


def all_main(argv: Sequence[str]) -> dict:
    """``sdcwatch bench all``: every benchmark, JSON per benchmark and ``benchmarks.md``."""
    ap = argparse.ArgumentParser(
        prog="sdcwatch bench all",
        description="Run every benchmark and write the table.",
        epilog="Needs a clone of the repository: it runs bench/bench_e2e.py and the other scripts of its bench/ "
        f"folder, which the installed package does not include ({BENCH_DIR_ENV} names a clone's bench/ folder).",
    )
    ap.add_argument("--quick", action="store_true", help="CI sizes (minutes, not hours)")
    ap.add_argument("--out-dir", default="results", help="where the JSON files and benchmarks.md go (default results/)")
    args = ap.parse_args(list(argv))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = ["--quick"] if args.quick else []
    runs: dict[str, Any] = {}
    campaign_main([*quick, "--out", str(out_dir / "campaign.json")])
    runs["campaign"] = {
        "status": "ok",
        "command": "sdcwatch bench campaign " + " ".join([*quick, "--out", str(out_dir / "campaign.json")]),
    }
    e2e_main([*quick, "--out", str(out_dir / "e2e.json")])
    runs["e2e"] = {
        "status": "ok",
        "command": "sdcwatch bench e2e " + " ".join([*quick, "--out", str(out_dir / "e2e.json")]),
    }
    for script in SCRIPTS:
        name = script.removeprefix("bench_").removesuffix(".py")
        runs[name] = _run_script(script, out_dir / f"{name}.json", args.quick)
    md = write_markdown(out_dir, runs, command="sdcwatch bench all " + " ".join(argv))
    print(f"sdcwatch bench all: wrote {md}", file=sys.stderr)
    return runs


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_markdown(out_dir: str | Path, runs: dict[str, Any] | None = None, *, command: str = "") -> Path:
    """``benchmarks.md`` in ``out_dir``, generated from the JSON results there."""
    from sdcwatch.testbed.campaign.summary import summary_table

    out_dir = Path(out_dir)
    m = machine()
    lines = [
        "# sdcwatch benchmarks",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command or 'sdcwatch bench all'}`.",
        "",
        f"Machine: {m['cpus']} CPUs ({m['cpu']}), {m['platform']}, Python {m['python']}; "
        f"1-minute load average at the start: {m['load_1min_at_start']}.",
        "",
    ]
    campaign = _load_json(out_dir / "campaign.json")
    if campaign:
        c = campaign["config"]
        lines += [
            "## Fault-injection campaign",
            "",
            f"{len(campaign['trials'])} trials, {c['world']} simulated ranks, checkpoint at step {c['pretrain_steps']}, "
            f"branches of {c['branch_steps']} steps; {campaign['seconds']} s. Command: `{campaign.get('command', '')}`.",
            "",
            summary_table(campaign),
            "",
        ]
    e2e = _load_json(out_dir / "e2e.json")
    if e2e:
        lines += [
            "## End to end through the broker",
            "",
            f"Command: `{e2e.get('command', '')}`.",
            "",
            "| ranks | producers | target steps/s | produced steps/s | processed steps/s | lag at stop (steps) "
            "| bounded lag | faults found | latency p50 (s) | latency p99 (s) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in e2e["scales"]:
            lat = s["latency_s"]
            lines.append(
                f"| {s['ranks']} | {s['producers']} | {s['target_rate_steps_per_s']:g} | "
                f"{s['produced_steps_per_s']:.2f} | {_fmt(s['processed_steps_per_s'])} | "
                f"{_fmt(s.get('lag_at_producers_done_steps'))} | {'yes' if s['bounded_lag'] else 'no'} | "
                f"{s['faults_detected']}/{s['faults_injected']} | {_fmt(lat['p50'])} | {_fmt(lat['p99'])} |"
            )
        lines.append("")
    for name in ("emitter", "overhead", "detectors", "split", "ingest"):
        data = _load_json(out_dir / f"{name}.json")
        status = (runs or {}).get(name, {})
        lines += [f"## {name}", ""]
        if status.get("command"):
            lines += [f"Command: `{status['command']}` ({status.get('status')}).", ""]
        if data is None:
            lines += [f"No result ({status.get('status', 'not run')}).", ""]
            continue
        lines += ["```json", json.dumps(_trim(data), indent=2)[:4000], "```", ""]
    path = out_dir / "benchmarks.md"
    path.write_text("\n".join(lines))
    return path


def _trim(data: Any) -> Any:
    """Drop long sample lists from a result for the table page."""
    if isinstance(data, dict):
        return {k: _trim(v) for k, v in data.items() if not (isinstance(v, list) and len(v) > 12)}
    return data


def _fmt(x: Any) -> str:
    return "–" if x is None else f"{x:.3g}"


def bench_usage() -> str:
    """``sdcwatch bench``'s help: the benchmarks, which run from the installed package and which
    need a clone of the repository, and whether its ``bench/`` folder is found here."""
    lines = [
        "usage: sdcwatch bench COMMAND [options]  (sdcwatch bench COMMAND --help)",
        "",
        "from the installed package (sdcwatch.testbed.campaign):",
        *(f"  {name:9s} {what}" for name, what in FROM_PACKAGE.items()),
        "from a clone of the repository (they run scripts of its bench/ folder, which the installed package "
        "does not include):",
        *(f"  {name:9s} {what}" for name, what in FROM_CLONE.items()),
        "",
    ]
    missing = _missing_bench_dir()
    if missing:
        lines.append(f"no bench/ folder at {_bench_dir_candidate()}: set {BENCH_DIR_ENV} to a clone's bench/ folder")
    else:
        lines.append(f"bench/ folder: {_bench_dir_candidate()}")
    return "\n".join(lines)


def _clone_only_help(name: str) -> bool:
    """For ``sdcwatch bench e2e|ingest --help``: say that it needs a clone; True when the script's
    own help cannot follow (no ``bench/`` folder here)."""
    print(f"sdcwatch bench {name}: {FROM_CLONE[name]}, from a clone of the repository (not in the installed package)")
    missing = _missing_bench_dir()
    if missing:
        print(
            f"no bench/ folder at {_bench_dir_candidate()}: run it from a clone, or set {BENCH_DIR_ENV} to a clone's bench/ folder"
        )
        return True
    print()
    return False


def bench_main(argv: Sequence[str]) -> int:
    """Entry point of ``sdcwatch bench``; 2 (and one line) for a clone-only benchmark without a clone."""
    argv = list(argv)
    commands = {
        "campaign": campaign_main,
        "clean": clean_main,
        "fleet": fleet_main,
        "e2e": e2e_main,
        "ingest": ingest_main,
        "all": all_main,
    }
    if not argv or argv[0] not in commands:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(bench_usage(), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    name, rest = argv[0], argv[1:]
    asked = "-h" in rest or "--help" in rest
    if name in FROM_CLONE and asked and name != "all":  # all's own help says it
        if _clone_only_help(name):
            return 0
    elif name in FROM_CLONE and not asked:
        missing = _missing_bench_dir()
        if missing:
            print(f"sdcwatch bench {name}: {missing}", file=sys.stderr)
            return 2
    commands[name](rest)
    return 0
