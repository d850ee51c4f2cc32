"""The fault-injection campaign: sdcwatch and the baselines scored on the same faulted training runs.

The reference model is trained once with W simulated data-parallel ranks to a checkpoint; every
detector warms up on the records of that run. Then, per trial, two branches start from the
checkpoint with the same data (a data stream of their own, so trials do not repeat each other):
the *faulted run*, with one fault injected, and its *clean twin*. The twin gives the ground truth
and the false alarms; every detector sees both branches from the same warmed-up state.

Ground truth: the impact class of a fault
-----------------------------------------
Let ``L_f(s)`` and ``L_c(s)`` be the global loss (mean over ranks) of the faulted run and of its
twin at branch step ``s``, ``θ_0`` the parameters at the checkpoint, ``θ_c`` the twin's final
parameters and ``θ_f^r`` the final parameters of replica ``r`` of the faulted run (replicas differ
only after a fault in one replica's memory). Then, checked in this order:

* ``nonfinite``: some ``L_f(s)`` or some final parameter of some replica is NaN or infinite;
* ``spike``: ``max_s (L_f(s) - L_c(s)) / L_c(s) >= SPIKE_REL`` (10%): the same data gives a loss at
  least 10% higher at some step (micro-batch noise cancels, the twins see the same batches);
* ``silent_drift``: no spike, but ``max_r ||θ_f^r - θ_c|| / ||θ_c - θ_0|| >= DRIFT_REL`` (1%): the
  weights ended measurably elsewhere, relative to how far training moved them over the branch;
* ``negligible``: none of the above.

Scoring
-------
An *alarm* is, for sdcwatch, an incident opened (or escalated) by the default detection pipeline
with severity warning or critical, timing incidents (straggler, missing rank) left out: the
virtual ranks of one process have no meaningful step times. For a baseline it is any finding. A
faulted-run alarm counts as a detection when it comes at or after the fault's first step and the
clean twin does not raise the same alarm (same kind, same step). Per trial and detector:
``detected``, ``first_detection_step``, ``delay`` (steps after the fault's first step),
``localized_rank`` (the rank named by the earliest alarm that names exactly one rank, within
``window`` steps of the fault), ``attribution`` (``sdc`` when an alarm blames a rank,
``optimisation_data`` when one says the ranks are consistent, else ``None``) and ``false_alarms``
(alarms on the clean twin). The summary per fault class and detector is defined in
:func:`summarise` and in ``bench/README.md``.
"""

from __future__ import annotations

import copy
import math
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from sdcwatch.core.errors import ConfigError, FaultSpecError
from sdcwatch.core.kinds import RANK_BLAME_KINDS

__all__ = [
    "CampaignConfig",
    "Trial",
    "FAULT_CLASSES",
    "FLIP_CLASSES",
    "HARDWARE_CLASSES",
    "BENIGN_CLASSES",
    "SPIKE_REL",
    "IMPACT_CLASSES",
    "DRIFT_REL",
    "generate_trials",
    "trials_from_faults",
    "fault_class",
    "impact_class",
    "run_campaign",
    "summarise",
    "RecordCollector",
    "new_run",
    "frames_of",
    "make_detectors",
    "summary_table",
    "check_targets",
]

SPIKE_REL = 0.10
"""Relative excess of the faulted run's global loss over the twin's that makes a ``spike``."""
DRIFT_REL = 0.01
"""Final parameter distance between the twins, relative to the branch's own training motion,
that makes ``silent_drift``."""

#: Ground-truth impact classes, from harmless to fatal.
IMPACT_CLASSES = ("negligible", "silent_drift", "spike", "nonfinite")

#: Faults of the hardware (SDC): the detector should name the rank and blame it.
HARDWARE_CLASSES = (
    "nan_attn",
    "inf_attn",
    "near_inf_attn",
    "nan_other",
    "inf_other",
    "near_inf_other",
    "bitflip_exponent",
    "bitflip_mantissa",
    "unhealthy_node",
    "param_bitflip",
    # faults that are often masked (no effect on the loss) yet are the same hardware: extreme values
    # written into the residual stream, flips in container modules' outputs and in weights' mantissas
    "nonfinite_stream",
    "bitflip_container",
    "param_bitflip_mantissa",
)
#: Classes of one-element bit flips (their "detectable" subset is scored against the checksums).
FLIP_CLASSES = ("bitflip_exponent", "bitflip_mantissa", "param_bitflip", "bitflip_container", "param_bitflip_mantissa")
#: Benign instabilities of optimisation or data: detect them, blame no rank.
BENIGN_CLASSES = ("lr_spike", "bad_batch_all", "bad_batch_rank")
FAULT_CLASSES = HARDWARE_CLASSES + BENIGN_CLASSES

