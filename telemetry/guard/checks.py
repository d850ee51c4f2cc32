"""The guard's deciding and agreeing parts: one step's values and their verdict, and how the
processes agree (a MAX all-reduce of a few integers under torch.distributed)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from sdcwatch.core.errors import ConfigError
from sdcwatch.telemetry.guard.config import GuardConfig
from sdcwatch.telemetry.guard.state import GuardState

__all__ = [
    "StepJudge",
    "StepValues",
    "LocalGroup",
    "DistGroup",
    "TensorAgreement",
    "same",
    "to_numpy",
    "suspects_from",
    "grad_norm",
    "rng_state",
    "set_rng_state",
    "ballot",
]

BIG = 1 << 40
#: The longest control reason and host name the processes agree on, in bytes.
TEXT_BYTES, HOST_BYTES = 1024, 255
#: The codes of the actions a control decision may carry (their index in ``guard_config.ACTIONS``).
_ACTION_CODES = {"skip": 1, "rollback": 3, "evict": 4}


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


class StepJudge:
    """The deciding part of the guard: a step's values, their verdict (non-finite, or a spike by
    :mod:`sdcwatch.core.spike_baseline`'s rule), and learning an applied step into the baselines."""

    def __init__(self, config: GuardConfig, local_ranks: tuple[int, ...], state: GuardState) -> None:
        self.config, self.local_ranks, self.state = config, local_ranks, state

    def values(self, result: Any, optimizer: Any) -> StepValues:
        """The closure's ``result`` as numbers (the gradient norm from ``optimizer`` when not given)."""
        if isinstance(result, tuple):
            loss, gn, local = (list(result) + [None, None])[:3]
        else:
            loss, gn, local = result, None, None
        losses = to_numpy(loss)
        if losses.size == 1 and len(self.local_ranks) > 1:
            losses = np.repeat(losses, len(self.local_ranks))
        if losses.size != len(self.local_ranks):
            raise ConfigError("guard.compute", f"returned {losses.size} losses for {len(self.local_ranks)} local ranks")
        grad = float(to_numpy(grad_norm(optimizer) if gn is None else gn)[0])
        return StepValues(losses, grad, None if local is None else to_numpy(local))

    def judge(self, v: StepValues) -> tuple[int, set[int]]:
        """(flag, suspect ranks): 2 non-finite, 1 spike, 0 clean (3, a checksum, is judged by the guard)."""
        c, st, ranks = self.config, self.state, self.local_ranks
        bad = [r for r, x in zip(ranks, v.losses) if not math.isfinite(x)]
        if v.local_grad is not None:
            bad += [r for r, x in zip(ranks, v.local_grad) if not math.isfinite(x) and r not in bad]
        if bad or not math.isfinite(v.grad_norm):
            return 2, set(bad)
        spiked = {r for r, x, b in zip(ranks, v.losses, st.loss) if c.loss.spikes(*b.score(float(x))[:2])}
        if v.local_grad is not None:
            spiked |= {
                r for r, x, b in zip(ranks, v.local_grad, st.local_grad) if c.grad_norm.spikes(*b.score(float(x))[:2])
            }
        global_spike = c.grad_norm.spikes(*st.grad.score(v.grad_norm)[:2])
        return (1 if spiked or global_spike else 0), spiked

    def learn(self, v: StepValues) -> None:
        """Learn an applied step's values (non-finite and non-positive ones are not learnt)."""
        for b, x in zip(self.state.loss, v.losses):
            b.update(float(x))
        if v.local_grad is not None:
            for b, x in zip(self.state.local_grad, v.local_grad):
                b.update(float(x))
        self.state.grad.update(v.grad_norm)


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


class TensorAgreement:
    """Agreement through all-reduces of small tensors on ``device`` (texts: MAX over zeros elsewhere);
    a subclass says how a tensor is all-reduced (:meth:`reduce`) and who this process is."""

    rank: int
    world: int
    device: Any = "cpu"

    def reduce(self, t: Any, op: str) -> Any:
        """``t`` all-reduced in place with ``op`` ("max" or "sum"); returns it."""
        raise NotImplementedError

    def max(self, values: list[int]) -> list[int]:
        import torch

        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        return [int(v) for v in self.reduce(t, "max").tolist()]

    def sum(self, values: list[float]) -> list[float]:
        import torch

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return [float(v) for v in self.reduce(t, "sum").tolist()]

    def _texts(self, rows: int, row: int, text: str, width: int) -> list[str]:
        """A ``rows`` x ``width`` table of UTF-8 bytes, ``text`` in row ``row`` (-1: none), MAX-reduced."""
        import torch

        t = torch.zeros(rows, width, dtype=torch.int64, device=self.device)
        raw = text.encode("utf-8")[:width]
        if row >= 0:
            t[row, : len(raw)] = torch.tensor(list(raw), dtype=torch.int64, device=self.device)
        return [bytes(int(b) for b in r if b).decode("utf-8", errors="replace") for r in self.reduce(t, "max").tolist()]

    def broadcast_text(self, text: str) -> str:
        """Rank 0's ``text`` (its first :data:`TEXT_BYTES` bytes) on every process."""
        return self._texts(1, 0 if self.rank == 0 else -1, text, TEXT_BYTES)[0]

    def gather_hosts(self, host: str) -> list[str]:
        """Every rank's host name (its first :data:`HOST_BYTES` bytes; a rank that left: "")."""
        return self._texts(self.world, self.rank, host, HOST_BYTES)


class DistGroup(TensorAgreement):
    """Agreement through torch.distributed (on the GPU under NCCL)."""

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def reduce(self, t: Any, op: str) -> Any:
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM, group=self.group)
        return t

    def broadcast_parameters(self, model: Any, src: int) -> None:
        """Make every process's parameters rank ``src``'s (a rollback's resync)."""
        import torch

        with torch.no_grad():
            for p in model.parameters():
                self.dist.broadcast(p.data, src=src, group=self.group)


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
    """This process's integers for the step's MAX agreement: [flag, max suspect + 1, BIG - (min
    suspect + 1), control action, its rank + 1, since_step + 1, lr_factor x 1e6] (control: rank 0's)."""
    lo = min(suspects) if suspects else None
    ballot = [flag, (max(suspects) + 1) if suspects else 0, (BIG - (lo + 1)) if lo is not None else 0, 0, 0, 0, 0]
    if control is not None:
        ballot[3] = _ACTION_CODES[control.action]
        ballot[4] = (control.ranks[0] + 1) if control.ranks else 0
        ballot[5] = (control.since_step + 1) if control.since_step is not None else 0
        ballot[6] = int(round(control.lr_factor * 1e6))
    return ballot
