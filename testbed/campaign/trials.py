"""The campaign's trials: one fault each, with the data stream of its branches; drawn by a seeded
generator that takes the fault classes round-robin (:func:`generate_trials`), or one per fault of
a file (:func:`trials_from_faults`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from sdcwatch.core.errors import FaultSpecError
from sdcwatch.testbed.campaign.fault_classes import HARDWARE_CLASSES, fault_class

if TYPE_CHECKING:
    from sdcwatch.testbed.campaign.run import CampaignConfig

__all__ = ["Trial", "generate_trials", "trials_from_faults"]

_ATTN_GEMMS = ("blocks.{l}.attn.scores", "blocks.{l}.attn.mix")
_OTHER = ("blocks.{l}.attn.qkv", "blocks.{l}.attn.proj", "blocks.{l}.mlp.fc", "blocks.{l}.mlp.proj", "head")
_CONTAINERS = ("blocks.{l}", "blocks.{l}.attn", "blocks.{l}.mlp")
_MATMULS = ("blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.fc", "blocks.*.mlp.proj")


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
