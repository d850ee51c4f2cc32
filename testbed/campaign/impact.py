"""Ground truth of a campaign trial: the impact class of its fault, from the faulted run and its
clean twin (:func:`impact_class`), and how big the fault's change was against the checksum bound
of the tensor it hit (:func:`fault_visibility`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from sdcwatch.testbed.campaign.branches import Branch

__all__ = ["SPIKE_REL", "DRIFT_REL", "IMPACT_CLASSES", "impact_class", "fault_visibility", "json_number"]

SPIKE_REL = 0.10
"""Relative excess of the faulted run's global loss over the twin's that makes a ``spike``."""
DRIFT_REL = 0.01
"""Final parameter distance between the twins, relative to the branch's own training motion,
that makes ``silent_drift``."""

#: Ground-truth impact classes, from harmless to fatal.
IMPACT_CLASSES = ("negligible", "silent_drift", "spike", "nonfinite")


def impact_class(faulted: Branch, twin: Branch, theta0: Any) -> dict[str, Any]:
    """The impact class of a fault and the numbers it rests on.

    Let ``L_f(s)`` and ``L_c(s)`` be the global loss (mean over ranks) of the faulted run and of its
    twin at branch step ``s``, ``θ_0`` the parameters at the checkpoint (``theta0``), ``θ_c`` the
    twin's final parameters and ``θ_f^r`` the final parameters of replica ``r`` of the faulted run
    (replicas differ only after a fault in one replica's memory). Then, checked in this order:

    * ``nonfinite``: some ``L_f(s)`` or some final parameter of some replica is NaN or infinite;
    * ``spike``: ``max_s (L_f(s) - L_c(s)) / L_c(s) >= SPIKE_REL`` (10%): the same data gives a loss at
      least 10% higher at some step (micro-batch noise cancels, the twins see the same batches);
    * ``silent_drift``: no spike, but ``max_r ||θ_f^r - θ_c|| / ||θ_c - θ_0|| >= DRIFT_REL`` (1%): the
      weights ended measurably elsewhere, relative to how far training moved them over the branch;
    * ``negligible``: none of the above.
    """
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
        "max_loss_excess": json_number(float(excess.max())),
        "param_drift": json_number(drift),
        "first_nonfinite_step": int(nonfinite_losses[0]) if nonfinite_losses.size else None,
    }


def json_number(v: float) -> float | str:
    """A number of the campaign's result as JSON holds it: finite as it is, ``"NaN"`` or ``"Infinity"``
    (either sign) otherwise."""
    return v if math.isfinite(v) else ("NaN" if math.isnan(v) else "Infinity")


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
        "change": json_number(change),
        "bound": bound,
        "check": check,
        "direction": direction,
        "tensor": inj.target,
    }
