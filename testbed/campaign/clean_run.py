"""False alarms on clean training: long fault-free runs through the campaign's detectors.

The campaign (:mod:`sdcwatch.testbed.campaign.run`) counts false alarms on the clean twins of its
trials: short branches (60 steps) from one checkpoint, each paid for with a faulted branch
beside it, and never the first steps of training, where the detectors warm up on the
checkpoint run's records. A false-alarm target of 10,000 clean steps costs it 169 trials.

Here every run is clean and starts from step 0: a fresh model and data stream per seed, the same
simulated ranks, probe configuration and detectors as the campaign (sdcwatch's default pipeline,
warning and critical incidents apart from timing ones; the baselines' findings), fed one step at a
time as the run goes, so memory stays flat however long the run. The steps are split over
``runs`` seeds (``seed``, ``seed + 1``, ...) run by ``workers`` processes. Every alarm is
reported with its detector, kind, step, run seed, the ranks it names and its message, with the
ranks' losses at the step it was raised and ``loss_excess``, the global loss there over the median
of the nine steps before, minus one: a clean run is free of faults, not of hard batches, and a
rise of 10% or more is what the campaign calls a ``spike`` (there measured against the twin). Alarms in the first
:data:`WARMUP_REGION` steps (the campaign's checkpoint run, where its detectors only learn) are
counted apart as well as in the total, since the campaign never scores that region.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from statistics import median
from typing import Any, Callable, Sequence

from sdcwatch.core.errors import ConfigError

__all__ = [
    "CleanRunConfig",
    "WARMUP_REGION",
    "LISTED",
    "run_clean",
    "run_one_seed",
    "listed_alarms",
    "summarise_clean",
    "clean_table",
]

WARMUP_REGION = 150
"""Steps of the campaign's checkpoint run (``CampaignConfig.pretrain_steps``): the region the
campaign's clean twins never cover. Alarms there are counted in the total and also apart."""
LISTED = 20
"""Alarms of each baseline listed per run (all are counted; sdcwatch's are all listed)."""


@dataclass(frozen=True)
class CleanRunConfig:
    """Shape and budget of a clean-steps measurement."""

    steps: int = 10_000
    """Clean steps in all (every step is one aligned frame of every rank), split over the runs."""
    runs: int = 4
    """Independent runs (seeds ``seed`` .. ``seed + runs - 1``), each from step 0."""
    seed: int = 0
    """Seed of the first run: model initialisation and data stream."""
    workers: int = 2
    """Processes the runs are spread over (1: in this process)."""
    world: int = 8
    """Simulated data-parallel ranks (ignored with ``parallel``: the layout's rank count)."""
    batch_size: int = 4
    """Sequences per rank per step (the campaign's default)."""
    probes: str = "default"
    """Probe configuration: a preset name or a JSON/TOML file, as ``bench campaign --probes``."""
    parallel: str | None = None
    """A ``tp x pp x dp`` layout such as ``tp=2,pp=2,dp=4`` (:mod:`sdcwatch.testbed.parallel3d`)."""
    wire: str | None = None
    """Send the records through this wire format and the service's decoder before detection."""
    detectors: tuple[str, ...] | None = None
    """Detectors to run (default: sdcwatch and every baseline, as the campaign)."""
    progress_every: float = 30.0
    """Seconds between progress lines of a run on stderr."""

    def __post_init__(self) -> None:
        for key, lo in (("steps", 1), ("runs", 1), ("workers", 1), ("world", 2), ("batch_size", 1)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"clean.{key}", f"must be an integer >= {lo}, got {v!r}")
        if self.runs > self.steps:
            raise ConfigError(
                "clean.runs", f"{self.runs} runs cannot share {self.steps} steps (one step each at least)"
            )
        self.campaign_config(self.seed)  # the campaign's own checks: probes, layout, wire
        if self.detectors is not None:
            from sdcwatch.testbed.campaign.scoring import make_detectors

            make_detectors(self.detectors)  # a ConfigError naming an unknown detector

    def campaign_config(self, seed: int) -> Any:
        """The campaign configuration that builds one run of this measurement."""
        from sdcwatch.testbed.campaign.run import CampaignConfig

        return CampaignConfig(
            world=self.world,
            seed=seed,
            batch_size=self.batch_size,
            probes=self.probes,
            parallel=self.parallel,
            wire=self.wire,
        )

    def plan(self) -> list[tuple[int, int]]:
        """(seed, steps) of each run: the steps split as evenly as they go, the first runs longer."""
        per, extra = divmod(self.steps, self.runs)
        return [(self.seed + i, per + (1 if i < extra else 0)) for i in range(self.runs)]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_one_seed(
    config: CleanRunConfig,
    seed: int,
    steps: int,
    progress: Callable[[str], None] | None = _say,
    *,
    faults: Sequence[Any] = (),
) -> dict[str, Any]:
    """One clean run of ``steps`` steps from step 0 with ``seed``, every step fed to the detectors
    as soon as every rank's record of it is in; the alarms and what was counted.

    ``faults`` (injector specs, steps from 0) make it a positive control: the same counting, with
    alarms that must appear."""
    import torch
    from sdcwatch.testbed.campaign.branches import new_run
    from sdcwatch.testbed.campaign.scoring import make_detectors

    torch.set_num_threads(1)
    say = progress or (lambda msg: None)
    cc = config.campaign_config(seed)
    feed = _StepFeed(make_detectors(config.detectors), seed, cc.world, cc.wire)
    t0 = last = time.perf_counter()

    def on_step(step: int, run: Any) -> None:
        nonlocal last
        feed(step)  # a step's records are all in by the end of the next step
        now = time.perf_counter()
        if now - last >= config.progress_every:
            last = now
            rate = (step + 1) / (now - t0)
            mine = sum(1 for a in feed.alarms if a["detector"] == "sdcwatch")
            say(
                f"clean: seed {seed}: step {step + 1}/{steps}, loss {run.history[-1]:.3f}, "
                f"{mine} sdcwatch alarm(s), {rate:.1f} steps/s, eta {(steps - step - 1) / rate:.0f}s"
            )

    run = new_run(cc, faults, feed.records, f"clean-{seed}")
    try:
        losses = run.train(steps, on_step=on_step)
    finally:
        run.close()  # emits the last step's records
    feed(None)
    seconds = time.perf_counter() - t0
    mine = sum(a["detector"] == "sdcwatch" for a in feed.alarms)
    say(f"clean: seed {seed}: {steps} steps in {seconds:.0f}s, {mine} sdcwatch alarm(s)")
    return {
        "seed": seed,
        "steps": steps,
        "clean_steps": feed.frames,
        "incomplete_frames": feed.incomplete,
        "seconds": round(seconds, 1),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        **listed_alarms(feed.alarms),
    }


