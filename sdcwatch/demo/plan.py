"""What one demo run will do, checked before anything starts: the job's shape (data-parallel
ranks or a 3D layout), the guard's settings, and the faults (a named preset or a fault file of
your own) with the step and rank they hit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdcwatch.core.errors import ConfigError
from sdcwatch.testbed.faultspec import FaultSpec, load_faults

__all__ = ["PRESETS", "preset_faults", "DemoPlan", "plan_demo"]


#: Fault presets: name -> (description, its faults: each a kind, whether it hits the one rank the demo
#: picks (else every rank), and its settings); :func:`preset_faults` places them at a step and rank.
PRESETS: dict[str, tuple[str, list[tuple[str, bool, dict[str, Any]]]]] = {
    "bitflip": (
        "one exponent bit flipped in one element of an attention projection output (transient SDC)",
        [("bitflip", True, {"duration": 1, "target": "blocks.1.attn.qkv", "where": "output", "bit": 30})],
    ),
    "nan": (
        "a NaN written into one element of an attention GEMM output (ATTNChecker's fault model)",
        [("nan", True, {"duration": 1, "target": "blocks.1.attn.scores", "where": "output"})],
    ),
    "near_inf": (
        "a near-INF value (1e10) in one element of an attention GEMM output",
        [("near_inf", True, {"duration": 1, "target": "blocks.1.attn.scores", "where": "output", "magnitude": 1e10})],
    ),
    "unhealthy-node": (
        "persistent small noise (1% relative) on every matmul output of one rank: an unhealthy node",
        [("noise", True, {"duration": 0, "target": "blocks.*", "where": "output", "magnitude": 1e-2})],
    ),
    "bad-batch": (
        "a batch of garbage tokens on every rank for one step: a benign, data-caused loss spike",
        [("bad_batch", False, {"duration": 1})],
    ),
    "lr-spike": (
        "the learning rate multiplied by 30 on every rank for 2 steps: an optimisation spike",
        [("lr_spike", False, {"duration": 2, "magnitude": 30.0})],
    ),
    "none": ("no fault: a clean run, which must raise no alert", []),
}


def preset_faults(name_or_path: str, *, rank: int, step: int, seed: int) -> tuple[str, list[dict[str, Any]]]:
    """The fault list for a preset name or a fault file (JSON lines or a JSON array)."""
    if name_or_path in PRESETS:
        desc, faults = PRESETS[name_or_path]
        return desc, [
            {"kind": k, "step": step, "rank": rank if one else None, **kw, "seed": seed} for k, one, kw in faults
        ]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError("fault", f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    faults = [f.to_dict() for f in load_faults(path)]
    return f"{len(faults)} fault(s) from {path}", faults


@dataclass
class DemoPlan:
    """The demo's job and faults: ``ranks`` is the layout's rank count under ``layout``."""

    fault: str
    seed: int
    ranks: int
    steps: int
    layout: Any
    """The tensor x pipeline x data parallel layout, or None for ``ranks`` data-parallel replicas."""
    guard_config: Any
    """The guard's :class:`~sdcwatch.telemetry.guard.config.GuardConfig`, or None: no guard."""
    description: str
    fault_dicts: list[dict[str, Any]]
    faults: list[Any]
    """The faults as :class:`~sdcwatch.testbed.faultspec.FaultSpec`, what the injector takes."""
    injected_step: int | None
    injected_rank: int | None
    """The one rank every fault hits, or None (no fault, or several ranks or all of them)."""

    @property
    def guard(self) -> bool:
        return self.guard_config is not None

    @property
    def run_id(self) -> str:
        return f"demo-{self.fault}-{self.seed}"


def _guard_config(guard: Any) -> Any:
    """True: the shipped guard settings, acting, an eviction carried out by the rank's replica
    leaving the quorum (the simulated job goes on without it); a GuardConfig: the caller's; falsy: no guard."""
    from sdcwatch.telemetry.guard.config import GuardConfig

    return guard if isinstance(guard, GuardConfig) else (GuardConfig(mode="act", on_evict="leave") if guard else None)


def _job_shape(ranks: int, steps: int, parallel: str | None, guard: bool) -> tuple[int, Any]:
    """The rank count and the 3D layout (None without ``parallel``), refused when too small to compare."""
    layout = None
    if parallel is not None:
        from sdcwatch.testbed.shard_plan import parse_layout, sizes

        layout = parse_layout(parallel)
        if guard:
            raise ConfigError("guard", "the guard is not simulated under tensor or pipeline parallelism")
        _, _, dp = sizes(layout)
        if dp < 2:
            raise ConfigError("parallel", f"the demo needs at least 2 data-parallel replicas to compare, got {layout}")
        ranks = layout.world
    if ranks < 2:
        raise ConfigError("ranks", f"the demo needs at least 2 ranks to compare, got {ranks}")
    if steps < 40:
        raise ConfigError("steps", f"the demo needs at least 40 steps (warm-up plus the fault), got {steps}")
    return ranks, layout


def _fault_position(
    ranks: int, steps: int, layout: Any, fault_rank: int | None, fault_step: int | None
) -> tuple[int, int]:
    """The (rank, step) a preset hits: by default a middle rank (one of the last pipeline stage,
    where the loss is, under a layout) at 55% of the run."""
    f_rank = (ranks // 2 - 1 if ranks > 2 else 1) if fault_rank is None else fault_rank
    if layout is not None and fault_rank is None:  # a rank of the last stage, where the loss is
        from sdcwatch.testbed.shard_plan import rank_at, sizes

        tp, pp, dp = sizes(layout)
        f_rank = rank_at(layout, dp // 2 - 1, pp - 1, tp - 1)
    f_step = max(30, int(steps * 0.55)) if fault_step is None else fault_step
    if not 0 <= f_rank < ranks:
        raise ConfigError("fault_rank", f"must be in 0..{ranks - 1}, got {f_rank}")
    return f_rank, f_step


def plan_demo(
    *,
    fault: str,
    ranks: int,
    steps: int,
    seed: int,
    fault_rank: int | None,
    fault_step: int | None,
    guard: Any,
    parallel: str | None,
) -> DemoPlan:
    """Check the demo's settings and place its faults (see :func:`~sdcwatch.demo.run.run_demo`)."""
    guard_config = _guard_config(guard)
    ranks, layout = _job_shape(ranks, steps, parallel, guard_config is not None)
    f_rank, f_step = _fault_position(ranks, steps, layout, fault_rank, fault_step)
    description, fault_dicts = preset_faults(fault, rank=f_rank, step=f_step, seed=seed)
    if layout is not None and fault in PRESETS:  # a preset's layer: one of its rank's stage
        from sdcwatch.testbed.model import GPTConfig
        from sdcwatch.testbed.shard_plan import place_fault

        fault_dicts = [place_fault(d, layout, GPTConfig().n_layer) for d in fault_dicts]
    faults = [FaultSpec.from_dict(d, where=f"fault {i}") for i, d in enumerate(fault_dicts)]
    ranks_hit = {f.rank for f in faults}
    return DemoPlan(
        fault=fault,
        seed=seed,
        ranks=ranks,
        steps=steps,
        layout=layout,
        guard_config=guard_config,
        description=description,
        fault_dicts=fault_dicts,
        faults=faults,
        injected_step=min((f.step for f in faults), default=None),
        injected_rank=next(iter(ranks_hit)) if len(ranks_hit) == 1 else None,
    )
