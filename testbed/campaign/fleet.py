"""The fleet campaign (``sdcwatch bench fleet``): a simulated cluster whose runs are scheduled onto
random hosts, one of them bad with rare, mostly sub-threshold faults, every step through one real
detection pipeline; it measures after how many runs the host ledger names the bad host, and whether
it ever names a clean one.

A step is a synthetic frame (:mod:`sdcwatch.testbed.synthetic_steps`: every rank's statistics drawn
at once), so a fleet of 40 runs costs seconds, not the hours simulated training would. The bad host
has one bad GPU: on a fraction of its steps that rank's attention statistics carry small noise, and now and then
a mantissa flip lands in one of its products (most below the checksum bound, a few above). Every run
also has ordinary loss spikes and bad batches (all ranks alike), and a clean host now and then
suffers a one-off transient: evidence of one run, which a verdict must not take for a bad host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from typing import Any, Callable, Sequence

import numpy as np
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.service.hosts import HostSettings
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings
from sdcwatch.testbed.synthetic_steps import LAYERS, draw_step, step_frame

__all__ = ["FleetConfig", "fleet_main", "fleet_table", "run_fleet", "run_seed"]

_GEMM = LAYERS.index("gemm_fwd")
_Q = (LAYERS.index("q_norm_mean"), LAYERS.index("q_norm_max"))
_RUN_GAP_S = 3600.0  # wall time between the starts of two runs (the ledger's evidence decays over it)


@dataclass
class FleetConfig:
    """One fleet: its hosts, its runs and the bad host's faults (``bad=False``: a clean fleet)."""

    hosts: int = 64
    ranks_per_host: int = 8
    runs: int = 40
    min_steps: int = 200
    max_steps: int = 400
    min_hosts_per_run: int = 4
    max_hosts_per_run: int = 24
    layers: int = 2
    bad: bool = True
    noise_rate: float = 0.02
    """Fraction of the bad GPU's steps with noise on one of its attention statistics."""
    noise_size: tuple[float, float] = (20.0, 120.0)
    """Size of that noise, drawn uniformly, in the ranks' own spread (1%): no single step is an alert."""
    flip_rate: float = 0.002
    """Per step of the bad GPU: a mantissa flip in one product (its residual 10^U(-3, 2) x the bound)."""
    spike_rate: float = 0.002
    """Per step of every run: a loss spike on every rank (a hard batch)."""
    bad_batch_rate: float = 0.002
    """Per step of every run: a bad batch on one random rank (its loss and gradient norm far off)."""
    transient_rate: float = 0.1
    """Per run: a one-off flip above the bound on a random rank of a random host (a clean host's cosmic ray)."""
    seed: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    """The ledger's settings (the ``[hosts]`` table); empty: its defaults."""


class _FleetRun:
    """One run's steps as frames: its hosts, its faults, drawn from its own seed."""

    def __init__(self, cfg: FleetConfig, name: str, hosts: Sequence[str], bad_rank: int | None, seed: int) -> None:
        self.cfg, self.name = cfg, name
        self.hosts = tuple(h for h in hosts for _ in range(cfg.ranks_per_host))
        self.world = len(self.hosts)
        self.bad_rank = bad_rank
        self.rng = np.random.default_rng(seed)
        self.steps = int(self.rng.integers(cfg.min_steps, cfg.max_steps + 1))
        self.transient = (
            (int(self.rng.integers(20, self.steps)), int(self.rng.integers(self.world)))
            if self.rng.random() < cfg.transient_rate
            else None
        )
        self.bad_steps: list[int] = []  # steps the bad GPU's fault was active

    def frame(self, step: int) -> StepFrame:
        cfg, rng, L = self.cfg, self.rng, self.cfg.layers
        S, lay, fp = draw_step(rng, step, self.world, L)
        if rng.random() < cfg.spike_rate:
            S[:, 0] *= 1.8
            S[:, 1:3] *= 3.0
        if rng.random() < cfg.bad_batch_rate:
            b = int(rng.integers(self.world))
            S[b, 0] *= rng.uniform(1.5, 3.0)
            S[b, 1] *= rng.uniform(3.0, 8.0)
        r = self.bad_rank
        if r is not None:
            hit = False
            if rng.random() < cfg.noise_rate:
                lay[r, _Q, int(rng.integers(L))] *= 1 + 0.01 * rng.uniform(*cfg.noise_size)
                hit = True
            if rng.random() < cfg.flip_rate:
                lay[r, _GEMM, int(rng.integers(L))] = 10 ** rng.uniform(-3, 2)
                hit = True
            if hit:
                self.bad_steps.append(step)
        if self.transient is not None and step == self.transient[0]:
            lay[self.transient[1], _GEMM, 0] = 40.0
        return step_frame(self.name, step, self.hosts, S, lay, fp)


