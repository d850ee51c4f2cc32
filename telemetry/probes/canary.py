"""The canary check: every data-parallel replica runs one fixed input through the same parameters,
so the outputs must agree bit for bit; one that does not points at that rank's hardware.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from sdcwatch.telemetry.probes import fingerprint as fp
from torch import nn

__all__ = ["canary_fingerprint", "canary_running", "canary_section"]

_RUNNING = threading.local()  # set while a canary forward runs: its attention and activations are not the step's


def canary_running() -> bool:
    """True on the thread running a canary forward pass (the probes do not record it)."""
    return getattr(_RUNNING, "active", False)


@contextlib.contextmanager
def canary_section() -> Iterator[None]:
    """Mark the code inside as a canary computation: the probes' hooks skip it, every other hook runs."""
    outer = canary_running()
    _RUNNING.active = True
    try:
        yield
    finally:
        _RUNNING.active = outer


def canary_fingerprint(model: nn.Module, inputs: Any) -> torch.Tensor:
    """Raw device fingerprint of ``model(inputs)``, run without gradients, in eval mode, unrecorded."""
    was_training = model.training
    try:
        with canary_section(), torch.no_grad():
            model.eval()
            out = model(inputs)
    finally:
        model.train(was_training)
    tensor = out if isinstance(out, torch.Tensor) else _first_tensor_of(out)
    return fp.fingerprint_device([tensor])


def _first_tensor_of(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        out = list(out.values())
    for item in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(item, torch.Tensor):
            return item
    raise TypeError(f"the canary forward returned no tensor ({type(out).__name__})")
