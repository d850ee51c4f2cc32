"""The campaign's fault classes: hardware faults (SDC) to blame on a rank, benign instabilities of
optimisation or data to blame on none, the one-element flips among them, and the class of a
fault spec (:func:`fault_class`)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["HARDWARE_CLASSES", "FLIP_CLASSES", "BENIGN_CLASSES", "FAULT_CLASSES", "fault_class"]

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

_CONTAINER_NAME = re.compile(r"^blocks\.(\d+|\*)(\.attn|\.mlp)?$")


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