_ATTN_GEMMS = ("blocks.{l}.attn.scores", "blocks.{l}.attn.mix")
_OTHER = ("blocks.{l}.attn.qkv", "blocks.{l}.attn.proj", "blocks.{l}.mlp.fc", "blocks.{l}.mlp.proj", "head")
_CONTAINERS = ("blocks.{l}", "blocks.{l}.attn", "blocks.{l}.mlp")
_CONTAINER_NAME = re.compile(r"^blocks\.(\d+|\*)(\.attn|\.mlp)?$")
_MATMULS = ("blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.fc", "blocks.*.mlp.proj")
_TIMING_KINDS = frozenset({"straggler", "missing_rank"})


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


@dataclass
class Trial:
    """One fault to inject in one branch (its step counted from the checkpoint)."""

    index: int
    fault_class: str
    fault: Any  # FaultSpec, step relative to the checkpoint
    data_seed: int

    @property
    def culprit(self) -> int | None:
        """The rank a hardware fault hits (None for benign classes or faults on every rank)."""
        return self.fault.rank if self.fault_class in HARDWARE_CLASSES else None


# -- faults --------------------------------------------------------------------------------------


def fault_class(spec: Any) -> str:
    """The campaign class of a fault spec (how a fault read from a file is summarised)."""
    kind, target = spec.kind, spec.target
    exponent = 23 <= (spec.bit or 0) <= 30
    if spec.where == "param":
        return "param_bitflip" if exponent or kind != "bitflip" else "param_bitflip_mantissa"
    container = _CONTAINER_NAME.match(target) is not None
    if kind in ("nan", "inf", "near_inf"):
        if container:
            return "nonfinite_stream"
        return f"{kind}_attn" if (".attn.scores" in target or ".attn.mix" in target) else f"{kind}_other"
    if kind == "bitflip":
        if container:
            return "bitflip_container"
        return "bitflip_exponent" if exponent else "bitflip_mantissa"
    if kind in ("noise", "scale"):
        return "unhealthy_node"
    if kind == "lr_spike":
        return "lr_spike"
    return "bad_batch_all" if spec.rank is None else "bad_batch_rank"


def _generate_one(
    cls: str, rng: random.Random, world: int, n_layer: int, step: int, place: Callable | None = None
) -> dict[str, Any]:
    layer = rng.randrange(n_layer)
    rank = rng.randrange(world)
    spec = _generate_spec(cls, rng, rank, layer, step)
    return spec if place is None else place(spec)


