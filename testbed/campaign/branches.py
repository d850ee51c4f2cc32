"""A campaign branch: the simulated run from the checkpoint with its ranks' records kept in memory
(:class:`RecordCollector`), and what it produced (:class:`Branch`): aligned frames, global losses,
each replica's final parameters and the injector's record of what it changed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from sdcwatch.testbed.campaign.run import CampaignConfig

__all__ = ["RecordCollector", "Branch", "frames_of", "flat_params", "new_run", "run_branch"]


class RecordCollector:
    """An emitter that keeps one rank's records in memory (the campaign reads them back per step)."""

    dropped = 0

    def __init__(
        self, sink: list, *, run: str, rank: int, world: int, host: str, coords: dict[str, int] | None = None
    ) -> None:
        self.sink, self.run, self.rank, self.world, self.host = sink, run, rank, world, host
        self.coords = dict(coords or {})

    def emit(self, step: int, *, layers=None, fingerprints=None, time: float | None = None, **scalars: float) -> None:
        from sdcwatch.core.record_type import Record

        self.sink.append(
            Record(
                self.run,
                step,
                self.rank,
                self.world,
                self.host,
                0.0 if time is None else time,
                self.rank,
                dict(scalars),
                dict(fingerprints or {}),
                dict(layers or {}),
                self.coords,
            )
        )

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        pass


@dataclass
class Branch:
    """What one run produced: aligned frames, global losses, final replica parameters."""

    frames: list
    losses: list[float]
    params: list[Any]  # per rank: flat parameter tensor of its replica (shared ones are the same object)
    seconds: float
    injections: list = field(default_factory=list)  # what the injector changed (Injection, CoveredInjection)


def frames_of(records: list, world: int, wire: str | None = None) -> list:
    """The step frames of ``records`` (every rank's record of a step in one frame), in step order;
    with ``wire``, as the service would build them after sending the records in that format."""
    from sdcwatch.detectors.frame import StepFrame

    if wire is not None:
        from sdcwatch.testbed.wire_frames import frames_over_wire

        return frames_over_wire(records, wire)

    by_step: dict[int, list] = {}
    for rec in records:
        by_step.setdefault(rec.step, []).append(rec)
    return [StepFrame.from_records(recs[0].run, step, world, recs) for step, recs in sorted(by_step.items())]


def flat_params(run: Any) -> list[Any]:
    """Each replica's parameters as one flat tensor (replicas differ only after a memory fault)."""
    import torch

    return [torch.cat([p.reshape(-1) for p in run.replica_parameters(r)]) for r in range(run.world)]


def new_run(
    config: CampaignConfig,
    faults: Sequence[Any],
    records: list,
    run_id: str,
    guard: Any = None,
    fault_bounds: bool = False,
) -> Any:
    """A simulated run of the campaign's shape and probes whose ranks append their records to ``records``
    (``fault_bounds``: its injections carry the bound of the checksum covering their tensor,
    :mod:`sdcwatch.testbed.fault_bounds`; under a layout, of the rank's own share of it)."""
    from sdcwatch.telemetry.probes.presets import probe_config
    from sdcwatch.testbed.simulated import SimulatedRun

    def factory(rank: int, host: str = "", coords: dict[str, int] | None = None) -> RecordCollector:
        return RecordCollector(records, run=run_id, rank=rank, world=config.world, host=host, coords=coords)

    run_class: Any = SimulatedRun
    layout: Any = config.world
    extra: dict[str, Any] = {"fault_bounds": fault_bounds}
    if config.parallel is not None:  # tensor x pipeline x data parallel ranks
        from sdcwatch.testbed.parallel3d import ParallelSimulatedRun

        run_class, layout = ParallelSimulatedRun, config.parallel
    return run_class(
        layout,
        seed=config.seed,
        faults=faults,
        emitter_factory=factory,
        batch_size=config.batch_size,
        guard=guard,
        probes=probe_config(config.probes)[1],
        **extra,
    )


def run_branch(
    config: CampaignConfig, checkpoint: Path, faults: Sequence[Any], data_seed: int, run_id: str = "campaign"
) -> Branch:
    """Run ``branch_steps`` from the checkpoint with ``faults`` on the data stream ``data_seed``."""
    t0 = time.perf_counter()
    records: list = []
    run = new_run(config, faults, records, run_id, fault_bounds=bool(faults))
    try:
        run.load_checkpoint(checkpoint)
        run.seed = data_seed  # the branch's own data stream; both twins use the same one
        losses = run.train(config.branch_steps)
        params = flat_params(run)
        injections = list(run.injector.injections)
    finally:
        run.close()  # emits the last step's record
    return Branch(frames_of(records, config.world, config.wire), losses, params, time.perf_counter() - t0, injections)
