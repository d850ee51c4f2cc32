"""One demo run end to end: plan it, start the broker and the detector service, train the
simulated job beside them, then write the incidents, score them against the faults and write
the HTML report."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from sdcwatch.broker import EmbeddedBroker
from sdcwatch.core.errors import SdcwatchError
from sdcwatch.demo.plan import DemoPlan, plan_demo
from sdcwatch.core.jsonsafe import json_float
from sdcwatch.demo.result import DemoResult, detection_latency, summarize
from sdcwatch.demo.service import DemoService, EventLog
from sdcwatch.demo.training import DemoTraining

__all__ = ["DemoFiles", "run_demo"]

log = logging.getLogger("sdcwatch.demo")


@dataclass
class DemoFiles:
    """Where a demo run writes: its folder (service state inside), the records, incidents and report."""

    out: Path
    records: Path
    incidents: Path
    report: Path

    @classmethod
    def prepare(cls, out_dir: str | None, report: str | None) -> DemoFiles:
        """The folder ``out_dir`` (a fresh temporary one when None), emptied of an earlier run's state."""
        out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="sdcwatch-demo-"))
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out / "state", ignore_errors=True)  # a demo starts fresh, even in a reused folder
        return cls(out, out / "records.jsonl", out / "incidents.jsonl", Path(report) if report else out / "report.html")


def _speaker(progress: TextIO, quiet: bool) -> Callable[[str], None]:
    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=progress, flush=True)

    return say


def _announce(plan: DemoPlan, say: Callable[[str], None]) -> None:
    """The first lines: what is simulated, which fault, and where and when it is injected."""
    say(
        f"sdcwatch demo: {plan.ranks} simulated ranks"
        + (f" ({plan.layout})" if plan.layout is not None else "")
        + f", {plan.steps} steps, fault: {plan.fault} ({plan.description})"
        + (
            f"; guard on (skip, rerun, roll back, evict{': the replica leaves, the others go on' if plan.guard_config.on_evict == 'leave' else ''})"
            if plan.guard
            else ""
        )
    )
    if plan.faults:
        where = f"rank {plan.injected_rank}" if plan.injected_rank is not None else "all ranks"
        say(f"  injecting at step {plan.injected_step} on {where}")


def _train_beside_the_service(
    plan: DemoPlan, files: DemoFiles, *, metrics_port: int, progress: TextIO, quiet: bool
) -> tuple[DemoService, DemoTraining, Any, float | None]:
    """Start the embedded broker and the detector service, train the job on it, drain the
    service and stop everything. Returns the stopped service, the training, the run and its
    final loss."""
    say = _speaker(progress, quiet)
    with EmbeddedBroker(port=0) as broker:
        say(f"  broker: embedded Tansu on {broker.bootstrap}")
        service = DemoService(
            broker.bootstrap,
            state_dir=files.out / "state",
            records_path=files.records,
            metrics_port=metrics_port,
            guard=plan.guard,
            events=EventLog(progress, quiet),
        )
        service.start_metrics()
        control = None
        if plan.guard:
            from sdcwatch.telemetry.guard.control_topic import KafkaControl

            control = KafkaControl(broker.bootstrap, plan.run_id)
        say(
            f"  metrics: {service.metrics.url}  (point Prometheus here; the Grafana dashboard and rules: sdcwatch stack export DIR)"
        )
        service.start()
        training = DemoTraining(plan, broker.bootstrap, service, control, say)
        if plan.guard and not quiet:  # the demo prints each action itself
            logging.getLogger("sdcwatch.guard").setLevel(logging.ERROR)
        run = training.build_run()
        final_loss = training.train(run)
        # wait until the service has seen every step the ranks sent, then let it close them
        service.drain(plan.run_id, plan.steps, training.records_sent)
        service.stop()
    return service, training, run, final_loss


def _score(
    plan: DemoPlan,
    files: DemoFiles,
    incidents: list[Any],
    service: DemoService,
    training: DemoTraining,
    run: Any,
    final_loss: float | None,
    t_start: float,
) -> DemoResult:
    """The demo's result: the incidents scored against the injected faults."""
    detected, first_step, localized, false_alarms = summarize(incidents, plan.injected_step)
    latency = None
    if detected and training.fault_wall:
        latency = detection_latency(incidents, plan.injected_step, service.events.opened_wall, training.fault_wall[0])
    return DemoResult(
        preset=plan.fault,
        description=plan.description,
        injected=plan.fault_dicts,
        incidents=[i.to_dict() for i in incidents],
        steps=plan.steps,
        ranks=plan.ranks,
        fault_step=plan.injected_step,
        fault_rank=plan.injected_rank,
        detected=detected,
        first_detection_step=first_step,
        localized_rank=localized,
        detection_delay_steps=None if first_step is None else first_step - plan.injected_step,
        latency_seconds=latency,
        wall_seconds=time.monotonic() - t_start,
        metrics_url=service.metrics.url,
        records=str(files.records),
        false_alarms=false_alarms,
        guard=plan.guard,
        guard_actions=[a.to_dict() for a in run.guard.actions if a.action != "none"] if run.guard is not None else [],
        final_loss=json_float(final_loss),
    )


def _write_report(plan: DemoPlan, files: DemoFiles, incidents: list[Any]) -> str | None:
    """The HTML report of the run; None (and a warning) when it cannot be written."""
    from sdcwatch.report import write_report

    try:
        return str(
            write_report(
                files.records,
                [i.to_dict() for i in incidents],
                files.report,
                title=f"sdcwatch demo: {plan.fault} ({plan.description})",
                injected=plan.fault_dicts or "nothing (clean run)",
            )
        )
    except SdcwatchError as exc:
        log.warning("could not write the report: %s", exc)
        return None


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
    guard: Any = False,
    parallel: str | None = None,
) -> DemoResult:
    """Run the demo end to end and return what happened (the CLI prints it). ``guard``: True for the
    shipped guard settings, acting, or a :class:`~sdcwatch.telemetry.GuardConfig`. ``parallel``
    (``"tp=2,pp=2,dp=4"``) simulates that layout instead of ``ranks`` data-parallel replicas."""
    import torch

    t_start = time.monotonic()
    plan = plan_demo(
        fault=fault,
        ranks=ranks,
        steps=steps,
        seed=seed,
        fault_rank=fault_rank,
        fault_step=fault_step,
        guard=guard,
        parallel=parallel,
    )
    torch.set_num_threads(1)
    files = DemoFiles.prepare(out_dir, report)
    _announce(plan, _speaker(progress, quiet))
    log.info("demo output in %s", files.out)
    service, training, run, final_loss = _train_beside_the_service(
        plan, files, metrics_port=metrics_port, progress=progress, quiet=quiet
    )
    incidents = service.incidents()  # the service has stopped: their final state
    with open(files.incidents, "w", encoding="utf-8") as fh:
        for inc in incidents:
            fh.write(json.dumps(inc.to_dict(), allow_nan=False) + "\n")
    result = _score(plan, files, incidents, service, training, run, final_loss, t_start)
    result.report = _write_report(plan, files, incidents)
    return result