def _generate_spec(cls: str, rng: random.Random, rank: int, layer: int, step: int) -> dict[str, Any]:
    seed = rng.randrange(1 << 30)
    base = {"rank": rank, "step": step, "seed": seed}
    if cls.endswith("_attn") or cls.endswith("_other"):
        kind = cls.rsplit("_", 1)[0]
        targets = _ATTN_GEMMS if cls.endswith("_attn") else _OTHER
        spec = {**base, "kind": kind, "target": rng.choice(targets).format(l=layer)}
        if kind == "near_inf":
            spec["magnitude"] = rng.choice((1.0, -1.0)) * 10 ** rng.uniform(10, 12)
        return spec
    if cls in ("bitflip_exponent", "bitflip_mantissa"):
        bit = rng.randrange(23, 31) if cls == "bitflip_exponent" else rng.randrange(0, 23)
        where = rng.choice(("output", "output", "grad"))
        target = (
            rng.choice(_OTHER + _ATTN_GEMMS[1:]).format(l=layer)
            if where == "output"
            else rng.choice(_OTHER).format(l=layer)
        )
        return {**base, "kind": "bitflip", "bit": bit, "where": where, "target": target}
    if cls == "nonfinite_stream":  # NaN, Inf or near-INF written into a block's output: the residual stream
        kind = rng.choice(("nan", "inf", "near_inf"))
        spec = {**base, "kind": kind, "where": "output", "target": rng.choice(_CONTAINERS).format(l=layer)}
        if kind == "near_inf":
            spec["magnitude"] = rng.choice((1.0, -1.0)) * 10 ** rng.uniform(10, 12)
        return spec
    if cls == "bitflip_container":  # any bit of one element of a block's (or its attention's, MLP's) output
        return {
            **base,
            "kind": "bitflip",
            "bit": rng.randrange(0, 31),
            "where": "output",
            "target": rng.choice(_CONTAINERS).format(l=layer),
        }
    if cls == "param_bitflip_mantissa":  # a memory flip in one replica's weights, mantissa bits
        return {
            **base,
            "kind": "bitflip",
            "where": "param",
            "bit": rng.randrange(0, 23),
            "target": rng.choice(_OTHER).format(l=layer),
        }
    if cls == "unhealthy_node":  # Ma et al.: a node whose matmuls are persistently a little off
        return {
            **base,
            "kind": "noise",
            "duration": 0,
            "target": rng.choice(_MATMULS),
            "magnitude": 10 ** rng.uniform(-4, -2),
        }
    if cls == "param_bitflip":  # a memory flip in one replica's weights: replicas disagree from now on
        return {
            **base,
            "kind": "bitflip",
            "where": "param",
            "bit": rng.randrange(23, 31),
            "target": rng.choice(_OTHER).format(l=layer),
        }
    if cls == "lr_spike":
        return {
            "kind": "lr_spike",
            "rank": None,
            "step": step,
            "seed": seed,
            "duration": rng.randint(1, 3),
            "magnitude": float(rng.choice((10, 20, 50, 100))),
        }
    if cls == "bad_batch_all":
        return {"kind": "bad_batch", "rank": None, "step": step, "seed": seed, "duration": rng.randint(1, 2)}
    return {"kind": "bad_batch", "rank": rank, "step": step, "seed": seed, "duration": rng.randint(1, 2)}


def generate_trials(config: CampaignConfig, n_layer: int | None = None) -> list[Trial]:
    """``config.trials`` seeded trials, the classes taken round-robin so a short campaign covers many."""
    from sdcwatch.testbed.faultspec import FaultSpec

    if n_layer is None:
        from sdcwatch.testbed.model import GPTConfig

        n_layer = GPTConfig().n_layer
    rng = random.Random(f"sdcwatch-campaign:{config.seed}")
    place = None
    if config.parallel is not None:
        from sdcwatch.testbed.shard_plan import place_fault

        place = lambda spec: place_fault(spec, config.parallel, n_layer)  # noqa: E731
    out = []
    for i in range(config.trials):
        cls = config.classes[i % len(config.classes)]
        step = rng.randint(*config.fault_offset)
        spec = FaultSpec.from_dict(_generate_one(cls, rng, config.world, n_layer, step, place), where=f"generated[{i}]")
        out.append(Trial(i, cls, spec, data_seed=rng.randrange(1 << 20)))
    return out


def trials_from_faults(faults: Sequence[Any], config: CampaignConfig) -> list[Trial]:
    """One trial per fault of a file; a fault's ``step`` counts from the checkpoint (0 = first branch step)."""
    rng = random.Random(f"sdcwatch-campaign-file:{config.seed}")
    out = []
    for i, spec in enumerate(faults):
        if spec.step >= config.branch_steps:
            raise FaultSpecError(
                "step",
                f"{spec.step} is past the branch ({config.branch_steps} steps after the "
                f"checkpoint; steps in a campaign faults file count from the checkpoint)",
                where=f"faults[{i}]",
            )
        if spec.rank is not None and spec.rank >= config.world:
            raise FaultSpecError("rank", f"{spec.rank} but the campaign has {config.world} ranks", where=f"faults[{i}]")
        out.append(Trial(i, fault_class(spec), spec, data_seed=rng.randrange(1 << 20)))
    return out


# -- running branches ------------------------------------------------------------------------------


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
        from sdcwatch.service.ingest import frames_over_wire

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


