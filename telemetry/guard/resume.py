"""What of the guard's state a checkpoint carries, and how it is checked on resume.

Carried (between steps, valid in a new process): the spike baselines, the budgets' windows (skips,
reruns, rollbacks, mitigations), a learning-rate cut or spike mitigation in force. Not carried: a
rerun (it completes within its step), pending control decisions, snapshots.
"""

from __future__ import annotations

import collections
import math
from typing import Any

from sdcwatch.core.errors import ConfigError

__all__ = ["GuardResume", "STATE_VERSION"]

#: The version of :meth:`GuardResume.state_dict`'s layout (states without one are version 1).
STATE_VERSION = 2
_WINDOWS = ("skips", "rollbacks", "reruns", "mitigations")


def _bad(key: str, why: str) -> ConfigError:
    return ConfigError(f"guard.state.{key}", why)


def _numbers(state: dict[str, Any], key: str, integer: bool = False) -> list:
    vals = state.get(key, [])
    if not isinstance(vals, (list, tuple)):
        raise _bad(key, f"must be a list, got {type(vals).__name__}")
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _bad(key, f"must hold finite numbers, got {v!r}")
        if integer and int(v) != v:
            raise _bad(key, f"must hold step numbers, got {v!r}")
    return [int(v) for v in vals] if integer else [float(v) for v in vals]


class GuardResume:
    """``state_dict`` / ``load_state_dict`` of :class:`~sdcwatch.telemetry.guard.guard.Guard` (a mixin)."""

    def state_dict(self) -> dict[str, Any]:
        """The guard's own state between steps: saved with a checkpoint so a resumed job neither warms
        up again nor forgets a cut in force or a spent budget. Snapshots and reruns are not part of it."""
        kind, factor, until = self._mitigation
        return {
            "version": STATE_VERSION,
            "loss": [list(b.values) for b in self._loss_base],
            "local_grad": [list(b.values) for b in self._local_grad_base],
            "grad": list(self._grad_base.values),
            "skips": list(self._skips),
            "rollbacks": list(self._rollbacks),
            "reruns": list(self._rerun_steps),
            "mitigations": list(self._mitigations),
            "lr_scale": self._lr_scale,
            "lr_until": self._lr_until,
            "mitigation": [kind, factor, until],
        }

    def load_state_dict(self, state: dict[str, Any], resume_step: int | None = None) -> None:
        """Restore :meth:`state_dict`'s output after checking it (a malformed state raises ConfigError
        naming ``guard.state.<key>`` and changes nothing). ``resume_step``, the first step the job runs
        next: the budget entries at or after it, and a cut begun there (steps the job runs again), are dropped."""
        if not isinstance(state, dict):
            raise _bad("", f"must be a dict, got {type(state).__name__}")
        version = state.get("version", 1)
        if version not in (1, STATE_VERSION):
            raise _bad("version", f"unknown version {version!r} (this guard reads 1 and {STATE_VERSION})")
        for key in ("loss", "local_grad", "grad", "lr_scale", "lr_until"):
            if key not in state:
                raise _bad(key, "missing")
        if not isinstance(state["loss"], (list, tuple)) or len(state["loss"]) != len(self._loss_base):
            raise ConfigError(
                "guard.state", f"saved for {len(state['loss'])} local ranks, this guard has {len(self._loss_base)}"
            )
        loss = [_numbers({"loss": v}, "loss") for v in state["loss"]]
        local = [_numbers({"local_grad": v}, "local_grad") for v in state["local_grad"]]
        grad = _numbers(state, "grad")
        windows = {k: _numbers(state, k, integer=True) for k in _WINDOWS}
        lr_scale, lr_until = state["lr_scale"], state["lr_until"]
        if isinstance(lr_scale, bool) or not isinstance(lr_scale, (int, float)) or not 0 < lr_scale <= 1:
            raise _bad("lr_scale", f"must be a number in (0, 1], got {lr_scale!r}")
        if isinstance(lr_until, bool) or not isinstance(lr_until, int):
            raise _bad("lr_until", f"must be a step, got {lr_until!r}")
        kind, factor, until = state.get("mitigation", ["none", 1.0, -1])
        if kind not in ("none", "lr", "clip", "lr+clip") or not 0 < float(factor) <= 1 or int(until) != until:
            raise _bad("mitigation", f"must be [kind, lr factor in (0, 1], last step], got {state['mitigation']!r}")
        if resume_step is not None:  # a step at or after the resume step is one the job will run again
            latest = {k: (v[-1] if v else None) for k, v in windows.items()}
            windows = {k: [s for s in v if s < resume_step] for k, v in windows.items()}
            if latest["mitigations"] is None or latest["mitigations"] >= resume_step:
                kind, factor, until = "none", 1.0, -1
            if latest["rollbacks"] is None or latest["rollbacks"] >= resume_step:
                lr_scale, lr_until = 1.0, -1
        for bases, saved in ((self._loss_base, loss), (self._local_grad_base, local)):
            for b, vals in zip(bases, saved):
                b.clear()
                b.values.extend(vals)
        self._grad_base.clear()
        self._grad_base.values.extend(grad)
        self._skips = collections.deque(windows["skips"])
        self._rollbacks = collections.deque(windows["rollbacks"])
        self._rerun_steps = collections.deque(windows["reruns"])
        self._mitigations = collections.deque(windows["mitigations"])
        self._lr_scale, self._lr_until = float(lr_scale), int(lr_until)
        self._mitigation = (str(kind), float(factor), int(until))
