"""The skip decided on the device: a non-finite or spiking step's update made a no-op with no host sync,
by the spike detector's rule on device tensors (:mod:`sdcwatch.core.spike_baseline`), through
``found_inf`` for optimizers that read it, else with ``torch.where`` on the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.spike_baseline import CLIP, FLOOR, SIGMA_PER_MEAN_ABS, SeriesSettings
from sdcwatch.core.validate import check_choice, check_int, check_number, check_type, settings_from

__all__ = ["DeviceSkip", "DeviceSkipConfig"]

#: Settings of the spike rule before it became the detector's (they meant something else: renamed).
_RENAMED = {
    "z": "loss.z_on and grad_norm.z_on (the spike detector's rule)",
    "loss_rel": "loss.min_ratio (= 1 + loss_rel) (the spike detector's rule)",
    "grad_rel": "grad_norm.min_ratio (= 1 + grad_rel) (the spike detector's rule)",
}


@dataclass(frozen=True)
class DeviceSkipConfig:
    """When the device skip rejects an update: the spike detector's rule, on device tensors."""

    loss: SeriesSettings = field(default_factory=lambda: SeriesSettings(z_on=6.0, min_ratio=1.5))
    """When the loss is a spike: ``z_on`` robust deviations *and* ``min_ratio`` times its baseline."""
    grad_norm: SeriesSettings = field(default_factory=lambda: SeriesSettings(z_on=6.0, min_ratio=3.0))
    """When the gradient norm is a spike."""
    window: int = 9
    """Accepted values whose median is the baseline."""
    warmup: int = 23
    """Clean steps, after the window filled, before spikes are judged."""
    scale_alpha: float = 0.02
    """Weight of each new residual in the noise scale (an exponentially weighted mean)."""
    max_spike_skips: int = 4
    """Consecutive spike skips allowed; the next spike is a change of level the baseline starts over from."""
    judge_loss: bool = True
    """Judge the loss too: only when it is the same on every rank, or the replicas part."""
    how: str = "auto"
    """"found_inf" (the optimizer skips its own update), "restore" (copied before the step, put back
    where the flag says so), "auto" (found_inf where the optimizer supports it)."""

    def __post_init__(self) -> None:
        for key in ("loss", "grad_norm"):  # a table read from TOML or JSON becomes the settings
            object.__setattr__(self, key, SeriesSettings.of(getattr(self, key), f"device_skip.{key}"))
        check_int("device_skip.window", self.window, lo=1)
        check_int("device_skip.warmup", self.warmup, lo=1)
        check_int("device_skip.max_spike_skips", self.max_spike_skips, lo=0)
        check_number("device_skip.scale_alpha", self.scale_alpha, lo=0, lo_open=True)
        check_choice("device_skip.how", self.how, ("auto", "found_inf", "restore"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeviceSkipConfig":
        """From a plain dict (JSON, TOML); an unknown key is an error naming it (a renamed one, its new name)."""
        return settings_from(cls, "device_skip", d, renamed=_RENAMED)


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
        self.config = check_type("device_skip.config", config or DeviceSkipConfig(), DeviceSkipConfig)
        fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        if self.config.how == "found_inf" and not fused:
            raise ConfigError(
                "device_skip.how",
                f"found_inf needs an optimizer that reads it (fused=True); {type(optimizer).__name__}",
            )
        self.how = "found_inf" if self.config.how == "found_inf" or (self.config.how == "auto" and fused) else "restore"
        self._base: Any = None  # (2, window + 3): the loss's and the gradient norm's baselines
        self._run: Any = None  # consecutive spike skips
        self._ok: Any = None
        self._reason: Any = None
        self._count: Any = None  # [skips, non-finite skips, spike skips]
        self._saved: dict[int, Any] = {}

    # -- the step ---------------------------------------------------------------------------------

    def step(self, grad_norm: Any, *, loss: Any = None, nonfinite: Any = None) -> Any:
        """Judge this step (:meth:`judge`) and update, or make the update a no-op; returns the device
        flag (``True``: applied)."""
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
        """The device flag (apply the update?) and reason code (0 none, 1 non-finite, 2 spike) of the
        all-reduced ``grad_norm``, a ``loss`` equal on every rank and a ``nonfinite`` count; a clean
        step is learnt. :class:`~sdcwatch.core.spike_baseline.RobustBaseline`'s rule, one row of
        ``_base`` a series: ``window`` log values, the values learnt, those past the window, the scale."""
        import torch

        c, w = self.config, self.config.window
        g = torch.as_tensor(grad_norm).detach().reshape(()).to(torch.float64)
        if self._base is None:
            self._init(g.device)
        x = g.expand(2) if loss is None else torch.stack([torch.as_tensor(loss).detach().reshape(()).to(g), g])
        base, run = self._base, self._run
        buf, seen, n, scale = base[:, :w], base[:, w], base[:, w + 1], base[:, w + 2]
        finite = torch.isfinite(x).all()
        if nonfinite is not None:
            finite = finite & (torch.as_tensor(nonfinite).detach().reshape(()).to(g.device) == 0)
        usable = torch.isfinite(x) & (x > 0)  # what the rule scores and learns
        t = torch.log(torch.where(usable, x, torch.ones_like(x)))
        full = seen >= w
        median = torch.sort(buf, dim=1).values[:, w // 2]
        r = t - median
        z = r / scale.clamp_min(FLOOR)
        high = usable & full & (n >= c.warmup) & (z >= self._z_on) & (torch.exp(r) >= self._min_ratio)
        if loss is None or not c.judge_loss:
            high = high & self._grad_only
        spike = high.any() & finite
        forced = spike & (run >= c.max_spike_skips)  # a lasting change of level: take it, start over
        ok = finite & (~spike | forced)
        # learn: a forced step starts the baseline over from its value
        learn = ok & usable
        zero = torch.zeros_like(seen)
        seen, n, scale = (torch.where(forced, zero, v) for v in (seen, n, scale))
        full = seen >= w
        warming = n < c.warmup
        lim = CLIP * scale.clamp_min(FLOOR)
        clipped = torch.maximum(torch.minimum(r, lim), -lim)
        new_scale = torch.where(
            warming,
            scale + (r.abs() * SIGMA_PER_MEAN_ABS - scale) / (n + 1),
            scale + c.scale_alpha * (clipped.abs() * SIGMA_PER_MEAN_ABS - scale),
        )
        accepted = torch.where(full & ~warming, median + clipped, t)  # a spike enters the window clipped
        slot = torch.remainder(seen, w).to(torch.int64).unsqueeze(1)
        kept = buf.gather(1, slot).squeeze(1)
        buf.scatter_(1, slot, torch.where(learn, accepted, kept).unsqueeze(1))
        grown = learn & full
        base[:, w] = seen + learn.to(seen.dtype)
        base[:, w + 1] = n + grown.to(n.dtype)
        base[:, w + 2] = torch.where(grown, new_scale, scale)
        run.copy_(torch.where(spike & ~forced, run + 1, torch.zeros_like(run)))
        reason = torch.where(~finite, 1.0, torch.where(ok, 0.0, 2.0))
        self._count += torch.stack([~ok, ~finite, ~ok & finite]).to(self._count.dtype)
        self._ok, self._reason = ok, reason
        return ok, reason

    # -- what it did ------------------------------------------------------------------------------

    def telemetry(self) -> dict[str, Any]:
        """The last step's verdict as the guard's record scalars (device tensors), for ``watch.step``."""
        if self._ok is None:
            return {}
        return {"guard_action": (~self._ok).to(self._reason.dtype), "guard_reason": self._reason}

    def skipped(self) -> dict[str, int]:
        """Skips so far, by reason: a host read (call it on a logging step, not every step)."""
        counts = [0, 0, 0] if self._count is None else self._count.tolist()
        return dict(zip(("skips", "nonfinite", "spike"), map(int, counts)))

    def state_dict(self) -> dict[str, Any]:
        """The baselines, the run of spike skips and the counts (device tensors, cloned): saved with a checkpoint."""
        if self._base is None:
            return {"version": 2}
        return {"version": 2, **{k: getattr(self, f"_{k}").detach().clone() for k in ("base", "run", "count")}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a malformed one raises ConfigError naming the key."""
        import torch

        if not isinstance(state, dict) or state.get("version") != 2:
            raise ConfigError("device_skip.state", "not a DeviceSkip state (version 2)")
        shapes = {"base": (2, self.config.window + 3), "run": (), "count": (3,)}
        if "count" not in state:
            self._base = None
            return
        for key, shape in shapes.items():
            v = state.get(key)
            if not torch.is_tensor(v) or v.shape != shape or not bool(torch.isfinite(v.double()).all()):
                raise ConfigError(f"device_skip.state.{key}", f"must be a finite tensor of shape {shape}")
        self._init(self._base.device if self._base is not None else state["count"].device)
        for key in shapes:
            getattr(self, f"_{key}").copy_(state[key])

    # -- internals --------------------------------------------------------------------------------

    def _init(self, device: Any) -> None:
        import torch

        c = self.config
        self._base = torch.zeros(2, c.window + 3, dtype=torch.float64, device=device)
        self._run = torch.zeros((), dtype=torch.float64, device=device)
        self._count = torch.zeros(3, dtype=torch.int64, device=device)
        self._z_on = torch.tensor([c.loss.z_on, c.grad_norm.z_on], dtype=torch.float64, device=device)
        self._min_ratio = torch.tensor([c.loss.min_ratio, c.grad_norm.min_ratio], dtype=torch.float64, device=device)
        self._grad_only = torch.tensor([False, True], device=device)

    def _tensors(self, device: Any) -> list[Any]:
        """The parameters and optimizer-state tensors on the flag's device (putting back a CPU step
        counter would need a sync)."""
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