def fault_visibility(fault: Any, branch: Branch) -> dict[str, Any]:
    """How big the fault's change was against the checksum bound of the tensor it hit: a property
    of the fault alone, whatever the probes checked.

    ``detectable``: the change of the element exceeds the bound of the check that covers it (the
    forward checksum of the product whose output it is, the weight- or bias-gradient checksum,
    the weight check for a weight in memory), that bound computed when the fault was injected
    from the tensors it hit (:mod:`sdcwatch.testbed.fault_bounds`), on a step the probes check or
    not, of the share of the tensor the faulty rank computes under a ``tp x pp x dp`` layout (a
    tensor-parallel rank checks its own part); ``False`` when no checksum covers the tensor (a
    container's output, the attention logits), ``None`` when the fault changed no single element
    or its bound was not kept. ``check`` names the covering check; ``direction`` of a flip: ``up``
    when the magnitude grew, ``down`` when it shrank.
    """
    hits = [
        i
        for i in branch.injections
        if i.index is not None and i.step == fault.step and (fault.rank is None or i.rank == fault.rank)
    ]
    if not hits:
        return {"detectable": None, "change": None, "bound": None, "check": None, "direction": None}
    inj = hits[0]
    before, after = float(inj.before), float(inj.after)
    change = abs(after - before) if math.isfinite(after) and math.isfinite(before) else math.inf
    direction = "up" if not math.isfinite(after) or abs(after) > abs(before) else "down"
    covered = hasattr(inj, "check")  # a bounded injector's record
    check, bound = getattr(inj, "check", None), getattr(inj, "bound", None)
    return {
        "detectable": (bound is not None and change > bound) if covered else None,
        "change": _num(change),
        "bound": bound,
        "check": check,
        "direction": direction,
        "tensor": inj.target,
    }


# -- ground truth ------------------------------------------------------------------------------------


def impact_class(faulted: Branch, twin: Branch, theta0: Any) -> dict[str, Any]:
    """The impact class of a fault (see the module docstring) and the numbers it rests on."""
    import torch

    lf, lc = np.array(faulted.losses, float), np.array(twin.losses, float)
    nonfinite_losses = np.flatnonzero(~np.isfinite(lf))
    params_finite = all(bool(torch.isfinite(p).all()) for p in faulted.params)
    with np.errstate(all="ignore"):
        excess = np.where(np.isfinite(lf), (lf - lc) / lc, np.inf)
    motion = float(torch.linalg.vector_norm(twin.params[0] - theta0))
    if params_finite:
        drift = max(float(torch.linalg.vector_norm(p - twin.params[0])) for p in faulted.params) / max(motion, 1e-30)
    else:
        drift = math.inf
    if nonfinite_losses.size or not params_finite:
        impact = "nonfinite"
    elif float(excess.max()) >= SPIKE_REL:
        impact = "spike"
    elif drift >= DRIFT_REL:
        impact = "silent_drift"
    else:
        impact = "negligible"
    return {
        "class": impact,
        "max_loss_excess": _num(float(excess.max())),
        "param_drift": _num(drift),
        "first_nonfinite_step": int(nonfinite_losses[0]) if nonfinite_losses.size else None,
    }


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else ("NaN" if math.isnan(v) else "Infinity")


# -- detectors ---------------------------------------------------------------------------------------


@dataclass
class Alarm:
    """One alarm of one detector: what an operator would have been told, and when."""

    step: int
    kind: str
    ranks: tuple[int, ...]
    attribution: str | None
    message: str


class _SdcwatchRunner:
    """sdcwatch's default pipeline on frames: incidents opened or escalated are the alarms."""

    name = "sdcwatch"

    def __init__(self) -> None:
        from sdcwatch.service.pipeline import DetectionPipeline

        self.pipeline = DetectionPipeline()

    def fork(self) -> "_SdcwatchRunner":
        from sdcwatch.service.pipeline import DetectionPipeline

        other = object.__new__(_SdcwatchRunner)
        other.pipeline = DetectionPipeline(self.pipeline.settings)
        other.pipeline.restore(copy.deepcopy(self.pipeline.snapshot()))
        return other

    def feed(self, frame: Any) -> list[Alarm]:
        out = []
        for ev in self.pipeline.process_frame(frame):
            inc = ev.incident
            if ev.change == "resolved" or inc.kind in _TIMING_KINDS or inc.severity.value == "info":
                continue
            step = inc.first_step if ev.change == "opened" else inc.last_step
            out.append(
                Alarm(
                    step,
                    inc.kind,
                    tuple(inc.ranks),
                    _attribution(inc.kind, inc.ranks, inc.evidence, frame.world),
                    inc.message,
                )
            )
        return out


