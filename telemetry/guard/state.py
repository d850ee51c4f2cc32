"""What the guard knows between steps, shared by its parts, and what of it a checkpoint carries: the
spike baselines, the budgets' windows, a learning-rate cut or mitigation in force (not snapshots).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.spike_baseline import RobustBaseline
from sdcwatch.core.validate import check_choice, check_int, check_number
from sdcwatch.telemetry.guard.config import MITIGATIONS, GuardConfig

__all__ = ["GuardState", "STATE_VERSION"]

#: The version of :meth:`GuardState.state_dict`'s layout.
STATE_VERSION = 3
_WINDOWS = ("skips", "rollbacks", "reruns", "mitigations")
_NO_MITIGATION = ("none", 1.0, -1)


@dataclass
class GuardState:
    """The guard's state between steps: baselines (the deciding part learns into them; one per local
    rank's loss and gradient norm, one of the all-reduced norm), budgets and cuts (the acting part's)."""

    loss: list[RobustBaseline]
    local_grad: list[RobustBaseline]
    grad: RobustBaseline
    skips: collections.deque[int] = field(default_factory=collections.deque)
    rollbacks: collections.deque[int] = field(default_factory=collections.deque)
    reruns: collections.deque[int] = field(default_factory=collections.deque)
    mitigations: collections.deque[int] = field(default_factory=collections.deque)
    """The steps of each budget's actions within the budget window, oldest first."""
    lr_scale: float = 1.0
    lr_until: int = -1
    """A rollback's learning-rate factor, in force through step ``lr_until``."""
    mitigation: tuple[str, float, int] = _NO_MITIGATION
    """The spike mitigation in force: kind, learning-rate factor, last step."""

    @classmethod
    def new(cls, config: GuardConfig, local_ranks: int) -> "GuardState":
        def baseline() -> RobustBaseline:
            return RobustBaseline(config.window, config.warmup, config.scale_alpha)

        return cls([baseline() for _ in range(local_ranks)], [baseline() for _ in range(local_ranks)], baseline())

    def room(self, budget: str, step: int, window: int, limit: int) -> bool:
        """Whether ``budget`` (skips, rollbacks, reruns, mitigations) has room for one more at ``step``."""
        steps = getattr(self, budget)
        while steps and steps[0] <= step - window:
            steps.popleft()
        return len(steps) < limit

    def state_dict(self) -> dict[str, Any]:
        """Saved with a checkpoint: a resumed job neither warms up again nor forgets a cut or a budget."""
        return {
            "version": STATE_VERSION,
            "loss": [b.snapshot() for b in self.loss],
            "local_grad": [b.snapshot() for b in self.local_grad],
            "grad": self.grad.snapshot(),
            **{k: list(getattr(self, k)) for k in _WINDOWS},
            "lr_scale": self.lr_scale,
            "lr_until": self.lr_until,
            "mitigation": list(self.mitigation),
        }

    def load_state_dict(self, state: dict[str, Any], resume_step: int | None = None) -> None:
        """Restore :meth:`state_dict`'s output (malformed: ConfigError naming the key, nothing changed);
        entries and cuts at or after ``resume_step`` (steps the job runs again) are dropped."""
        if not isinstance(state, dict):
            raise ConfigError("guard.state", f"must be a dict, got {type(state).__name__}")
        check_choice("guard.state.version", state.get("version"), (STATE_VERSION,))
        for key in ("loss", "local_grad", "grad", *_WINDOWS, "lr_scale", "lr_until", "mitigation"):
            if key not in state:
                raise ConfigError(f"guard.state.{key}", "missing")
        if not isinstance(state["loss"], (list, tuple)) or len(state["loss"]) != len(self.loss):
            raise ConfigError(
                "guard.state", f"saved for {len(state['loss'])} local ranks, this guard has {len(self.loss)}"
            )
        loss = [_baseline(self.grad, v, "loss") for v in state["loss"]]
        local = [_baseline(self.grad, v, "local_grad") for v in _list(state["local_grad"], "local_grad")]
        grad = _baseline(self.grad, state["grad"], "grad")
        windows = {k: [check_int(f"guard.state.{k}", s) for s in _list(state[k], k)] for k in _WINDOWS}
        lr_scale = check_number("guard.state.lr_scale", state["lr_scale"], 0, 1, lo_open=True)
        lr_until = check_int("guard.state.lr_until", state["lr_until"])
        if len(_list(state["mitigation"], "mitigation")) != 3:
            raise ConfigError(
                "guard.state.mitigation", f"must be [kind, lr factor, last step], got {state['mitigation']!r}"
            )
        kind, factor, until = state["mitigation"]
        check_choice("guard.state.mitigation", kind, MITIGATIONS)
        check_number("guard.state.mitigation", factor, 0, 1, lo_open=True)
        check_int("guard.state.mitigation", until)
        if resume_step is not None:  # a step at or after the resume step is one the job will run again
            latest = {k: (v[-1] if v else None) for k, v in windows.items()}
            windows = {k: [s for s in v if s < resume_step] for k, v in windows.items()}
            if latest["mitigations"] is None or latest["mitigations"] >= resume_step:
                kind, factor, until = _NO_MITIGATION
            if latest["rollbacks"] is None or latest["rollbacks"] >= resume_step:
                lr_scale, lr_until = 1.0, -1
        self.loss[:], self.local_grad[: len(local)], self.grad = loss, local[: len(self.local_grad)], grad
        for k in _WINDOWS:
            setattr(self, k, collections.deque(windows[k]))
        self.lr_scale, self.lr_until = float(lr_scale), int(lr_until)
        self.mitigation = (str(kind), float(factor), int(until))


def _list(value: Any, key: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"guard.state.{key}", f"must be a list, got {type(value).__name__}")
    return list(value)


def _baseline(like: RobustBaseline, saved: Any, key: str) -> RobustBaseline:
    """A baseline with ``like``'s settings holding ``saved``, a baseline's snapshot."""
    b = RobustBaseline(like.window, like.warmup, like.scale_alpha)
    if not isinstance(saved, dict) or set(saved) != {"buf", "scale", "n"}:
        raise ConfigError(f"guard.state.{key}", "must be a baseline's snapshot {buf, scale, n}")
    for v in _list(saved["buf"], key):
        check_number(f"guard.state.{key}", v)
    check_number(f"guard.state.{key}", saved["scale"], lo=0)
    check_int(f"guard.state.{key}", saved["n"], lo=0)
    b.restore(saved)
    return b
