"""The fault-injection campaign: sdcwatch and the baselines scored on the same faulted training runs.
Owns its configuration (:class:`CampaignConfig`) and its run (:func:`run_campaign`): train to a
checkpoint, warm the detectors up, then run and score every trial's faulted branch and clean twin."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from sdcwatch.core.errors import ConfigError
from sdcwatch.testbed.campaign.branches import Branch, frames_of, new_run, run_branch
from sdcwatch.testbed.campaign.summary import summarise
from sdcwatch.testbed.campaign.targets import check_targets
from sdcwatch.testbed.campaign.fault_classes import BENIGN_CLASSES, FAULT_CLASSES
from sdcwatch.testbed.campaign.guarded import (
    MITIGATIONS,
    GuardedBranch,
    campaign_guard_config,
    check_guard_targets,
    guard_trial,
    mitigation_result,
    run_guarded_branch,
    summarise_guard,
)
from sdcwatch.testbed.campaign.impact import DRIFT_REL, SPIKE_REL, fault_visibility, impact_class
from sdcwatch.testbed.campaign.scoring import SdcwatchRunner, alarms_of, make_detectors, score_trial
from sdcwatch.testbed.campaign.trials import Trial, generate_trials, trials_from_faults

__all__ = ["CampaignConfig", "run_campaign"]


@dataclass(frozen=True)
class CampaignConfig:
    """Shape and budget of a campaign."""

    world: int = 8
    """Simulated data-parallel ranks."""
    trials: int = 169
    """Trials from the generator (ignored when faults come from a file: one trial per fault). The
    default, 13 per class, gives the clean twins 169 x 60 = 10,140 steps: the issue's false-alarm
    target asks for at least 10,000."""
    seed: int = 0
    """Seeds the model, the checkpoint run, the fault generator and the branches' data."""
    pretrain_steps: int = 150
    """Steps trained to the checkpoint; the detectors warm up on their records."""
    branch_steps: int = 60
    """Steps of each branch (faulted run and clean twin) after the checkpoint."""
    fault_offset: tuple[int, int] = (5, 15)
    """The generator starts each fault this many steps into the branch (inclusive range)."""
    window: int = 50
    """Localisation must happen within this many steps of the fault's first step."""
    batch_size: int = 4
    """Sequences per rank per step."""
    classes: tuple[str, ...] = FAULT_CLASSES
    """Fault classes the generator draws from, round-robin."""
    probes: str = "default"
    """Probe configuration of every simulated rank: a preset of :mod:`sdcwatch.telemetry.probes.presets`
    (``default``: what ``attach()`` gives a user; ``every-step``) or a JSON/TOML file of settings.
    The overhead benchmark takes the same names: detection and cost of one configuration."""
    wire: str | None = None
    """Send the records through this wire format (``v1``, ``v2``) and the service's decoder and
    aligner before detection; None: detect on the records as built."""
    parallel: str | None = None
    """A ``tp x pp x dp`` layout such as ``tp=2,pp=2,dp=4`` (:mod:`sdcwatch.testbed.parallel3d`):
    the ranks hold tensor and pipeline shards; ``world`` is then the layout's rank count. None:
    ``world`` data-parallel replicas."""

    def __post_init__(self) -> None:
        if self.parallel is not None:
            from sdcwatch.testbed.shard_plan import parse_layout

            layout = parse_layout(self.parallel)
            object.__setattr__(self, "parallel", str(layout))
            object.__setattr__(self, "world", layout.world)
        for key, lo in (
            ("world", 2),
            ("trials", 1),
            ("pretrain_steps", 1),
            ("branch_steps", 2),
            ("window", 1),
            ("batch_size", 1),
        ):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"campaign.{key}", f"must be an integer >= {lo}, got {v!r}")
        lo, hi = self.fault_offset
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi < self.branch_steps):
            raise ConfigError(
                "campaign.fault_offset",
                f"must be 0 <= lo <= hi < branch_steps ({self.branch_steps}), got {self.fault_offset!r}",
            )
        from sdcwatch.telemetry.probes.presets import probe_config

        probe_config(self.probes)  # a ConfigError naming an unknown preset or a bad file
        if self.wire not in (None, "v1", "v2"):
            raise ConfigError("campaign.wire", f"must be v1 or v2, got {self.wire!r}")
        unknown = [c for c in self.classes if c not in FAULT_CLASSES]
        if unknown or not self.classes:
            raise ConfigError(
                "campaign.classes", f"unknown or no fault class {unknown!r} (known: {', '.join(FAULT_CLASSES)})"
            )


def _progress(msg: str, stream: Any = None) -> None:
    print(msg, file=stream or sys.stderr, flush=True)