class _BaselineRunner:
    """A baseline detector on frames: every finding is an alarm."""

    def __init__(self, name: str, detector: Any) -> None:
        self.name, self.detector = name, detector

    def fork(self) -> "_BaselineRunner":
        return _BaselineRunner(self.name, copy.deepcopy(self.detector))

    def feed(self, frame: Any) -> list[Alarm]:
        return [
            Alarm(f.step, f.kind, tuple(f.ranks), _attribution(f.kind, f.ranks, f.evidence, frame.world), f.message)
            for f in self.detector.update(frame)
            if f.severity.value != "info"
        ]


def _attribution(kind: str, ranks: Sequence[int], evidence: dict, world: int) -> str | None:
    said = evidence.get("attribution") if isinstance(evidence, dict) else None
    if said == "sdc" or kind in RANK_BLAME_KINDS:
        return "sdc"
    if said == "optimisation_data":
        return "optimisation_data"
    if 0 < len(ranks) < world:  # a rule that fires on some ranks only blames them
        return "sdc"
    return None


def make_detectors(names: Iterable[str] | None = None) -> list[Any]:
    """sdcwatch plus the baselines (all, or those named)."""
    from sdcwatch.detectors.registry import baseline_classes

    baselines = baseline_classes()
    wanted = list(names) if names is not None else ["sdcwatch", *baselines]
    out = []
    for n in wanted:
        if n == "sdcwatch":
            out.append(_SdcwatchRunner())
        elif n in baselines:
            out.append(_BaselineRunner(n, baselines[n]()))
        else:
            raise ConfigError("campaign.detectors", f"unknown detector {n!r} (known: sdcwatch, {', '.join(baselines)})")
    return out


def _alarms(runner: Any, frames: Sequence[Any]) -> list[Alarm]:
    return [a for frame in frames for a in runner.feed(frame)]


def score_trial(
    trial: Trial, fault_step: int, faulted: list[Alarm], twin: list[Alarm], window: int, world: int
) -> dict[str, Any]:
    """One detector's verdict on one trial (see the module docstring)."""
    twin_keys = {(a.kind, a.step) for a in twin}
    hits = sorted(
        (a for a in faulted if a.step >= fault_step and (a.kind, a.step) not in twin_keys), key=lambda a: a.step
    )
    first = hits[0] if hits else None
    named = next((a.ranks[0] for a in hits if len(a.ranks) == 1 and a.step < fault_step + window), None)
    attributions = {a.attribution for a in hits}
    attribution = (
        "sdc" if "sdc" in attributions else ("optimisation_data" if "optimisation_data" in attributions else None)
    )
    return {
        "detected": first is not None,
        "first_detection_step": first.step if first else None,
        "delay": first.step - fault_step if first else None,
        "localized_rank": named,
        "attribution": attribution,
        "named_ranks": list(first.ranks) if first else [],
        "alarm_kinds": sorted({a.kind for a in hits}),
        "message": first.message if first else None,
        "false_alarms": len(twin),
        "false_alarm_kinds": sorted({a.kind for a in twin}),
    }