def run_seed(cfg: FleetConfig, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """One fleet: every run through one pipeline, the ledger read after each run."""
    rng = np.random.default_rng([cfg.seed, 35])
    names = [f"node{i:03d}" for i in range(cfg.hosts)]
    bad_host = names[int(rng.integers(cfg.hosts))] if cfg.bad else None
    bad_gpu = int(rng.integers(cfg.ranks_per_host))
    clock = [1.7e9]
    pipe = DetectionPipeline(PipelineSettings(), wall=lambda: clock[0], hosts=HostSettings.from_dict(cfg.settings))
    touched = 0  # runs that ran on the bad host so far
    suspect_after = quarantine_after = None
    alerted = []  # per run touching the bad host: what per-run alerting said about it
    false_suspects: set[str] = set()
    for i in range(cfg.runs):
        k = int(rng.integers(cfg.min_hosts_per_run, cfg.max_hosts_per_run + 1))
        hosts = [names[j] for j in rng.choice(cfg.hosts, size=min(k, cfg.hosts), replace=False)]
        on_bad = bad_host in hosts
        bad_rank = hosts.index(bad_host) * cfg.ranks_per_host + bad_gpu if on_bad else None
        run = _FleetRun(cfg, f"job{i:03d}", hosts, bad_rank, seed=int(rng.integers(1 << 31)))
        start = clock[0] = 1.7e9 + i * _RUN_GAP_S
        critical = warning = 0
        for step in range(run.steps):
            clock[0] = start + step
            for e in pipe.process_frame(run.frame(step)):
                inc = e.incident
                if e.change == "opened" and bad_host in inc.hosts and len(inc.hosts) == 1:
                    critical += inc.severity.value == "critical"
                    warning += inc.severity.value == "warning"
        pipe.evict(run.name, "finished")
        touched += on_bad
        pipe.hosts.review(clock[0])  # as the service does at a snapshot
        verdicts = {v.host: v for v in pipe.hosts.verdicts(clock[0])}
        bad = verdicts.get(bad_host) if bad_host else None
        if bad is not None and bad.verdict in ("suspect", "quarantine") and suspect_after is None:
            suspect_after = touched
        if bad is not None and bad.verdict == "quarantine" and quarantine_after is None:
            quarantine_after = touched
        false_suspects |= {h for h, v in verdicts.items() if h != bad_host and v.verdict in ("suspect", "quarantine")}
        if on_bad:
            alerted.append(
                {"run": run.name, "faulty_steps": len(run.bad_steps), "critical": critical, "warning": warning}
            )
        say(
            f"seed {cfg.seed} run {i + 1}/{cfg.runs}: {len(hosts)} hosts, {run.steps} steps"
            + (f", on the bad host ({len(run.bad_steps)} faulty steps)" if on_bad else "")
            + (f"; bad host: {bad.verdict if bad else 'clean'}" if bad_host else "")
            + (f"; clean hosts suspect: {len(false_suspects)}" if false_suspects else "")
        )
    return {
        "seed": cfg.seed,
        "bad_host": bad_host,
        "runs_on_bad_host": touched,
        "suspect_after_runs": suspect_after,
        "quarantine_after_runs": quarantine_after,
        "false_suspects": sorted(false_suspects),
        "runs_alerting_on_bad_host": sum(1 for a in alerted if a["critical"]),
        "runs_warning_on_bad_host": sum(1 for a in alerted if a["warning"] and not a["critical"]),
        "per_run": alerted,
        "hosts": [v.to_dict() for v in pipe.hosts.verdicts(clock[0]) if v.verdict != "clean" or v.host == bad_host],
    }


def run_fleet(
    cfg: FleetConfig, seeds: int, say: Callable[[str], None] = lambda _: None, workers: int = 1
) -> dict[str, Any]:
    """``seeds`` fleets (seeds ``cfg.seed`` ...) and how they meet the targets; ``workers`` > 1
    runs them in that many processes (progress then per fleet)."""
    t0 = time.perf_counter()
    configs = [FleetConfig(**{**asdict(cfg), "seed": cfg.seed + s}) for s in range(seeds)]
    if workers > 1 and seeds > 1:
        with ProcessPoolExecutor(min(workers, seeds), mp_context=get_context("spawn")) as pool:
            rows = []
            for row in pool.map(run_seed, configs):
                say(
                    f"seed {row['seed']} done: bad host {row['bad_host']} suspect after {row['suspect_after_runs']} runs"
                )
                rows.append(row)
    else:
        rows = [run_seed(c, say) for c in configs]
    met = sum(
        1
        for r in rows
        if r["suspect_after_runs"] is not None
        and r["suspect_after_runs"] <= 5
        and r["quarantine_after_runs"] is not None
        and r["quarantine_after_runs"] <= 10
    )
    return {
        "config": asdict(cfg),
        "seeds": rows,
        "targets_met": met if cfg.bad else None,
        "false_suspects": sum(len(r["false_suspects"]) for r in rows),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def fleet_table(result: dict[str, Any]) -> str:
    """The per-seed table: runs on the bad host until suspect and quarantine, false suspects, and
    what per-run alerting alone said about the bad host."""
    lines = [
        f"{'seed':>4} {'bad host':9} {'runs on it':>10} {'suspect':>8} {'quarantine':>10} {'false':>5}  per-run alerting",
    ]
    for r in result["seeds"]:
        n = r["runs_on_bad_host"]
        lines.append(
            f"{r['seed']:>4} {r['bad_host'] or '-':9} {n:>10} {_after(r['suspect_after_runs']):>8} "
            f"{_after(r['quarantine_after_runs']):>10} {len(r['false_suspects']):>5}  "
            f"{r['runs_alerting_on_bad_host']} of {n} runs critical, {r['runs_warning_on_bad_host']} a warning only"
        )
    if result["targets_met"] is not None:
        lines.append(
            f"bad host suspect within 5 runs on it and quarantined within 10: {result['targets_met']} of "
            f"{len(result['seeds'])} seeds"
        )
    lines.append(f"clean hosts suspect, all seeds: {result['false_suspects']}  ({result['seconds']} s)")
    return "\n".join(lines)


def _after(n: int | None) -> str:
    return "never" if n is None else str(n)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sdcwatch bench fleet",
        description=(
            "A simulated cluster: runs scheduled onto random hosts, one host bad with rare, mostly sub-threshold "
            "faults, every step through the detection pipeline; prints per seed after how many runs on the bad "
            "host its ledger verdict was suspect and quarantine, the clean hosts ever suspect, and what per-run "
            "alerting alone said."
        ),
    )
    ap.add_argument("--seeds", type=int, default=10, help="fleets, seeds SEED..SEED+SEEDS-1 (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first fleet (default 0)")
    ap.add_argument("--hosts", type=int, default=64, help="hosts in the cluster (default 64)")
    ap.add_argument("--ranks-per-host", type=int, default=8, help="ranks (GPUs) per host (default 8)")
    ap.add_argument("--runs", type=int, default=40, help="runs per fleet (default 40)")
    ap.add_argument("--clean", action="store_true", help="no bad host: count the clean hosts ever suspect")
    ap.add_argument(
        "--transient-rate",
        type=float,
        default=FleetConfig.transient_rate,
        help="per run: the chance of a one-off flip above the bound on a random rank (default 0.1)",
    )
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2; 1: in this process)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    ap.add_argument("--out", help="also write the JSON result here")
    return ap


def fleet_main(argv: Sequence[str]) -> dict:
    """``sdcwatch bench fleet``; progress on stderr, the table (or ``--json``) on stdout."""
    args = _parser().parse_args(list(argv))
    cfg = FleetConfig(
        hosts=args.hosts,
        ranks_per_host=args.ranks_per_host,
        runs=args.runs,
        bad=not args.clean,
        seed=args.seed,
        transient_rate=args.transient_rate,
    )
    result = run_fleet(cfg, args.seeds, say=lambda msg: print(msg, file=sys.stderr, flush=True), workers=args.workers)
    result["command"] = "sdcwatch bench fleet " + " ".join(argv)
    text = json.dumps(result, indent=2, allow_nan=False)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    print(text if args.json else fleet_table(result))
    return result
