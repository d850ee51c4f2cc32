"""``sdcwatch demo``: the whole product in one command, on a laptop.

It starts the embedded broker, the detector service with its /metrics endpoint, trains the
reference model on 8 simulated data-parallel ranks that stream telemetry through the broker,
injects a fault on one rank part-way through, prints progress and every alert as it fires, and
ends with a summary (what was injected, what was detected, when, which rank) and an HTML report.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from sdcwatch.core.errors import ConfigError, SdcwatchError
from sdcwatch.core.kinds import LOCALISING_KINDS

__all__ = ["PRESETS", "preset_faults", "DemoResult", "run_demo", "demo_main"]

log = logging.getLogger("sdcwatch.demo")

#: With the guard on, how many steps the demo's training may run ahead of the detector service,
#: and how long it waits at most for it to catch up (see ``keep_pace`` in :func:`run_demo`).
PACE_LAG_STEPS = 3
PACE_TIMEOUT_S = 20.0


def _fault(kind: str, step: int, rank: int | None, **kw: Any) -> dict[str, Any]:
    return {"kind": kind, "step": step, "rank": rank, **kw}


#: Fault presets: name -> (description, builder(rank, step, seed) -> list of fault dicts).
PRESETS: dict[str, tuple[str, Callable[[int, int, int], list[dict[str, Any]]]]] = {
    "bitflip": (
        "one exponent bit flipped in one element of an attention projection output (transient SDC)",
        lambda r, s, seed: [
            _fault("bitflip", s, r, duration=1, target="blocks.1.attn.qkv", where="output", bit=30, seed=seed)
        ],
    ),
    "nan": (
        "a NaN written into one element of an attention GEMM output (ATTNChecker's fault model)",
        lambda r, s, seed: [_fault("nan", s, r, duration=1, target="blocks.1.attn.scores", where="output", seed=seed)],
    ),
    "near_inf": (
        "a near-INF value (1e10) in one element of an attention GEMM output",
        lambda r, s, seed: [
            _fault(
                "near_inf", s, r, duration=1, target="blocks.1.attn.scores", where="output", magnitude=1e10, seed=seed
            )
        ],
    ),
    "unhealthy-node": (
        "persistent small noise (1% relative) on every matmul output of one rank: an unhealthy node",
        lambda r, s, seed: [
            _fault("noise", s, r, duration=0, target="blocks.*", where="output", magnitude=1e-2, seed=seed)
        ],
    ),
    "bad-batch": (
        "a batch of garbage tokens on every rank for one step: a benign, data-caused loss spike",
        lambda r, s, seed: [_fault("bad_batch", s, None, duration=1, seed=seed)],
    ),
    "lr-spike": (
        "the learning rate multiplied by 30 on every rank for 2 steps: an optimisation spike",
        lambda r, s, seed: [_fault("lr_spike", s, None, duration=2, magnitude=30.0, seed=seed)],
    ),
    "none": ("no fault: a clean run, which must raise no alert", lambda r, s, seed: []),
}


def preset_faults(name_or_path: str, *, rank: int, step: int, seed: int) -> tuple[str, list[dict[str, Any]]]:
    """The fault list for a preset name or a fault file (JSON lines or a JSON array)."""
    if name_or_path in PRESETS:
        desc, build = PRESETS[name_or_path]
        return desc, build(rank, step, seed)
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError("fault", f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    from sdcwatch.testbed.faultspec import load_faults

    faults = [f.to_dict() for f in load_faults(path)]
    return f"{len(faults)} fault(s) from {path}", faults


@dataclass
class DemoResult:
    """What the demo injected and what sdcwatch made of it."""

    preset: str
    description: str
    injected: list[dict[str, Any]]
    incidents: list[dict[str, Any]]
    steps: int
    ranks: int
    fault_step: int | None
    fault_rank: int | None
    detected: bool
    first_detection_step: int | None
    localized_rank: int | None
    detection_delay_steps: int | None
    latency_seconds: float | None
    wall_seconds: float
    metrics_url: str = ""
    report: str | None = None
    records: str | None = None
    false_alarms: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    guard: bool = False
    guard_actions: list[dict[str, Any]] = field(default_factory=list)
    """With ``guard``: every step at which the guard acted, ``{step, action, ranks, reason}`` (and more)."""
    final_loss: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "description": self.description,
            "injected": self.injected,
            "steps": self.steps,
            "ranks": self.ranks,
            "fault_step": self.fault_step,
            "fault_rank": self.fault_rank,
            "detected": self.detected,
            "first_detection_step": self.first_detection_step,
            "localized_rank": self.localized_rank,
            "detection_delay_steps": self.detection_delay_steps,
            "latency_seconds": self.latency_seconds,
            "false_alarms": self.false_alarms,
            "incidents": self.incidents,
            "wall_seconds": round(self.wall_seconds, 2),
            "metrics_url": self.metrics_url,
            "report": self.report,
            "records": self.records,
            "guard": self.guard,
            "guard_actions": self.guard_actions,
            "final_loss": self.final_loss,
        }


class _CapturingSource:
    """Wraps the service's source and appends every record it returns to a JSON-lines file."""

    def __init__(self, source: Any, path: Path) -> None:
        from sdcwatch.core.record_json import to_json

        self._source = source
        self._to_json = to_json
        self._fh = open(path, "w", encoding="utf-8")
        self.seen = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def poll(self, timeout: float) -> list:
        from sdcwatch.service.ingest import as_records

        records = self._source.poll(timeout)
        if records:
            flat = as_records(records)  # v2 column blocks as records, for the JSON capture
            self._fh.write("".join(self._to_json(r) + "\n" for r in flat))
            self._fh.flush()
            self.seen += len(flat)
        return records

    def close(self) -> None:
        try:
            self._source.close()
        finally:
            self._fh.close()