# -- the campaign ------------------------------------------------------------------------------------


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
) -> dict[str, Any]:
    """Run the whole campaign; returns the JSON-ready result (``config``, ``checkpoint``, ``trials``, ``summary``).

    With ``guard``, every trial runs three ways (see :mod:`sdcwatch.testbed.guard_campaign`): the clean twin
    and a third branch run guarded, and the result gains ``guard_summary`` and ``guard_targets``.
    """
    import torch

    torch.set_num_threads(1)
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    trials = trials_from_faults(faults, config) if faults is not None else generate_trials(config)
    runners = make_detectors(detectors)

    with tempfile.TemporaryDirectory(prefix="sdcwatch-campaign-", dir=workdir) as tmp:
        ckpt = Path(tmp) / "checkpoint.pt"
        shape = f" ({config.parallel})" if config.parallel else ""
        say(
            f"campaign: training {config.world} simulated ranks{shape} for {config.pretrain_steps} steps to the "
            f"checkpoint"
        )
        t0 = time.perf_counter()
        records: list = []
        # with the guard, the checkpoint carries its baselines (learnt in report mode: nothing changes)
        run = new_run(config, (), records, "campaign", guard=_report_guard() if guard else None)
        try:
            pre_losses = run.train(config.pretrain_steps)
            run.save_checkpoint(ckpt)  # flushes the last record
            theta0 = torch.cat([p.detach().reshape(-1) for p in run.params]).clone()
        finally:
            run.close()
        pre_frames = frames_of(records, config.world, config.wire)
        warm_alarms = {r.name: len(_alarms(r, pre_frames)) for r in runners}
        checkpoint = {
            "step": config.pretrain_steps,
            "seconds": round(time.perf_counter() - t0, 2),
            "loss_first": pre_losses[0],
            "loss_last": pre_losses[-1],
            "alarms_during_warmup": warm_alarms,
        }
        say(
            f"campaign: checkpoint at step {config.pretrain_steps} (loss {pre_losses[-1]:.3f}) in "
            f"{checkpoint['seconds']:.0f}s; {len(trials)} trials of {config.branch_steps} steps x {3 if guard else 2} "
            f"branches"
        )
        loop = None
        if guard:
            from sdcwatch.testbed import guard_campaign

            loop = _SdcwatchRunner()  # the service in the loop of the guarded branches, warmed up like the others
            _alarms(loop, pre_frames)

        results = []
        t_trials = time.perf_counter()
        for i, trial in enumerate(trials):
            fault = replace(trial.fault, step=trial.fault.step + config.pretrain_steps)
            faulted = run_branch(config, ckpt, [fault], trial.data_seed)
            if loop is not None:  # the twin runs guarded too: any action on it is a false action
                twin = guard_campaign.run_guarded_branch(config, ckpt, [], trial.data_seed, loop, run_id="campaign")
            else:
                twin = run_branch(config, ckpt, [], trial.data_seed)
            impact = impact_class(faulted, twin, theta0)
            visibility = fault_visibility(fault, faulted)
            verdicts = {}
            for r in runners:
                f_alarms = _alarms(r.fork(), faulted.frames)
                c_alarms = _alarms(r.fork(), twin.frames)
                verdicts[r.name] = score_trial(trial, fault.step, f_alarms, c_alarms, config.window, config.world)
            results.append(
                {
                    "index": trial.index,
                    "class": trial.fault_class,
                    "fault": fault.to_dict(),
                    "fault_step": fault.step,
                    "culprit_rank": trial.culprit,
                    "data_seed": trial.data_seed,
                    "impact": impact,
                    "visibility": visibility,
                    "clean_steps": len(twin.frames),
                    "detectors": verdicts,
                }
            )
            if loop is not None:
                guarded = guard_campaign.run_guarded_branch(config, ckpt, [fault], trial.data_seed, loop)
                g = results[-1]["guard"] = guard_campaign.guard_trial(
                    trial, trial.fault.step, faulted, twin, guarded, theta0, config.window
                )
                say(
                    f"campaign:   guarded: {', '.join(a['action'] + '@' + str(a['step']) for a in g['actions']) or 'no action'}"
                    f"; final loss excess {g['final_excess']['faulted']} -> {g['final_excess']['guarded']}, "
                    f"drift {g['drift']['faulted']} -> {g['drift']['guarded']}"
                )
            done = i + 1
            rate = (time.perf_counter() - t_trials) / done
            sw = verdicts.get("sdcwatch")
            note = (
                ""
                if sw is None
                else f" sdcwatch: {'detected' if sw['detected'] else 'missed'}"
                + (f" at +{sw['delay']}" if sw["detected"] else "")
                + (f", rank {sw['localized_rank']}" if sw["localized_rank"] is not None else "")
            )
            say(
                f"campaign: trial {done}/{len(trials)} {trial.fault_class} rank={fault.rank} -> {impact['class']};"
                f"{note} (eta {rate * (len(trials) - done):.0f}s)"
            )

    summary = summarise(results, [r.name for r in runners])
    extra: dict[str, Any] = {}
    if guard:
        extra = {
            "guard_summary": guard_campaign.summarise_guard(results),
            "guard_targets": guard_campaign.check_guard_targets(results),
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


def _report_guard() -> Any:
    from sdcwatch.telemetry.guard.config import GuardConfig

    return GuardConfig()


def _rate(num: int, den: int) -> float | None:
    return None if den == 0 else num / den


def summarise(trials: Sequence[dict], detectors: Sequence[str]) -> dict[str, Any]:
    """Per fault class (and ``all``) and detector.

    - ``recall``: detected / trials whose impact is not negligible (``recall_all``: over every trial);
    - ``recall_detectable``: of the trials whose change exceeded the checksum bound of the tensor it
      hit (``visibility.detectable``, :func:`fault_visibility`), detected at the fault's step and
      localised to its rank, whatever the impact;
    - ``at_fault_step``: of those, detected at the fault's first step (delay 0);
    - ``false_alarms_per_1k_clean_steps``: alarms on the clean twins per 1,000 twin steps;
    - ``localisation``: hardware classes with one faulty rank: named exactly that rank within the
      window / impactful trials (``localisation_all``: over every trial of the class);
    - ``median_delay``: steps from the fault's first step to the first detection (detected impactful);
    - ``attribution``: detected impactful trials whose attribution is the class's (``sdc`` for hardware,
      ``optimisation_data`` for benign) / detected impactful trials;
    - ``blamed_rank``: benign classes: detected trials that blamed a rank (attribution ``sdc``).
    """
    groups: dict[str, list[dict]] = {}
    for t in trials:
        groups.setdefault(t["class"], []).append(t)
    for t in trials:  # flips by what they did to the value: masked shrinking flips are the hard half
        direction = (t.get("visibility") or {}).get("direction")
        if t["class"] in FLIP_CLASSES and direction:
            groups.setdefault(f"flips_{direction}", []).append(t)
    groups["all"] = list(trials)
    out: dict[str, Any] = {}
    for cls, ts in groups.items():
        row: dict[str, Any] = {}
        impactful = [t for t in ts if t["impact"]["class"] != "negligible"]
        detectable = [t for t in ts if (t.get("visibility") or {}).get("detectable")]
        with_rank = [t for t in ts if t["culprit_rank"] is not None]
        with_rank_imp = [t for t in with_rank if t["impact"]["class"] != "negligible"]
        for d in detectors:
            v = lambda t: t["detectors"][d]  # noqa: E731
            det_imp = [t for t in impactful if v(t)["detected"]]
            delays = [v(t)["delay"] for t in det_imp]
            expected = lambda t: "optimisation_data" if t["class"] in BENIGN_CLASSES else "sdc"  # noqa: E731
            benign_det = [t for t in ts if t["class"] in BENIGN_CLASSES and v(t)["detected"]]
            clean_steps = sum(t["clean_steps"] for t in ts)
            row[d] = {
                "trials": len(ts),
                "impactful": len(impactful),
                "recall": _rate(len(det_imp), len(impactful)),
                "recall_all": _rate(sum(v(t)["detected"] for t in ts), len(ts)),
                "detectable": len(detectable),
                "recall_detectable": _rate(
                    sum(
                        v(t)["detected"] and v(t)["delay"] == 0 and v(t)["localized_rank"] == t["culprit_rank"]
                        for t in detectable
                    ),
                    len(detectable),
                ),
                "at_fault_step": _rate(sum(1 for x in delays if x == 0), len(impactful)),
                "false_alarms": sum(v(t)["false_alarms"] for t in ts),
                "clean_steps": clean_steps,
                "false_alarms_per_1k_clean_steps": _rate(1000 * sum(v(t)["false_alarms"] for t in ts), clean_steps),
                "localisation": _rate(
                    sum(v(t)["localized_rank"] == t["culprit_rank"] for t in with_rank_imp), len(with_rank_imp)
                ),
                "localisation_all": _rate(
                    sum(v(t)["localized_rank"] == t["culprit_rank"] for t in with_rank), len(with_rank)
                ),
                "median_delay": median(delays) if delays else None,
                "attribution": _rate(sum(v(t)["attribution"] == expected(t) for t in det_imp), len(det_imp)),
                "blamed_rank": _rate(sum(v(t)["attribution"] == "sdc" for t in benign_det), len(benign_det)),
            }
        out[cls] = row
    return out


def check_targets(trials: Sequence[dict], summary: dict[str, Any], detector: str = "sdcwatch") -> list[dict[str, Any]]:
    """The issue's targets for ``detector``: each with the measured value, the goal and whether it was met."""

    def of(classes: Iterable[str]) -> list[dict]:
        classes = set(classes)
        return [t for t in trials if t["class"] in classes]

    def row(name: str, num: int, den: int, goal: float) -> dict[str, Any]:
        value = _rate(num, den)
        return {
            "target": name,
            "value": value,
            "count": f"{num}/{den}",
            "goal": goal,
            "met": None if value is None else value >= goal,
        }

    out = []
    nf = of(c for c in HARDWARE_CLASSES if c.startswith(("nan_", "inf_", "near_inf_", "nonfinite_")))
    out.append(
        row(
            "non-finite and near-INF (residual stream included) detected at their step and localised",
            sum(
                1
                for t in nf
                if t["detectors"][detector]["delay"] == 0
                and t["detectors"][detector]["localized_rank"] == t["culprit_rank"]
            ),
            len(nf),
            1.0,
        )
    )
    bf = [t for t in of(FLIP_CLASSES) if t["impact"]["class"] != "negligible"]
    out.append(
        row(
            "bit flips with a non-negligible impact detected",
            sum(t["detectors"][detector]["detected"] for t in bf),
            len(bf),
            0.99,
        )
    )
    dt = [t for t in of(FLIP_CLASSES) if (t.get("visibility") or {}).get("detectable")]
    out.append(
        row(
            "detectable flips (above the checksum bound) detected at their step and localised",
            sum(
                1
                for t in dt
                if t["detectors"][detector]["delay"] == 0
                and t["detectors"][detector]["localized_rank"] == t["culprit_rank"]
            ),
            len(dt),
            0.99,
        )
    )
    imp = [t for t in trials if t["impact"]["class"] != "negligible" and t["class"] in HARDWARE_CLASSES]
    out.append(
        row(
            "impactful hardware faults detected (every class)",
            sum(t["detectors"][detector]["detected"] for t in imp),
            len(imp),
            0.99,
        )
    )
    un = of(("unhealthy_node",))
    out.append(
        row(
            "unhealthy node localised within the window",
            sum(t["detectors"][detector]["localized_rank"] == t["culprit_rank"] for t in un),
            len(un),
            0.90,
        )
    )
    bn = [t for t in of(BENIGN_CLASSES) if t["impact"]["class"] in ("spike", "nonfinite")]
    out.append(
        row(
            "benign spikes detected and not blamed on a rank",
            sum(
                1
                for t in bn
                if t["detectors"][detector]["detected"] and t["detectors"][detector]["attribution"] != "sdc"
            ),
            len(bn),
            0.95,
        )
    )
    clean = sum(t["clean_steps"] for t in trials)
    alarms = sum(t["detectors"][detector]["false_alarms"] for t in trials)
    out.append(
        {
            "target": "zero false alarms over >= 10,000 clean steps",
            "value": alarms,
            "count": f"{alarms} in {clean}",
            "goal": 0,
            "met": alarms == 0 and clean >= 10_000,
        }
    )
    worse = []
    for cls, row_ in summary.items():
        if cls == "all" or detector not in row_:
            continue
        me = row_[detector]
        for other, s in row_.items():
            if other == detector:
                continue
            for key in ("recall", "localisation", "attribution"):
                if s[key] is not None and (me[key] is None or s[key] > me[key]):
                    worse.append(
                        f"{cls}: {other} {key} {s[key]:.0%} > {me[key] if me[key] is None else format(me[key], '.0%')}"
                    )
            if s["false_alarms"] < me["false_alarms"]:
                worse.append(f"{cls}: {other} fewer false alarms ({s['false_alarms']} < {me['false_alarms']})")
    out.append(
        {
            "target": "better than every baseline on every class",
            "value": len(worse),
            "count": "; ".join(worse),
            "goal": 0,
            "met": not worse,
        }
    )
    return out


def summary_table(result: dict[str, Any]) -> str:
    """The summary as a markdown table (one row per fault class and detector)."""

    def f(x: Any, pct: bool = True) -> str:
        if x is None:
            return "–"
        return f"{100 * x:.0f}%" if pct else (f"{x:.1f}" if isinstance(x, float) else str(x))

    lines = [
        "| class | detector | trials (impactful, detectable) | recall | recall, detectable at step | at fault step "
        "| false alarms /1k clean steps | localisation | median delay | attribution | blamed a rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cls, row in result["summary"].items():
        for d, s in row.items():
            lines.append(
                f"| {cls} | {d} | {s['trials']} ({s['impactful']}, {s.get('detectable', 0)}) | {f(s['recall'])} | "
                f"{f(s.get('recall_detectable'))} | {f(s['at_fault_step'])} | "
                f"{f(s['false_alarms_per_1k_clean_steps'], False)} | {f(s['localisation'])} | "
                f"{f(s['median_delay'], False)} | {f(s['attribution'])} | {f(s['blamed_rank'])} |"
            )
    targets = result.get("targets") or []
    if targets:
        lines += ["", "| target (sdcwatch) | measured | met |", "|---|---|---|"]
        for t in targets:
            met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {t['count'] or t['value']} | {met} |")
    return "\n".join(lines)