class _StepFeed:
    """A clean run's records fed to the detectors step by step, as the run goes (memory stays flat):
    the frames counted and every alarm, with the ranks' losses at the step it was raised."""

    def __init__(self, runners: list[Any], seed: int, world: int, wire: str | None) -> None:
        self.runners, self.seed, self.world, self.wire = runners, seed, world, wire
        self.records: list = []
        self.alarms: list[dict[str, Any]] = []
        self.frames = 0
        self.incomplete = 0
        self.recent: deque[float] = deque(maxlen=9)  # the last global losses: how far a step's loss stood above them

    def __call__(self, upto: int | None) -> None:
        """Detect on every step before ``upto`` (all of them when None) whose records are in."""
        from sdcwatch.testbed.campaign.branches import frames_of

        records = self.records
        ready = [r for r in records if upto is None or r.step < upto]
        if not ready:
            return
        records[:] = [r for r in records if not (upto is None or r.step < upto)]
        for frame in frames_of(ready, self.world, self.wire):
            self.frames += 1
            if int(frame.present.sum()) < self.world:
                self.incomplete += 1
            losses = frame.scalar("loss")
            losses = [] if losses is None else [float(x) for x in losses]
            finite = [x for x in losses if math.isfinite(x)]
            loss = sum(finite) / len(finite) if finite else math.nan
            excess = loss / median(self.recent) - 1 if self.recent and math.isfinite(loss) else None
            if math.isfinite(loss):
                self.recent.append(loss)
            for runner in self.runners:
                for a in runner.feed(frame):
                    self.alarms.append(self._alarm(runner.name, a, frame.step, losses, excess))

    def _alarm(self, detector: str, a: Any, frame_step: int, losses: list[float], excess: float | None) -> dict:
        return {
            "detector": detector,
            "seed": self.seed,
            "step": a.step,
            "kind": a.kind,
            "ranks": list(a.ranks),
            "attribution": a.attribution,
            "message": a.message,
            "frame_step": frame_step,
            "loss_by_rank": [None if not math.isfinite(x) else round(float(x), 4) for x in losses],
            "loss_excess": None if excess is None else round(excess, 4),
        }