class _EventLog:
    """An incident sink that keeps every event and prints alerts as they fire."""

    def __init__(self, out: TextIO, quiet: bool) -> None:
        self.events: list[Any] = []
        self.opened_wall: dict[str, float] = {}
        self._out = out
        self._quiet = quiet
        self._lock = threading.Lock()

    def publish(self, event: Any) -> None:
        with self._lock:
            self.events.append(event)
            inc = event.incident
            if event.change == "opened":
                self.opened_wall.setdefault(inc.id, time.time())
        if self._quiet:
            return
        inc = event.incident
        if event.change == "opened":
            print(f"  ALERT  [{inc.severity.value}] step {inc.first_step}: {inc.message}", file=self._out, flush=True)
        elif event.change == "resolved":
            print(f"  resolved  {inc.kind} (steps {inc.first_step}-{inc.last_step})", file=self._out, flush=True)
        elif event.change == "updated" and getattr(inc, "kind", "") == "sdc_suspected":
            print(f"  update [{inc.severity.value}] {inc.message}", file=self._out, flush=True)

    def close(self) -> None:
        pass

    def incidents(self) -> list[Any]:
        """The latest state of every incident, in the order they were opened."""
        latest: dict[str, Any] = {}
        with self._lock:
            for ev in self.events:
                latest[ev.incident.id] = ev.incident
        return list(latest.values())


def _pick_metrics_port(requested: int) -> int:
    from sdcwatch.broker import free_port

    if requested:
        return requested
    import socket

    with socket.socket() as s:  # the documented default, when free; any free port otherwise
        try:
            s.bind(("127.0.0.1", 9400))
            return 9400
        except OSError:
            return free_port()


def summarize(
    incidents: list[Any], fault_step: int | None, fault_rank: int | None
) -> tuple[bool, int | None, int | None, int]:
    """(detected, first detection step, localized rank, false alarms) from the incidents.

    An incident counts as a detection when it starts at or after the fault's first step; one that
    starts before it (or any incident in a run without a fault) is a false alarm.
    """
    if fault_step is None:
        return False, None, None, len(incidents)
    after = [i for i in incidents if i.first_step >= fault_step]
    false_alarms = len(incidents) - len(after)
    if not after:
        return False, None, None, false_alarms
    first = min(i.first_step for i in after)
    localized = None
    for inc in sorted(after, key=lambda i: (i.first_step, -i.severity.rank)):
        if inc.kind in LOCALISING_KINDS and len(inc.ranks) == 1:
            localized = int(inc.ranks[0])
            break
    return True, first, localized, false_alarms


