"""The campaign's third way: the faulted run again, with the guard and the whole loop, and the damage saved.

``sdcwatch bench campaign --guard`` runs every trial three ways from the same checkpoint: the clean
twin (guarded too: any action on it is a false action), the faulted run (unguarded, as in the
detection campaign) and the faulted run with the guard. The guarded branches close the loop in
process: each completed step's frame goes through a forked, warmed-up copy of the default
detection pipeline, the incidents through :class:`~sdcwatch.service.control_policy.ControlPolicy` (every
action on), the decisions into the guard's control reader, and the ranks act on them at the next
step boundary. An eviction is followed by what a launcher does: the evicted rank gets healthy
hardware, the job restarts from the last snapshot before the incident and goes on.

A guarded branch runs until it has trained on the same data as the twin (a rollback replays data),
so it may take more steps: those are the *steps spent*. Per trial:

* ``final_excess``: relative excess of the final loss over the twin's (same batches), unguarded and guarded;
* ``drift``: ``max_r ||θ^r - θ_c|| / ||θ_c - θ_0||`` at the end, unguarded and guarded;
* ``actions``: what the guard did (``{step, action, ranks, reason, verdict}``), ``steps_spent`` (extra
  steps after rollbacks and restarts) and ``reruns`` (extra forward/backward passes);
* ``verdict`` / ``verdict_right``: the first rerun verdict at or after the fault against the ground
  truth of the fault's class (:data:`EXPECTED_VERDICT`);
* ``evicted_rank`` / ``evicted_after``: the first eviction and its delay from the fault's first step;
* ``mitigated`` (benign and spike classes, with ``--guard-mitigations``): the guarded run again with
  each ``spike_mitigation`` variant on, its final loss excess and drift against the same twin.

:func:`run_clean_guarded` trains one long clean run with the whole loop closed (the shipped guard's
false actions over many steps: ``bench/guard_clean_steps.py``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any, Sequence

from sdcwatch.testbed.campaign.branches import RecordCollector, flat_params
from sdcwatch.testbed.campaign.fault_classes import BENIGN_CLASSES, HARDWARE_CLASSES
from sdcwatch.testbed.campaign.impact import json_number

__all__ = [
    "EXPECTED_VERDICT",
    "GuardedBranch",
    "run_guarded_branch",
    "guard_trial",
    "summarise_guard",
    "check_guard_targets",
    "guard_table",
    "campaign_guard_config",
    "MITIGATIONS",
    "mitigation_result",
    "run_clean_guarded",
]

#: Ground truth for a rerun's verdict, by fault class: a one-off corruption of a value does not
#: repeat (transient); an unhealthy unit or a corrupted replica repeats on that rank only
#: (persistent); bad data and a learning-rate spike repeat wherever they are computed (data).
EXPECTED_VERDICT = {
    **{c: "transient" for c in HARDWARE_CLASSES[: HARDWARE_CLASSES.index("unhealthy_node")]},
    "unhealthy_node": "persistent",
    "param_bitflip": "persistent",
    "nonfinite_stream": "transient",
    "bitflip_container": "transient",
    "param_bitflip_mantissa": "persistent",
    **{c: "data" for c in BENIGN_CLASSES},
}
_VERDICTS = ("transient", "persistent", "data", "reproducible")
#: The spike mitigations the campaign's mitigation arm can measure (``GuardConfig.spike_mitigation``).
MITIGATIONS = ("lr", "clip", "lr+clip")


def campaign_guard_config(spike_mitigation: str = "none") -> Any:
    """The guard the campaign measures: the default settings with actions on (and, for the
    mitigation arm, a ``spike_mitigation`` other than the default)."""
    from sdcwatch.telemetry.guard.config import GuardConfig

    if spike_mitigation == "none":
        return GuardConfig(mode="act")
    return GuardConfig(mode="act", spike_mitigation=spike_mitigation)


@dataclass
class GuardedBranch:
    """A guarded branch: what :class:`~sdcwatch.testbed.campaign.branches.Branch` holds, plus what the guard did."""

    frames: list
    losses: list[float]
    params: list[Any]
    seconds: float
    actions: list[dict[str, Any]] = field(default_factory=list)
    reruns: int = 0
    steps_run: int = 0
    evictions: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    finished: bool = True


class _InProcessLoop:
    """The loop of a guarded branch in process: the ranks' records, once a step's are complete, as a
    frame through a forked copy of the warmed-up pipeline; its incidents through the control policy
    (every action on) into the control reader the guard acts on."""

    def __init__(self, runner: Any, run_id: str, world: int) -> None:
        from sdcwatch.exporters.topics import ControlTopicSink
        from sdcwatch.service.control_policy import ControlPolicy
        from sdcwatch.telemetry.guard.control_topic import MemoryControl

        self.run_id, self.world = run_id, world
        self.records: list = []
        self.control = MemoryControl()
        self.pipeline = runner.fork().pipeline
        # decisions handed to the in-process control topic, none sent to a broker
        self.sink = ControlTopicSink(
            lambda key, value: None, policy=ControlPolicy(actions=True), deliver=self.control.put
        )
        self.frames: list = []
        self._pending: dict[int, list] = {}

    def emitter(self, rank: int, host: str = "") -> RecordCollector:
        """A rank's emitter: its records join the loop's."""
        return RecordCollector(self.records, run=self.run_id, rank=rank, world=self.world, host=host)

    def feed(self, upto: int) -> None:
        """Detect on every step up to ``upto`` whose records are in, and publish what the policy decides."""
        from sdcwatch.detectors.frame import StepFrame

        for rec in self.records:
            self._pending.setdefault(rec.step, []).append(rec)
        del self.records[:]  # the ranks' collectors share this list: consumed records go (long runs)
        for s in sorted(k for k in self._pending if k <= upto):
            frame = StepFrame.from_records(self.run_id, s, self.world, self._pending.pop(s))
            self.frames.append(frame)
            for ev in self.pipeline.process_frame(frame):
                self.sink.publish(ev)


def run_guarded_branch(
    config: Any,
    checkpoint: Path,
    faults: Sequence[Any],
    data_seed: int,
    runner: Any,
    run_id: str = "campaign-guarded",
    max_factor: int = 3,
    guard: Any = None,
) -> GuardedBranch:
    """Run the branch with the guard and the in-process loop until it has trained on the twin's data.

    ``runner`` is a warmed-up sdcwatch campaign runner (forked here, so every branch starts from the
    same detection state). At most ``max_factor * branch_steps`` steps are run. ``guard``: the guard's
    settings (default :func:`campaign_guard_config`).
    """
    from sdcwatch.testbed.simulated import SimulatedRun

    t0 = time.perf_counter()
    loop = _InProcessLoop(runner, run_id, config.world)
    run = SimulatedRun(
        config.world,
        seed=config.seed,
        faults=faults,
        emitter_factory=loop.emitter,
        batch_size=config.batch_size,
        guard=guard if guard is not None else campaign_guard_config(),
        control=loop.control,
    )
    try:
        run.load_checkpoint(checkpoint)
        run.seed = data_seed
        first = run.step
        end = run.data_pos + config.branch_steps
        evictions = _train_on_the_twins_data(run, loop, end, first + max_factor * config.branch_steps)
        finished = run.data_pos >= end
        params = flat_params(run)
        steps_run = run.step - first
        actions = [
            {**a.to_dict(), "step": a.step - config.pretrain_steps} for a in run.guard.actions if a.action != "none"
        ]
        reruns = run.guard.reruns
        losses = list(run.history[-config.branch_steps :])
    finally:
        run.close()
    loop.feed(1 << 62)
    return GuardedBranch(
        loop.frames,
        losses,
        params,
        time.perf_counter() - t0,
        actions,
        reruns,
        steps_run,
        [(s - config.pretrain_steps, r) for s, r in evictions],
        finished,
    )


def _train_on_the_twins_data(run: Any, loop: _InProcessLoop, end: int, limit: int) -> list[tuple[int, tuple[int, ...]]]:
    """Train step by step until the data position reaches ``end`` (a rollback replays data) or the
    step ``limit``; an eviction is followed by what a launcher does. Returns the evictions."""
    from sdcwatch.telemetry.guard.config import GuardEviction

    evictions: list[tuple[int, tuple[int, ...]]] = []
    while run.data_pos < end and run.step < limit:
        try:
            # records of step s are complete once step s + 1 ran (the probes read one step late)
            run.train(1, on_step=lambda step, _run: loop.feed(step - 1))
        except GuardEviction as ev:  # what a launcher does: restart without the node, from a snapshot
            evictions.append((ev.step, tuple(ev.ranks)))
            run.replace_ranks(ev.ranks)
            pos = run.guard.restore(ev.since_step, ev.ranks)
            if pos is not None:
                run.data_pos = pos
    return evictions


def _drift(params: Sequence[Any], twin: Any, theta0: Any) -> float:
    import torch

    if not all(bool(torch.isfinite(p).all()) for p in params):
        return math.inf
    motion = float(torch.linalg.vector_norm(twin.params[0] - theta0))
    return max(float(torch.linalg.vector_norm(p - twin.params[0])) for p in params) / max(motion, 1e-30)


def _excess(loss: float, ref: float) -> float:
    return (loss - ref) / ref if math.isfinite(loss) else math.inf


def guard_trial(
    trial: Any, fault_step: int, faulted: Any, twin: GuardedBranch, guarded: GuardedBranch, theta0: Any, window: int
) -> dict[str, Any]:
    """What the guard saved on one trial (see the module docstring); ``fault_step`` counts from the checkpoint."""
    rel = fault_step
    verdicts = [a for a in guarded.actions if a["verdict"] in _VERDICTS and a["step"] >= rel]
    verdict = verdicts[0]["verdict"] if verdicts else None
    expected = EXPECTED_VERDICT.get(trial.fault_class)
    ev = next(((s, r) for s, r in guarded.evictions if s >= rel), None)
    return {
        "final_loss": {
            "twin": json_number(twin.losses[-1]),
            "faulted": json_number(faulted.losses[-1]),
            "guarded": json_number(guarded.losses[-1]) if guarded.losses else None,
        },
        "final_excess": {
            "faulted": json_number(_excess(faulted.losses[-1], twin.losses[-1])),
            "guarded": json_number(_excess(guarded.losses[-1], twin.losses[-1])),
        },
        "drift": {
            "faulted": json_number(_drift(faulted.params, twin, theta0)),
            "guarded": json_number(_drift(guarded.params, twin, theta0)),
        },
        "actions": guarded.actions,
        "twin_actions": twin.actions,
        "steps_spent": guarded.steps_run - len(twin.losses),
        "reruns": guarded.reruns,
        "finished": guarded.finished,
        "verdict": verdict,
        "expected_verdict": expected,
        "verdict_right": None if verdict is None else verdict == expected,
        "evicted_rank": ev[1][0] if ev else None,
        "evicted_after": ev[0] - rel if ev else None,
        "evicted_in_window": bool(ev and ev[0] - rel <= window and ev[1] == (trial.fault.rank,)),
        "seconds": round(twin.seconds + guarded.seconds, 2),
    }


def mitigation_result(twin: GuardedBranch, mitigated: GuardedBranch, theta0: Any) -> dict[str, Any]:
    """The mitigation arm of one trial: the guarded run with a ``spike_mitigation`` on, against the twin."""
    return {
        "final_loss": json_number(mitigated.losses[-1]) if mitigated.losses else None,
        "final_excess": json_number(_excess(mitigated.losses[-1], twin.losses[-1])) if mitigated.losses else None,
        "drift": json_number(_drift(mitigated.params, twin, theta0)),
        "actions": mitigated.actions,
        "mitigations": sum(1 for a in mitigated.actions if a.get("mitigation")),
        "reruns": mitigated.reruns,
        "finished": mitigated.finished,
    }


def run_clean_guarded(
    config: Any,
    checkpoint: Path,
    data_seed: int,
    runner: Any,
    steps: int,
    *,
    guard: Any = None,
    chunk: int = 500,
    progress: Any = None,
) -> dict[str, Any]:
    """Train ``steps`` clean steps from ``checkpoint`` with the guard (default: the campaign's, as
    shipped with actions on) and the whole loop closed: every action is a false one. Returns the
    actions, the steps, the losses at the ends and the time; ``progress(dict)`` after every ``chunk``."""
    from sdcwatch.testbed.simulated import SimulatedRun

    t0 = time.perf_counter()
    loop = _InProcessLoop(runner, "clean-guarded", config.world)
    run = SimulatedRun(
        config.world,
        seed=config.seed,
        emitter_factory=loop.emitter,
        batch_size=config.batch_size,
        guard=guard if guard is not None else campaign_guard_config(),
        control=loop.control,
    )
    evictions: list[tuple[int, tuple[int, ...]]] = []
    frames = 0
    try:
        run.load_checkpoint(checkpoint)
        run.seed = data_seed
        first, end, start_loss = run.step, run.data_pos + steps, run.history[-1]
        while run.data_pos < end:
            evictions += _train_on_the_twins_data(run, loop, min(end, run.data_pos + chunk), first + 3 * steps)
            frames += len(loop.frames)
            loop.frames.clear()  # the detection state lives in the pipeline; frames are not kept
            if progress is not None:
                progress(_clean_state(run, first, frames, evictions, t0))
            if run.step >= first + 3 * steps:
                break
    finally:
        run.close()  # flushes the last step's records
    loop.feed(1 << 62)
    frames += len(loop.frames)
    return {**_clean_state(run, first, frames, evictions, t0), "checkpoint_loss": start_loss}


def _clean_state(run: Any, first: int, frames: int, evictions: list, t0: float) -> dict[str, Any]:
    acts = [a.to_dict() for a in run.guard.actions if a.action != "none"]
    would = [a.to_dict() for a in run.guard.actions if a.action == "none" and a.would]
    return {
        "steps": run.step - first,
        "frames_detected": frames,
        "actions": len(acts),
        "reported_only": len(would),
        "action_list": (acts + would)[:50],
        "evictions": [[s, list(r)] for s, r in evictions],
        "reruns": run.guard.reruns,
        "last_loss": run.history[-1],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _f(x: Any) -> float:
    if isinstance(x, str):
        return {"NaN": math.nan, "Infinity": math.inf}.get(x, math.nan)
    return math.nan if x is None else float(x)


def summarise_guard(trials: Sequence[dict]) -> dict[str, Any]:
    """Per fault class (and ``all``): medians of final loss excess and drift with and without the
    guard, actions by kind, steps spent, rerun verdict accuracy, evictions, actions on the twins."""
    groups: dict[str, list[dict]] = {}
    for t in trials:
        groups.setdefault(t["class"], []).append(t)
    groups["all"] = list(trials)
    out = {}
    for cls, ts in groups.items():
        g = [t["guard"] for t in ts]
        kinds: dict[str, int] = {}
        for x in g:
            for a in x["actions"]:
                kinds[a["action"]] = kinds.get(a["action"], 0) + 1
        judged = [x for x in g if x["verdict"] is not None]

        def med(key: str, way: str) -> float | None:
            vals = [_f(x[key][way]) for x in g]
            vals = [v for v in vals if not math.isnan(v)]
            return json_number(median(vals)) if vals else None

        out[cls] = {
            "trials": len(ts),
            "final_excess_faulted": med("final_excess", "faulted"),
            "final_excess_guarded": med("final_excess", "guarded"),
            "drift_faulted": med("drift", "faulted"),
            "drift_guarded": med("drift", "guarded"),
            "actions": kinds,
            "steps_spent": sum(x["steps_spent"] for x in g),
            "reruns": sum(x["reruns"] for x in g),
            "verdicts_right": f"{sum(bool(x['verdict_right']) for x in judged)}/{len(judged)}",
            "evicted_in_window": f"{sum(x['evicted_in_window'] for x in g)}/{len(g)}",
            "twin_actions": sum(len(x["twin_actions"]) for x in g),
        }
        arm = _summarise_mitigations(g)
        if arm:
            out[cls]["mitigated"] = arm
    return out


def _summarise_mitigations(g: Sequence[dict]) -> dict[str, Any]:
    """Per spike mitigation measured on these trials: the median final loss excess over the twin, the
    mitigations started, the trials where it beat (or lost to) the guard without it, and the
    rollbacks and evictions (a benign spike must have none)."""
    out: dict[str, Any] = {}
    for m in MITIGATIONS:
        arm = [(x, x["mitigated"][m]) for x in g if m in x.get("mitigated", {})]
        if not arm:
            continue
        vals = [_f(a["final_excess"]) for _, a in arm]
        off = [_f(x["final_excess"]["guarded"]) for x, _ in arm]
        out[m] = {
            "trials": len(arm),
            "final_excess": json_number(median(vals)),
            "final_excess_off": json_number(median(off)),
            "better": sum(v < o for v, o in zip(vals, off)),
            "worse": sum(v > o for v, o in zip(vals, off)),
            "mitigations": sum(a["mitigations"] for _, a in arm),
            "rollbacks_evictions": sum(
                1 for _, a in arm for act in a["actions"] if act["action"] in ("rollback", "evict")
            ),
        }
    return out


def check_guard_targets(trials: Sequence[dict]) -> list[dict[str, Any]]:
    """The issue's mitigation targets, each with what was measured and whether it was met."""

    def of(*prefixes: str) -> list[dict]:
        return [t for t in trials if t["class"].startswith(prefixes)]

    def row(name: str, num: int, den: int, goal: float, note: str = "") -> dict[str, Any]:
        value = None if den == 0 else num / den
        return {
            "target": name,
            "value": value,
            "count": f"{num}/{den}" + (f" ({note})" if note else ""),
            "goal": goal,
            "met": None if value is None else value >= goal,
        }

    out = []
    nf = of("nan_", "inf_", "near_inf_")
    ok = [
        t
        for t in nf
        if math.isfinite(_f(t["guard"]["final_excess"]["guarded"]))
        and abs(_f(t["guard"]["final_excess"]["guarded"])) <= 0.01
    ]
    out.append(
        row("NaN/Inf/near-INF: guarded run ends finite, within 1% of the twin's final loss", len(ok), len(nf), 1.0)
    )
    pb = [t for t in of("param_bitflip") if t["impact"]["class"] != "negligible"]
    ok = [t for t in pb if _f(t["guard"]["drift"]["guarded"]) * 10 <= _f(t["guard"]["drift"]["faulted"])]
    out.append(row("param bit flips with impact: guarded drift >= 10x smaller", len(ok), len(pb), 1.0))
    un = of("unhealthy_node")
    out.append(
        row("unhealthy node evicted within the window", sum(t["guard"]["evicted_in_window"] for t in un), len(un), 0.90)
    )
    bn = of("lr_spike", "bad_batch")
    ok = [t for t in bn if not any(a["action"] in ("rollback", "evict") for a in t["guard"]["actions"])]
    out.append(row("benign spikes: never a rollback or an eviction", len(ok), len(bn), 1.0))
    judged = [t for t in trials if t["guard"]["verdict"] is not None]
    out.append(
        row(
            "rerun verdict right (transient / persistent / data)",
            sum(bool(t["guard"]["verdict_right"]) for t in judged),
            len(judged),
            0.95,
        )
    )
    twin = sum(len(t["guard"]["twin_actions"]) for t in trials)
    steps = sum(t["clean_steps"] for t in trials)
    out.append(
        {
            "target": "zero actions on the clean twins",
            "value": twin,
            "count": f"{twin} in {steps} steps",
            "goal": 0,
            "met": twin == 0,
        }
    )
    return out