def listed_alarms(alarms: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's alarms as ``counts`` (per detector: by kind, in the warm-up region, blaming a rank)
    and ``alarms``: every alarm of sdcwatch, the first :data:`LISTED` of each baseline (a noisy
    baseline raises thousands over a long run: the counts keep them, the list would not be read)."""
    counts: dict[str, dict[str, Any]] = {}
    listed = []
    for a in alarms:
        c = counts.setdefault(
            a["detector"], {"false_alarms": 0, "by_kind": {}, "in_warmup_region": 0, "blamed_a_rank": 0}
        )
        c["false_alarms"] += 1
        c["by_kind"][a["kind"]] = c["by_kind"].get(a["kind"], 0) + 1
        c["in_warmup_region"] += a["step"] < WARMUP_REGION
        c["blamed_a_rank"] += a["attribution"] == "sdc"
        if a["detector"] == "sdcwatch" or c["false_alarms"] <= LISTED:
            listed.append(a)
    return {"counts": counts, "alarms": listed}


def run_clean(
    config: CleanRunConfig,
    progress: Callable[[str], None] | None = _say,
    on_run: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The whole measurement; returns the JSON-ready result (``config``, ``runs``, ``summary``).

    ``on_run(result)`` is called as each run finishes with the result so far (``complete`` False
    until the last): a long measurement cut short still leaves what it counted.
    """
    say = progress or (lambda msg: None)
    plan = config.plan()
    names = [r.name for r in _detectors(config)]
    t0 = time.perf_counter()
    say(
        f"clean: {config.steps} clean steps as {len(plan)} run(s) of {plan[0][1]} steps from step 0, "
        f"{config.campaign_config(config.seed).world} simulated ranks"
        + (f" ({config.parallel})" if config.parallel else "")
        + f", probes {config.probes}, {min(config.workers, len(plan))} worker process(es)"
    )
    done: list[dict[str, Any]] = []

    def finished(run: dict[str, Any]) -> dict[str, Any]:
        done.append(run)
        result = _result(config, sorted(done, key=lambda r: r["seed"]), names, t0, complete=len(done) == len(plan))
        s = result["summary"].get("sdcwatch")
        if s is not None:
            say(
                f"clean: {len(done)}/{len(plan)} runs done: sdcwatch {s['false_alarms']} alarm(s) in {s['clean_steps']} steps"
            )
        if on_run is not None:
            on_run(result)
        return result

    result: dict[str, Any] = {}
    if config.workers == 1 or len(plan) == 1:
        for seed, steps in plan:
            result = finished(run_one_seed(config, seed, steps, progress))
    else:
        # spawn: a fresh interpreter per worker (torch and forked threads do not mix)
        with ProcessPoolExecutor(max_workers=min(config.workers, len(plan)), mp_context=get_context("spawn")) as pool:
            said = _say if progress is not None else None  # a worker prints its own progress on stderr
            futures = [pool.submit(run_one_seed, config, seed, steps, said) for seed, steps in plan]
            for f in as_completed(futures):
                result = finished(f.result())  # a worker's error surfaces here, not after the others finish
    return result


def _result(
    config: CleanRunConfig, runs: list[dict[str, Any]], names: list[str], t0: float, *, complete: bool
) -> dict[str, Any]:
    summary = summarise_clean(runs, names)
    mine = summary.get("sdcwatch")
    return {
        "config": asdict(config),
        "complete": complete,
        "warmup_region": WARMUP_REGION,
        "runs": runs,
        "summary": summary,
        "target": {
            "target": "zero false alarms over >= 10,000 clean steps",
            "count": None if mine is None else f"{mine['false_alarms']} in {mine['clean_steps']}",
            "met": mine is not None and mine["false_alarms"] == 0 and mine["clean_steps"] >= 10_000,
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _detectors(config: CleanRunConfig) -> list[Any]:
    from sdcwatch.testbed.campaign.scoring import make_detectors

    return make_detectors(config.detectors)


def summarise_clean(runs: list[dict[str, Any]], detectors: list[str]) -> dict[str, Any]:
    """Per detector: clean steps, false alarms (by kind, and in the warm-up region), per 1,000 steps."""
    clean = sum(r["clean_steps"] for r in runs)
    out = {}
    for d in detectors:
        per_run = [r["counts"].get(d) for r in runs if r["counts"].get(d)]
        by_kind: dict[str, int] = {}
        for c in per_run:
            for kind, n in c["by_kind"].items():
                by_kind[kind] = by_kind.get(kind, 0) + n
        n = sum(c["false_alarms"] for c in per_run)
        out[d] = {
            "clean_steps": clean,
            "false_alarms": n,
            "by_kind": by_kind,
            "in_warmup_region": sum(c["in_warmup_region"] for c in per_run),
            "blamed_a_rank": sum(c["blamed_a_rank"] for c in per_run),
            "per_1k_clean_steps": 1000 * n / clean if clean else None,
        }
    return out


def clean_table(result: dict[str, Any]) -> str:
    """The summary as a markdown table, then one line per sdcwatch alarm."""
    lines = [
        "| detector | clean steps | false alarms | by kind | in the first "
        f"{result['warmup_region']} steps | blamed a rank | per 1k clean steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, s in result["summary"].items():
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(s["by_kind"].items())) or "–"
        per = "–" if s["per_1k_clean_steps"] is None else f"{s['per_1k_clean_steps']:.2f}"
        lines.append(
            f"| {d} | {s['clean_steps']} | {s['false_alarms']} | {kinds} | {s['in_warmup_region']} | "
            f"{s['blamed_a_rank']} | {per} |"
        )
    for r in result["runs"]:
        for a in r["alarms"]:
            if a["detector"] == "sdcwatch":
                lines.append(
                    f"- seed {a['seed']} step {a['step']}: {a['kind']} ranks {a['ranks'] or '-'}: {a['message']}"
                )
    return "\n".join(lines)
