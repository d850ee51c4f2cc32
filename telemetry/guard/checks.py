"""The guard's judging and agreeing parts: the robust spike baseline, one step's values, and how
the processes agree (a MAX all-reduce of a few integers under torch.distributed; nothing to do for a
process that holds every rank)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Baseline",
    "StepValues",
    "LocalGroup",
    "DistGroup",
    "same",
    "to_numpy",
    "suspects_from",
    "grad_norm",
    "rng_state",
    "set_rng_state",
    "ballot",
    "BIG",
    "drop_through",
]

BIG = 1 << 40
#: The codes of the actions a control decision may carry (their index in ``guard_config.ACTIONS``).
_ACTION_CODES = {"skip": 1, "rollback": 3, "evict": 4}


class Baseline:
    """Recent clean values of one series, for the robust spike rule.

    The median and MAD are recomputed after every ``refresh`` new values, not on every step: a
    baseline of 64 steps moves slowly, and two medians a step would cost more than the rest of the
    guard together.
    """

    __slots__ = ("values", "_stats", "_fresh", "refresh")

    def __init__(self, window: int, refresh: int = 8) -> None:
        self.values: collections.deque[float] = collections.deque(maxlen=window)
        self._stats: tuple[float, float] | None = None
        self._fresh = 0
        self.refresh = refresh

    def add(self, v: float) -> None:
        self.values.append(v)
        self._fresh += 1
        if self._fresh >= self.refresh:
            self._stats = None

    def clear(self) -> None:
        self.values.clear()
        self._stats = None

    def spike(self, v: float, z: float, rel: float, warmup: int) -> bool:
        if len(self.values) < warmup:
            return False
        if self._stats is None:
            a = np.fromiter(self.values, float, len(self.values))
            med = float(np.median(a))
            self._stats = (med, max(1.4826 * float(np.median(np.abs(a - med))), 1e-3 * abs(med), 1e-12))
            self._fresh = 0
        med, scale = self._stats
        return v > med + rel * abs(med) and v > med + z * scale


@dataclass
class StepValues:
    """One evaluation of a step, as plain numbers: per local rank losses and gradient norms."""

    losses: np.ndarray  # (n_local,)
    grad_norm: float  # of the all-reduced gradient (NaN when not given)
    local_grad: np.ndarray | None  # (n_local,) local gradient norms, when the caller has them

    def same_as(self, other: "StepValues", tol: float) -> bool:
        a = [self.losses, np.array([self.grad_norm])] + ([self.local_grad] if self.local_grad is not None else [])
        b = [other.losses, np.array([other.grad_norm])] + ([other.local_grad] if other.local_grad is not None else [])
        return all(same(x, y, tol) for x, y in zip(a, b))


def same(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    if a.shape != b.shape:
        return False
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(fa, fb):
        return False
    # non-finite cells must match exactly (NaN = NaN here: the same fault gives the same NaN)
    if not np.array_equal(np.nan_to_num(a[~fa], nan=0.5), np.nan_to_num(b[~fb], nan=0.5)):
        return False
    with np.errstate(all="ignore"):
        diff = np.abs(a[fa] - b[fb])
        return bool(np.all(diff <= tol * np.maximum(np.abs(a[fa]), np.abs(b[fb]))))


def to_numpy(x: Any) -> np.ndarray:
    if x is None:
        return np.array([np.nan])
    if hasattr(x, "detach"):
        x = x.detach().double().cpu().numpy()
    return np.atleast_1d(np.asarray(x, dtype=float))


class LocalGroup:
    """The agreement of a process that holds every rank (the simulated run, a single process)."""

    def max(self, values: list[int]) -> list[int]:
        return list(values)

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def gather_hosts(self, host: str) -> list[str]:
        return [host]

    def broadcast_text(self, text: str) -> str:
        return text


class DistGroup:
    """Agreement through torch.distributed: MAX of a few integers, SUM of a few floats."""

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self.dist, self.group = dist, group
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def max(self, values: list[int]) -> list[int]:
        import torch

        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def sum(self, values: list[float]) -> list[float]:
        import torch

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, group=self.group)
        return [float(v) for v in t.tolist()]

    def gather_hosts(self, host: str) -> list[str]:
        out: list[Any] = [None] * self.dist.get_world_size(self.group)
        self.dist.all_gather_object(out, host, group=self.group)
        return [str(h) for h in out]

    def broadcast_text(self, text: str) -> str:
        box = [text]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return str(box[0])


def drop_through(steps: "collections.deque[int]", step: int) -> None:
    """Forget the steps of a budget's window at or before ``step`` (the oldest first)."""
    while steps and steps[0] <= step:
        steps.popleft()


def suspects_from(hi: int, lo_enc: int) -> list[int]:
    if not hi:
        return []
    lo = BIG - lo_enc - 1
    return [lo] if lo == hi - 1 else [lo, hi - 1]


def grad_norm(optimizer: Any) -> float:
    import torch

    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def rng_state() -> Any:
    import torch

    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Any) -> None:
    if state is None:
        return
    import torch

    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def ballot(flag: int, suspects: set[int], control: Any) -> list[int]:
    """What this process brings to the step's agreement (MAX over processes), as integers:
    [flag, max suspect + 1, BIG - (min suspect + 1), control action, its rank + 1, its
    since_step + 1, its lr_factor x 1e6]. Only the process of rank 0 fills the control part."""
    lo = min(suspects) if suspects else None
    ballot = [flag, (max(suspects) + 1) if suspects else 0, (BIG - (lo + 1)) if lo is not None else 0, 0, 0, 0, 0]
    if control is not None:
        ballot[3] = _ACTION_CODES[control.action]
        ballot[4] = (control.ranks[0] + 1) if control.ranks else 0
        ballot[5] = (control.since_step + 1) if control.since_step is not None else 0
        ballot[6] = int(round(control.lr_factor * 1e6))
    return ballot
