"""The demo's fault presets: a named fault on a chosen rank and step, or a fault file of your own."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from sdcwatch.core.errors import ConfigError

__all__ = ["PRESETS", "preset_faults"]


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