def run_demo(
    *,
    fault: str = "bitflip",
    ranks: int = 8,
    steps: int = 160,
    seed: int = 0,
    fault_rank: int | None = None,
    fault_step: int | None = None,
    report: str | None = None,
    out_dir: str | None = None,
    metrics_port: int = 0,
    progress: TextIO = sys.stderr,
    quiet: bool = False,
    progress_every: int = 10,
    guard: Any = False,
    parallel: str | None = None,
) -> DemoResult:
    """Run the demo end to end and return what happened (the CLI prints it).

    ``guard``: True runs the job under the guard with its shipped settings, acting (and the service
    publishing decisions); a :class:`~sdcwatch.telemetry.GuardConfig` sets the guard's own settings.
    ``parallel`` (e.g. ``"tp=2,pp=2,dp=4"``) simulates a tensor x pipeline x data parallel job
    (:mod:`sdcwatch.testbed.parallel3d`) instead of ``ranks`` data-parallel replicas: ``ranks``
    becomes the layout's rank count, the fault's default rank one on the last stage, and a preset's
    layer one of its rank's stage.
    """
    import torch

    from sdcwatch.broker import EmbeddedBroker
    from sdcwatch.config import AlertsConfig, BusConfig, GuardPolicyConfig, MetricsConfig, ServeConfig, StateConfig
    from sdcwatch.serve import build_service
    from sdcwatch.telemetry import Emitter, KafkaTransport
    from sdcwatch.testbed.faultspec import FaultSpec
    from sdcwatch.testbed.simulated import SimulatedRun
    from sdcwatch.telemetry.guard.config import GuardConfig, GuardEviction

    # guard: True (the shipped guard settings, acting) or the caller's GuardConfig
    guard_config = guard if isinstance(guard, GuardConfig) else (GuardConfig(mode="act") if guard else None)
    guard = guard_config is not None
    layout = None
    if parallel is not None:
        from sdcwatch.testbed.shard_plan import parse_layout, place_fault, rank_at, sizes

        layout = parse_layout(parallel)
        if guard:
            raise ConfigError("guard", "the guard is not simulated under tensor or pipeline parallelism")
        tp, pp, dp = sizes(layout)
        if dp < 2:
            raise ConfigError("parallel", f"the demo needs at least 2 data-parallel replicas to compare, got {layout}")
        ranks = layout.world
    if ranks < 2:
        raise ConfigError("ranks", f"the demo needs at least 2 ranks to compare, got {ranks}")
    if steps < 40:
        raise ConfigError("steps", f"the demo needs at least 40 steps (warm-up plus the fault), got {steps}")
    torch.set_num_threads(1)
    t_start = time.monotonic()
    f_rank = (ranks // 2 - 1 if ranks > 2 else 1) if fault_rank is None else fault_rank
    if layout is not None and fault_rank is None:  # a rank of the last stage, where the loss is
        f_rank = rank_at(layout, dp // 2 - 1, pp - 1, tp - 1)
    f_step = max(30, int(steps * 0.55)) if fault_step is None else fault_step
    if not 0 <= f_rank < ranks:
        raise ConfigError("fault_rank", f"must be in 0..{ranks - 1}, got {f_rank}")
    description, fault_dicts = preset_faults(fault, rank=f_rank, step=f_step, seed=seed)
    if layout is not None and fault in PRESETS:
        from sdcwatch.testbed.model import GPTConfig

        fault_dicts = [place_fault(d, layout, GPTConfig().n_layer) for d in fault_dicts]
    faults = [FaultSpec.from_dict(d, where=f"fault {i}") for i, d in enumerate(fault_dicts)]
    injected_step = min((f.step for f in faults), default=None)
    ranks_hit = {f.rank for f in faults}
    injected_rank = next(iter(ranks_hit)) if len(ranks_hit) == 1 else None

    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="sdcwatch-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "state", ignore_errors=True)  # a demo starts fresh, even in a reused folder
    records_path = out / "records.jsonl"
    incidents_path = out / "incidents.jsonl"
    report_path = Path(report) if report else out / "report.html"
    run_id = f"demo-{fault}-{seed}"

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=progress, flush=True)

    say(
        f"sdcwatch demo: {ranks} simulated ranks"
        + (f" ({layout})" if layout is not None else "")
        + f", {steps} steps, fault: {fault} ({description})"
        + ("; guard on (skip, rerun, roll back, evict)" if guard else "")
    )
    if faults:
        where = f"rank {injected_rank}" if injected_rank is not None else "all ranks"
        say(f"  injecting at step {injected_step} on {where}")
    log.info("demo output in %s", out)
    with EmbeddedBroker(port=0) as broker:
        say(f"  broker: embedded Tansu on {broker.bootstrap}")
        cfg = ServeConfig(
            bus=BusConfig(bootstrap=broker.bootstrap, group=f"sdcwatch-demo-{os.getpid()}"),
            metrics=MetricsConfig(address="127.0.0.1", port=_pick_metrics_port(metrics_port)),
            alerts=AlertsConfig(log=False),  # the demo prints each change itself
            state=StateConfig(dir=out / "state", snapshot_interval_s=5.0),
            # with --guard, the loop: incidents -> decisions on sdcwatch.control -> the job's guard
            guard=GuardPolicyConfig(actions=guard),
        )
        events = _EventLog(progress, quiet)
        service, metrics = build_service(
            cfg, extra_sinks=[events], wrap_source=lambda source: _CapturingSource(source, records_path)
        )
        source, pipeline = service.source, service.pipeline
        pipeline.book.history = []  # keep every incident, in its latest state, for the summary
        metrics.start()
        control = None
        if guard:
            from sdcwatch.telemetry.guard.control_topic import KafkaControl

            control = KafkaControl(broker.bootstrap, run_id)
        say(f"  metrics: {metrics.url}  (point Prometheus here; Grafana dashboard in dashboards/)")
        stop = threading.Event()
        service_thread = threading.Thread(
            target=service.run_forever, args=(stop,), name="sdcwatch-service", daemon=True
        )
        service_thread.start()

        emitters: list[Any] = []

        def factory(rank: int, host: str = "", coords: dict[str, int] | None = None) -> Any:
            em = Emitter(
                KafkaTransport(broker.bootstrap),
                run=run_id,
                rank=rank,
                world=ranks,
                host=host or f"node{rank // 4}",
                coords=coords,
            )
            emitters.append(em)
            return em

        fault_wall: list[float] = []
        t_train = time.monotonic()
        told = [0]

        pace_gave_up: list[int] = []
        deciders = [s for s in service.sinks if hasattr(s, "policy") and hasattr(s, "published")]

        def keep_pace(step: int) -> None:
            # A real job's steps take seconds; the detector and the control topic answer in a fraction
            # of one. The demo's steps take milliseconds, so with the guard on it waits (a bounded
            # while) for the service to read the ranks' records up to a few steps back and for the
            # guard's reader to receive every decision published: the loop then behaves as it would
            # at a real step time, on a loaded machine too.
            if pace_gave_up:
                return
            deadline = time.monotonic() + PACE_TIMEOUT_S
            want = max(0, step + 1 - PACE_LAG_STEPS) * ranks
            while source.seen < want or control.received < sum(s.published for s in deciders):
                if time.monotonic() > deadline:  # a stalled service must not stall the demo too
                    pace_gave_up.append(step)
                    log.warning("the detector service fell %.0f s behind at step %d", PACE_TIMEOUT_S, step)
                    return
                time.sleep(0.005)

        def on_step(step: int, run: Any) -> None:
            if injected_step is not None and step == injected_step:
                fault_wall.append(time.time())
            if control is not None:
                keep_pace(step)
            if run.guard is not None:
                for act in run.guard.actions[told[0] :]:
                    if act.action != "none":
                        say(f"  GUARD  [{act.action}] {act.message}")
                told[0] = len(run.guard.actions)
            if step % progress_every == 0 or step == steps - 1:
                n_open = sum(1 for i in events.incidents() if i.open)
                loss = run.history[-1] if run.history else math.nan
                rate = (step + 1) / max(1e-9, time.monotonic() - t_train)
                say(f"  step {step:4d}/{steps}  loss {loss:6.3f}  open incidents {n_open}  ({rate:.1f} steps/s)")

        if guard and not quiet:  # the demo prints each action itself
            logging.getLogger("sdcwatch.guard").setLevel(logging.ERROR)
        if layout is not None:
            from sdcwatch.testbed.parallel3d import ParallelSimulatedRun

            run = ParallelSimulatedRun(layout, seed=seed, faults=faults, emitter_factory=factory)
        else:
            run = SimulatedRun(
                world=ranks, seed=seed, faults=faults, emitter_factory=factory, guard=guard_config, control=control
            )
        try:
            while run.step < steps:
                try:
                    run.train(steps - run.step, on_step=on_step)
                except GuardEviction as ev:  # what a launcher does: restart without that node
                    say(f"  GUARD  [evict] {ev.message}")
                    run.replace_ranks(ev.ranks)
                    pos = run.guard.restore(ev.since_step, ev.ranks)
                    if pos is not None:
                        run.data_pos = pos
                    say(
                        f"  (restarted with healthy hardware for rank(s) {', '.join(map(str, ev.ranks))}, from the "
                        f"snapshot before step {ev.since_step}; data position {run.data_pos})"
                    )
                    told[0] = len(run.guard.actions)
            final_loss = run.history[-1] if run.history else None
        finally:
            if control is not None:
                control.close()
            run.close()  # emits the last step's telemetry (probes are read one step late)
            for em in emitters:
                em.close(timeout=30)
        # wait until the service has seen every step the ranks sent, then let it close them
        deadline = time.monotonic() + 30
        expected = steps * ranks
        while source.seen < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            view = service.view()
            run_view = next((r for r in view.runs if r.run == run_id), None)
            if run_view is not None and run_view.last_step >= steps - 1:
                break
            time.sleep(0.05)
        time.sleep(0.3)
        stop.set()
        service_thread.join(timeout=30)
        metrics.close()

    incidents = list(pipeline.book.history)  # the service has stopped: their final state
    with open(incidents_path, "w", encoding="utf-8") as fh:
        for inc in incidents:
            fh.write(json.dumps(inc.to_dict(), allow_nan=False) + "\n")
    detected, first_step, localized, false_alarms = summarize(incidents, injected_step, injected_rank)
    latency = None
    if detected and fault_wall:
        first_inc = min(
            (i for i in incidents if i.first_step >= injected_step), key=lambda i: (i.first_step, i.opened_at)
        )
        opened = events.opened_wall.get(first_inc.id)
        if opened is not None:
            latency = round(max(0.0, opened - fault_wall[0]), 3)
    result = DemoResult(
        preset=fault,
        description=description,
        injected=fault_dicts,
        incidents=[i.to_dict() for i in incidents],
        steps=steps,
        ranks=ranks,
        fault_step=injected_step,
        fault_rank=injected_rank,
        detected=detected,
        first_detection_step=first_step,
        localized_rank=localized,
        detection_delay_steps=None if first_step is None else first_step - injected_step,
        latency_seconds=latency,
        wall_seconds=time.monotonic() - t_start,
        metrics_url=metrics.url,
        records=str(records_path),
        false_alarms=false_alarms,
        guard=guard,
        guard_actions=[a.to_dict() for a in run.guard.actions if a.action != "none"] if run.guard is not None else [],
        final_loss=final_loss
        if final_loss is None or math.isfinite(final_loss)
        else ("NaN" if math.isnan(final_loss) else "Infinity"),
    )
    try:
        from sdcwatch.report import write_report

        result.report = str(
            write_report(
                records_path,
                [i.to_dict() for i in incidents],
                report_path,
                title=f"sdcwatch demo: {fault} ({description})",
                injected=fault_dicts or "nothing (clean run)",
            )
        )
    except SdcwatchError as exc:
        log.warning("could not write the report: %s", exc)
    return result


def format_summary(r: DemoResult) -> str:
    """The human-readable end-of-demo summary."""
    lines = ["", "=" * 72, "sdcwatch demo summary", "=" * 72]
    if r.injected:
        where = f"rank {r.fault_rank}" if r.fault_rank is not None else "all ranks"
        lines.append(f"injected:   {r.description}")
        lines.append(f"            at step {r.fault_step} on {where}")
    else:
        lines.append("injected:   nothing (clean run)")
    if r.injected:
        if r.detected:
            lines.append(
                f"detected:   yes, at step {r.first_detection_step} ({r.detection_delay_steps} steps after the fault"
                + (f", {r.latency_seconds:.2f} s after it was emitted)" if r.latency_seconds is not None else ")")
            )
            if r.localized_rank is not None:
                verdict = "correct" if r.localized_rank == r.fault_rank else f"but the fault was on rank {r.fault_rank}"
                lines.append(f"localised:  rank {r.localized_rank} ({verdict})")
            else:
                lines.append(
                    "localised:  no single rank blamed"
                    + (" (correct: the cause is run-wide)" if r.fault_rank is None else "")
                )
        else:
            lines.append("detected:   NO")
    lines.append(
        f"incidents:  {len(r.incidents)}"
        + (f" ({r.false_alarms} before the fault: false alarms)" if r.false_alarms else "")
    )
    for inc in r.incidents:
        ranks = f" ranks {inc['ranks']}" if inc["ranks"] else ""
        lines.append(
            f"  - [{inc['severity']}] {inc['kind']} steps {inc['first_step']}-{inc['last_step']}{ranks}: {inc['message']}"
        )
    if r.guard:
        lines.append(f"guard:      {len(r.guard_actions)} action(s)" + ("" if r.guard_actions else " (nothing to do)"))
        for a in r.guard_actions:
            ranks = f" ranks {a['ranks']}" if a["ranks"] else ""
            lines.append(
                f"  - step {a['step']}: {a['action']}{ranks} ({a['reason']}"
                + (f", rerun verdict {a['verdict']}" if a.get("verdict") else "")
                + ")"
            )
    lines.append(f"final loss: {r.final_loss}")
    if r.report:
        lines.append(f"report:     {r.report}")
    lines.append(f"records:    {r.records}")
    lines.append(f"took {r.wall_seconds:.1f} s")
    return "\n".join(lines)


def demo_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="sdcwatch demo",
        description="Train a small GPT on simulated data-parallel ranks that stream telemetry through an embedded "
        "Kafka broker to the detector service, inject a fault on one rank, and watch sdcwatch catch it.",
    )
    parser.add_argument(
        "--fault",
        default="bitflip",
        metavar="PRESET|FILE",
        help="a preset (" + ", ".join(PRESETS) + ") or a fault file in the injector's JSON format "
        "(default %(default)s)",
    )
    parser.add_argument("--ranks", type=int, default=None, help="simulated data-parallel ranks (default 8)")
    parser.add_argument(
        "--parallel",
        metavar="LAYOUT",
        default=None,
        help="simulate a tensor x pipeline x data parallel job instead, e.g. tp=2,pp=2,dp=4 (16 ranks; "
        "--fault-rank is then a global rank, default one on the last pipeline stage)",
    )
    parser.add_argument("--steps", type=int, default=160, help="training steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model, data and fault (default %(default)s)")
    parser.add_argument("--fault-rank", type=int, default=None, help="rank the preset hits (default: ranks/2 - 1)")
    parser.add_argument(
        "--fault-step", type=int, default=None, help="step the preset starts at (default: 55%% of the run)"
    )
    parser.add_argument("--report", default=None, metavar="PATH", help="where to write the HTML report")
    parser.add_argument("--out-dir", default=None, metavar="DIR", help="folder for records, incidents and state")
    parser.add_argument("--metrics-port", type=int, default=0, help="port for /metrics (default 9400, or a free one)")
    parser.add_argument(
        "--guard",
        action="store_true",
        help="guard the training: skip, rerun, roll back or evict on a detection, and show it",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    parser.add_argument("--list-presets", action="store_true", help="list the fault presets and exit")
    args = parser.parse_args(argv)
    if args.list_presets:
        for name, (desc, _) in PRESETS.items():
            print(f"{name:15s} {desc}")
        return 0
    if args.ranks is not None and args.parallel is not None:
        raise ConfigError("ranks", "give --ranks or --parallel, not both (the layout sets the rank count)")
    result = run_demo(
        fault=args.fault,
        ranks=8 if args.ranks is None else args.ranks,
        steps=args.steps,
        seed=args.seed,
        fault_rank=args.fault_rank,
        fault_step=args.fault_step,
        report=args.report,
        out_dir=args.out_dir,
        metrics_port=args.metrics_port,
        quiet=False,
        guard=args.guard,
        parallel=args.parallel,
    )
    if args.json:
        print(json.dumps(result.to_dict(), allow_nan=False))
    else:
        print(format_summary(result))
    return 0