def guard_table(result: dict[str, Any]) -> str:
    """The guard's summary and targets as markdown."""

    def f(x: Any, pct: bool = False) -> str:
        if x is None:
            return "–"
        if isinstance(x, str):
            return x
        return f"{100 * x:+.2f}%" if pct else f"{x:.3g}"

    lines = [
        "| class | trials | final loss excess, unguarded | guarded | drift, unguarded | guarded | actions "
        "| steps spent | reruns | rerun verdict right | evicted in window | actions on twins |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cls, s in result["guard_summary"].items():
        acts = ", ".join(f"{k} {v}" for k, v in sorted(s["actions"].items())) or "none"
        lines.append(
            f"| {cls} | {s['trials']} | {f(s['final_excess_faulted'], True)} | "
            f"{f(s['final_excess_guarded'], True)} | {f(s['drift_faulted'])} | {f(s['drift_guarded'])} | "
            f"{acts} | {s['steps_spent']} | {s['reruns']} | {s['verdicts_right']} | "
            f"{s['evicted_in_window']} | {s['twin_actions']} |"
        )
    lines += _mitigation_table(result["guard_summary"], f)
    lines += ["", "| target (guard) | measured | met |", "|---|---|---|"]
    for t in result.get("guard_targets") or []:
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {t['count']} | {met} |")
    return "\n".join(lines)


def _mitigation_table(summary: dict[str, Any], f: Any) -> list[str]:
    """The mitigation arm's rows (none when it was not run)."""
    rows = [
        f"| {cls} | {m} | {a['trials']} | {f(s['final_excess_faulted'], True)} | {f(a['final_excess_off'], True)} | "
        f"{f(a['final_excess'], True)} | {a['better']} / {a['worse']} | {a['mitigations']} | {a['rollbacks_evictions']} |"
        for cls, s in summary.items()
        for m, a in s.get("mitigated", {}).items()
    ]
    if not rows:
        return []
    return [
        "",
        "| class | spike mitigation | trials | final loss excess, unguarded | guarded, no mitigation | guarded, "
        "mitigated | mitigated better / worse (trials) | mitigations | rollbacks + evictions |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def shifted(fault: Any, by: int) -> Any:
    """The fault with its step moved by ``by`` (campaign steps count from the checkpoint)."""
    return replace(fault, step=fault.step + by)