def run_campaign(
    config: CampaignConfig,
    faults: Sequence[Any] | None = None,
    *,
    detectors: Iterable[str] | None = None,
    workdir: str | Path | None = None,
    progress: Callable[[str], None] | None = _progress,
    guard: bool = False,
    mitigations: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the whole campaign; returns the JSON-ready result (``config``, ``checkpoint``, ``trials``, ``summary``).

    The reference model is trained once with W simulated data-parallel ranks to a checkpoint; every
    detector warms up on the records of that run. Then, per trial (:mod:`~sdcwatch.testbed.campaign.trials`),
    two branches start from the checkpoint with the same data (a data stream of their own, so trials
    do not repeat each other): the *faulted run*, with one fault injected, and its *clean twin*. The
    twin gives the ground truth (:func:`~sdcwatch.testbed.campaign.impact.impact_class`) and the false alarms;
    every detector sees both branches from the same warmed-up state
    (:func:`~sdcwatch.testbed.campaign.scoring.score_trial`).

    With ``guard``, every trial runs three ways (see :mod:`sdcwatch.testbed.campaign.guarded`): the clean twin
    and a third branch run guarded, and the result gains ``guard_summary`` and ``guard_targets``.
    ``mitigations`` (of :data:`~sdcwatch.testbed.campaign.guarded.MITIGATIONS`, with ``guard``): the
    trials of the benign and spike classes run guarded once more per spike mitigation (the arm).
    """
    import torch

    torch.set_num_threads(1)
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    bad = [m for m in mitigations if m not in MITIGATIONS]
    if bad or (mitigations and not guard):
        raise ConfigError("campaign.mitigations", f"need the guard and one of {', '.join(MITIGATIONS)}, got {bad!r}")
    trials = trials_from_faults(faults, config) if faults is not None else generate_trials(config)
    runners = make_detectors(detectors)

    with tempfile.TemporaryDirectory(prefix="sdcwatch-campaign-", dir=workdir) as tmp:
        start = _train_to_checkpoint(config, Path(tmp) / "checkpoint.pt", guard, say)
        checkpoint = _warm_up(config, start, runners)
        say(
            f"campaign: checkpoint at step {config.pretrain_steps} (loss {start.losses[-1]:.3f}) in "
            f"{checkpoint['seconds']:.0f}s; {len(trials)} trials of {config.branch_steps} steps x {3 if guard else 2} "
            f"branches"
        )
        loop = _guard_loop(start) if guard else None
        results = []
        t_trials = time.perf_counter()
        for i, trial in enumerate(trials):
            results.append(_run_trial(config, start, trial, runners, loop, say, tuple(mitigations)))
            say(_trial_line(trial, results[-1], i + 1, len(trials), time.perf_counter() - t_trials))
    result = _campaign_result(config, faults, checkpoint, results, [r.name for r in runners], guard, t_start)
    if mitigations:
        result["config"]["guard_mitigations"] = list(mitigations)
    return result


@dataclass
class _Checkpoint:
    """The run to the checkpoint: where the checkpoint is, the parameters there, the run's frames
    (what the detectors warm up on) and losses, and when it started."""

    path: Path
    theta0: Any
    frames: list
    losses: list[float]
    started: float


def _report_guard() -> Any:
    from sdcwatch.telemetry.guard.config import GuardConfig

    return GuardConfig()


def _train_to_checkpoint(config: CampaignConfig, path: Path, guard: bool, say: Callable[[str], None]) -> _Checkpoint:
    """Train ``config.pretrain_steps`` steps from scratch and save the checkpoint every branch starts from."""
    import torch

    shape = f" ({config.parallel})" if config.parallel else ""
    say(f"campaign: training {config.world} simulated ranks{shape} for {config.pretrain_steps} steps to the checkpoint")
    t0 = time.perf_counter()
    records: list = []
    # with the guard, the checkpoint carries its baselines (learnt in report mode: nothing changes)
    run = new_run(config, (), records, "campaign", guard=_report_guard() if guard else None)
    try:
        losses = run.train(config.pretrain_steps)
        run.save_checkpoint(path)  # flushes the last record
        theta0 = torch.cat([p.detach().reshape(-1) for p in run.params]).clone()
    finally:
        run.close()
    return _Checkpoint(path, theta0, frames_of(records, config.world, config.wire), losses, t0)


def _warm_up(config: CampaignConfig, start: _Checkpoint, runners: Sequence[Any]) -> dict[str, Any]:
    """Every detector learns on the checkpoint run's frames; what the result says of the checkpoint."""
    warm_alarms = {r.name: len(alarms_of(r, start.frames)) for r in runners}
    return {
        "step": config.pretrain_steps,
        "seconds": round(time.perf_counter() - start.started, 2),
        "loss_first": start.losses[0],
        "loss_last": start.losses[-1],
        "alarms_during_warmup": warm_alarms,
    }


def _guard_loop(start: _Checkpoint) -> SdcwatchRunner:
    """The service in the loop of the guarded branches, warmed up like the other detectors."""
    loop = SdcwatchRunner()
    alarms_of(loop, start.frames)
    return loop


def _run_trial(
    config: CampaignConfig,
    start: _Checkpoint,
    trial: Trial,
    runners: Sequence[Any],
    loop: SdcwatchRunner | None,
    say: Callable[[str], None],
    mitigations: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One trial's row of the result: its faulted run and clean twin from the checkpoint, the ground
    truth and every detector's verdict; with the guard's ``loop``, the faulted run again, guarded."""
    fault = replace(trial.fault, step=trial.fault.step + config.pretrain_steps)
    faulted = run_branch(config, start.path, [fault], trial.data_seed)
    twin: Branch | GuardedBranch
    if loop is not None:  # the twin runs guarded too: any action on it is a false action
        twin = run_guarded_branch(config, start.path, [], trial.data_seed, loop, run_id="campaign")
    else:
        twin = run_branch(config, start.path, [], trial.data_seed)
    row = {
        "index": trial.index,
        "class": trial.fault_class,
        "fault": fault.to_dict(),
        "fault_step": fault.step,
        "culprit_rank": trial.culprit,
        "data_seed": trial.data_seed,
        "impact": impact_class(faulted, twin, start.theta0),
        "visibility": fault_visibility(fault, faulted),
        "clean_steps": len(twin.frames),
        "detectors": _verdicts(config, trial, fault.step, runners, faulted, twin),
    }
    if loop is not None:
        row["guard"] = _guarded_run(config, start, trial, fault, faulted, twin, loop, say)
        if mitigations and trial.fault_class in BENIGN_CLASSES:
            row["guard"]["mitigated"] = _mitigated_runs(config, start, trial, fault, twin, loop, say, mitigations)
    return row


def _verdicts(
    config: CampaignConfig, trial: Trial, fault_step: int, runners: Sequence[Any], faulted: Branch, twin: Any
) -> dict[str, dict[str, Any]]:
    """Each detector's verdict on the trial, each branch seen by a fork of its warmed-up state."""
    verdicts = {}
    for r in runners:
        f_alarms = alarms_of(r.fork(), faulted.frames)
        c_alarms = alarms_of(r.fork(), twin.frames)
        verdicts[r.name] = score_trial(trial, fault_step, f_alarms, c_alarms, config.window, config.world)
    return verdicts


def _guarded_run(
    config: CampaignConfig,
    start: _Checkpoint,
    trial: Trial,
    fault: Any,
    faulted: Branch,
    twin: GuardedBranch,
    loop: SdcwatchRunner,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The faulted run again with the guard and the loop: what the guard saved on the trial."""
    guarded = run_guarded_branch(config, start.path, [fault], trial.data_seed, loop)
    g = guard_trial(trial, trial.fault.step, faulted, twin, guarded, start.theta0, config.window)
    say(
        f"campaign:   guarded: {', '.join(a['action'] + '@' + str(a['step']) for a in g['actions']) or 'no action'}"
        f"; final loss excess {g['final_excess']['faulted']} -> {g['final_excess']['guarded']}, "
        f"drift {g['drift']['faulted']} -> {g['drift']['guarded']}"
    )
    return g


def _mitigated_runs(
    config: CampaignConfig,
    start: _Checkpoint,
    trial: Trial,
    fault: Any,
    twin: GuardedBranch,
    loop: SdcwatchRunner,
    say: Callable[[str], None],
    mitigations: tuple[str, ...],
) -> dict[str, Any]:
    """The mitigation arm: the guarded run again with each spike mitigation on, against the twin."""
    out = {}
    for m in mitigations:
        guard = campaign_guard_config(m)
        branch = run_guarded_branch(config, start.path, [fault], trial.data_seed, loop, guard=guard)
        out[m] = mitigation_result(twin, branch, start.theta0)
        say(
            f"campaign:   mitigated ({m}): {out[m]['mitigations']} mitigation(s); final loss excess {out[m]['final_excess']}"
        )
    return out


def _trial_line(trial: Trial, row: dict[str, Any], done: int, total: int, seconds: float) -> str:
    """The progress line of a finished trial, with sdcwatch's verdict and the time left."""
    rate = seconds / done
    sw = row["detectors"].get("sdcwatch")
    note = (
        ""
        if sw is None
        else f" sdcwatch: {'detected' if sw['detected'] else 'missed'}"
        + (f" at +{sw['delay']}" if sw["detected"] else "")
        + (f", rank {sw['localized_rank']}" if sw["localized_rank"] is not None else "")
    )
    return (
        f"campaign: trial {done}/{total} {trial.fault_class} rank={trial.fault.rank} -> {row['impact']['class']};"
        f"{note} (eta {rate * (total - done):.0f}s)"
    )


def _campaign_result(
    config: CampaignConfig,
    faults: Sequence[Any] | None,
    checkpoint: dict[str, Any],
    results: list[dict[str, Any]],
    names: list[str],
    guard: bool,
    t_start: float,
) -> dict[str, Any]:
    """The JSON-ready result: the trials' rows, their summary and the targets (the guard's too)."""
    summary = summarise(results, names)
    extra: dict[str, Any] = {}
    if guard:
        extra = {
            "guard_summary": summarise_guard(results),
            "guard_targets": check_guard_targets(results),
        }
    return {
        "config": {
            **asdict(config),
            "spike_rel": SPIKE_REL,
            "drift_rel": DRIFT_REL,
            "faults_from_file": faults is not None,
        },
        "checkpoint": checkpoint,
        "trials": results,
        "summary": summary,
        "targets": check_targets(results, summary) if "sdcwatch" in summary.get("all", {}) else [],
        **extra,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
