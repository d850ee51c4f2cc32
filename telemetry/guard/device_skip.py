"""The skip decided on the device: a non-finite or spiking step's update made a no-op with no host sync.

:class:`DeviceSkip` judges each step from values every rank already holds alike (the all-reduced
gradient norm, a global loss, a non-finite count) against running statistics kept as device tensors,
and steps the optimizer so that a rejected update changes nothing: through ``found_inf`` for
optimizers that read it (torch's fused Adam, AdamW, SGD, Adagrad), else by restoring the parameters
and the optimizer state with ``torch.where`` on the device flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from sdcwatch.core.errors import ConfigError

__all__ = ["DeviceSkip", "DeviceSkipConfig"]

_HOW = ("auto", "found_inf", "restore")


@dataclass(frozen=True)
class DeviceSkipConfig:
    """When the device skip rejects an update. A spike must pass both the z-score and the relative excess."""

    z: float = 6.0
    """A value spikes when it is more than ``z`` standard deviations above its running mean ..."""
    loss_rel: float = 0.5
    """... and, for the loss, more than this fraction above the mean (both must hold)."""
    grad_rel: float = 2.0
    """The relative excess that makes a gradient-norm spike (three times the mean by default)."""
    window: int = 128
    """Horizon of the running mean and variance (exact over the first ``window`` clean steps, then
    exponentially weighted with weight 1/window)."""
    warmup: int = 32
    """Clean steps seen before spikes are judged (non-finite values are judged from the first step)."""
    max_spike_skips: int = 4
    """Consecutive spike skips allowed; the next spike is taken as a change of level, and the running
    statistics start over from it (a non-finite update is never applied)."""
    judge_loss: bool = True
    """Judge the loss passed to :meth:`DeviceSkip.step` too. Leave it on only when the loss is the same
    on every rank (all-reduced, or a single process): the verdicts must agree or the replicas part."""
    how: str = "auto"
    """"found_inf" (the optimizer skips its own update: no copy), "restore" (the parameters and the
    optimizer state are copied before the step and put back where the flag says so), "auto" (found_inf
    when the optimizer supports it, else restore)."""

    def __post_init__(self) -> None:
        for key in ("z", "loss_rel", "grad_rel"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ConfigError(f"device_skip.{key}", f"must be a number > 0, got {v!r}")
        for key, lo in (("window", 2), ("warmup", 1), ("max_spike_skips", 0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"device_skip.{key}", f"must be an integer >= {lo}, got {v!r}")
        if self.how not in _HOW:
            raise ConfigError("device_skip.how", f"must be one of {', '.join(_HOW)}, got {self.how!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeviceSkipConfig":
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ConfigError(f"device_skip.{key}", f"unknown setting (known: {', '.join(sorted(known))})")
        return cls(**d)


class DeviceSkip:
    """Steps ``optimizer`` unless the step's values are non-finite or a spike, deciding on the device.

    In a plain loop, in place of ``optimizer.step()``::

        skip = DeviceSkip(optimizer)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # all-reduced grads: equal on every rank
        skip.step(norm, loss=global_loss)  # no .item(), no collective
        watch.step(step, loss=loss, **skip.telemetry())  # the verdict travels with the record, still on the device

    Nothing here reads a device value on the host; :meth:`skipped` does, when asked (a logging step).
    """

    def __init__(self, optimizer: Any, config: DeviceSkipConfig | None = None) -> None:
        self.optimizer = optimizer
        self.config = config or DeviceSkipConfig()
        if not isinstance(self.config, DeviceSkipConfig):
            raise ConfigError("device_skip.config", f"must be a DeviceSkipConfig, got {type(self.config).__name__}")
        fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        if self.config.how == "found_inf" and not fused:
            raise ConfigError(
                "device_skip.how",
                f"found_inf needs an optimizer that reads it (fused=True); {type(optimizer).__name__}",
            )
        self.how = "found_inf" if self.config.how == "found_inf" or (self.config.how == "auto" and fused) else "restore"
        self._stats: Any = None  # [n, mean_loss, mean_grad, var_loss, var_grad, run of spike skips]
        self._ok: Any = None
        self._reason: Any = None
        self._count: Any = None  # [skips, non-finite skips, spike skips]
        self._saved: dict[int, Any] = {}

    # -- the step ---------------------------------------------------------------------------------

    def step(self, grad_norm: Any, *, loss: Any = None, nonfinite: Any = None) -> Any:
        """Judge this step and update (or make the update a no-op). ``grad_norm``: the norm of the
        all-reduced gradient (what ``clip_grad_norm_`` returns); ``loss``: a loss equal on every rank;
        ``nonfinite``: a count of non-finite values every rank agrees on. Returns the device flag
        (``True``: the update was applied)."""
        import torch

        ok, reason = self.judge(grad_norm, loss=loss, nonfinite=nonfinite)
        if self.how == "found_inf":
            self.optimizer.found_inf = (~ok).to(torch.float32)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        else:
            tensors = self._tensors(ok.device)
            saved = self._save(tensors)
            had = {id(p) for p in self.optimizer.state}
            self.optimizer.step()
            self._put_back(ok, tensors, saved, had)
        return ok

    def judge(self, grad_norm: Any, *, loss: Any = None, nonfinite: Any = None) -> tuple[Any, Any]:
        """The device flag (apply the update?) and reason code (0 none, 1 non-finite, 2 spike), with the
        running statistics updated by a clean step; no update is made here."""
        import torch

        c = self.config
        g = torch.as_tensor(grad_norm).detach().reshape(()).to(torch.float32)
        if self._stats is None:
            self._init(g.device)
        if loss is None:
            x = torch.stack([g, g])
        else:
            x = torch.stack([torch.as_tensor(loss).detach().reshape(()).to(device=g.device, dtype=torch.float32), g])
        st = self._stats
        n, mean, var, run = st[0], st[1:3], st[3:5], st[5]
        finite = torch.isfinite(x).all()
        if nonfinite is not None:
            finite = finite & (torch.as_tensor(nonfinite).detach().reshape(()).to(g.device) == 0)
        safe = torch.where(torch.isfinite(x), x, mean)
        std = torch.sqrt(var).clamp_min(1e-6 * mean.abs() + 1e-12)
        high = ((safe - mean) > c.z * std) & (safe > mean * self._rel)
        if loss is None or not c.judge_loss:
            high = high & self._grad_only
        spike = (n >= c.warmup) & high.any() & finite
        forced = spike & (run >= c.max_spike_skips)  # a lasting change of level: take it, start over
        ok = finite & (~spike | forced)
        alpha = torch.clamp_min(1.0 / (n + 1.0), 1.0 / c.window)
        d = safe - mean
        fresh = torch.where(forced, torch.ones_like(n), n)
        learn = ok & ~forced
        new = torch.cat(
            [
                torch.where(learn, n + 1, fresh).reshape(1),
                torch.where(learn, mean + alpha * d, torch.where(forced, safe, mean)),
                torch.where(
                    learn, (1 - alpha) * (var + alpha * d * d), torch.where(forced, torch.zeros_like(var), var)
                ),
                torch.where(spike & ~forced, run + 1, torch.zeros_like(run)).reshape(1),
            ]
        )
        st.copy_(new)
        reason = torch.where(~finite, 1.0, torch.where(ok, 0.0, 2.0))
        self._count += torch.stack([~ok, ~finite, ~ok & finite]).to(self._count.dtype)
        self._ok, self._reason = ok, reason
        return ok, reason

    # -- what it did ------------------------------------------------------------------------------

    def telemetry(self) -> dict[str, Any]:
        """The last step's verdict as the guard's record scalars, still device tensors (``guard_action``
        1: skip, 0: none; ``guard_reason`` 1: non-finite, 2: spike): pass them to ``watch.step``."""
        if self._ok is None:
            return {}
        return {"guard_action": (~self._ok).to(self._reason.dtype), "guard_reason": self._reason}

    def skipped(self) -> dict[str, int]:
        """Skips so far, by reason: a host read (call it on a logging step, not every step)."""
        if self._count is None:
            return {"skips": 0, "nonfinite": 0, "spike": 0}
        a, b, s = (int(v) for v in self._count.tolist())
        return {"skips": a, "nonfinite": b, "spike": s}

    def state_dict(self) -> dict[str, Any]:
        """The running statistics and counts (device tensors, cloned): saved with a checkpoint."""
        if self._stats is None:
            return {"version": 1}
        return {"version": 1, "stats": self._stats.detach().clone(), "count": self._count.detach().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a malformed one raises ConfigError naming the key."""
        import torch

        if not isinstance(state, dict) or state.get("version") != 1:
            raise ConfigError("device_skip.state", "not a DeviceSkip state (version 1)")
        if "stats" not in state:
            self._stats = None
            return
        stats, count = state["stats"], state.get("count")
        if not torch.is_tensor(stats) or stats.shape != (6,) or not bool(torch.isfinite(stats).all()):
            raise ConfigError("device_skip.state.stats", "must be 6 finite numbers")
        if not torch.is_tensor(count) or count.shape != (3,):
            raise ConfigError("device_skip.state.count", "must be 3 counts")
        device = self._stats.device if self._stats is not None else stats.device
        self._init(device)
        self._stats.copy_(stats)
        self._count.copy_(count)

    # -- internals --------------------------------------------------------------------------------

    def _init(self, device: Any) -> None:
        import torch

        c = self.config
        self._stats = torch.zeros(6, dtype=torch.float32, device=device)
        self._count = torch.zeros(3, dtype=torch.int64, device=device)
        self._rel = torch.tensor([1.0 + c.loss_rel, 1.0 + c.grad_rel], device=device)
        self._grad_only = torch.tensor([False, True], device=device)

    def _tensors(self, device: Any) -> list[Any]:
        """The parameters and optimizer-state tensors on the flag's device (a CPU step counter of a
        GPU optimizer is left alone: putting it back would need a sync)."""
        import torch

        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                out.append(p)
                for v in self.optimizer.state.get(p, {}).values():
                    if torch.is_tensor(v) and v.device == device:
                        out.append(v)
        return out

    def _save(self, tensors: list[Any]) -> list[Any]:
        import torch

        saved = []
        for t in tensors:
            buf = self._saved.get(id(t))
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._saved[id(t)] = torch.empty_like(t)
            saved.append(buf)
        if tensors:
            with torch.no_grad():
                torch._foreach_copy_(saved, [t.detach() for t in tensors])
        return saved

    def _put_back(self, ok: Any, tensors: list[Any], saved: list[Any], had: set[int]) -> None:
        import torch

        with torch.no_grad():
            for t, s in zip(tensors, saved):
                torch.where(ok, t, s, out=t)
            if len(had) == len(self.optimizer.state):
                return
            # state the step created (a first step): back to zeros, what the optimizers start from
            for p, state in self.optimizer.state.items():
                if id(p) not in had:
                    for v in state.values():
                        if torch.is_tensor(v) and v.device == ok.device:
                            v.copy_(torch.where(ok, v, torch.zeros_like(v)))
