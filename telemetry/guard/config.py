"""What the guard does and what it did: its settings, the outcome of a step, the eviction exit.

The vocabulary the guard (:mod:`sdcwatch.telemetry.guard.guard`), the simulated and DDP runs, the
service's guard-action detector and the campaign share. Importing it imports neither torch nor kafka.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Sequence

from sdcwatch.core.control import ACTIONS, REASONS, VERDICTS
from sdcwatch.core.errors import ConfigError

__all__ = ["GuardConfig", "GuardOutcome", "GuardEviction", "EXIT_CODE_EVICT"]

#: Exit code of every process when the guard evicts a rank: the value Megatron-LM's
#: RerunStateMachine uses for "restart, on other hardware", so launch scripts that know it restart.
EXIT_CODE_EVICT = 16
_MODES = ("report", "act")
_LOCAL_ACTIONS = ("none", "skip", "rerun")
_PERSISTENT_ACTIONS = ("none", "skip", "rollback", "evict")
_EVICTIONS = ("exit", "leave")
_MITIGATIONS = ("none", "lr", "clip", "lr+clip")


class GuardEviction(SystemExit):
    """Raised on every process when the guard evicts a rank; exits with :data:`EXIT_CODE_EVICT`."""

    def __init__(
        self, step: int, ranks: Sequence[int], hosts: Sequence[str], reason: str, since_step: int | None = None
    ) -> None:
        self.step, self.ranks, self.hosts, self.reason = int(step), tuple(ranks), tuple(hosts), reason
        self.since_step = since_step
        """The first step the problem was seen at, when known: restart from a snapshot before it."""
        named = ", ".join(f"rank {r}" + (f" (host {h})" if h else "") for r, h in zip(self.ranks, self.hosts))
        self.message = (
            f"sdcwatch guard: evicting {named} at step {self.step}: {reason}; exiting with code "
            f"{EXIT_CODE_EVICT} so the launcher restarts the job without that node"
        )
        super().__init__(EXIT_CODE_EVICT)

    def __str__(self) -> str:
        return self.message


def _check_choice(key: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"guard.{key}", f"must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class GuardConfig:
    """What the guard does, and when. The defaults only report; ``mode="act"`` turns actions on."""

    mode: str = "report"
    """"report": decide and log what would be done, change nothing; "act": take the actions."""
    on_nonfinite: str = "rerun"
    """Action when a loss or the all-reduced gradient is not finite: "rerun" (tell a transient fault
    from a persistent one; a transient one costs nothing), "skip" or "none"."""
    on_checksum: str = "rerun"
    """Action when a matrix product's checksum passes its rounding bound on a rank in the step
    (a flipped bit, finite or not; only on the steps the checksums check): "rerun", "skip" or "none"."""
    on_spike: str = "rerun"
    """Action when a loss or gradient norm is a spike: "rerun", "skip" or "none"."""
    on_persistent: str = "evict"
    """Action when a rerun finds a fault that repeats on one rank and not on another (hardware):
    "evict", "rollback", "skip" or "none"."""
    on_evict: str = "exit"
    """How an eviction (``on_persistent``, a rollback past its budget, a control decision) is carried
    out: "exit" raises :class:`GuardEviction` on every process (exit code 16, a launcher restarts the
    job without the node); "leave" makes the evicted rank's replica group leave the quorum at the step
    boundary while the others go on (needs ``Guard(elastic=...)``, :mod:`~sdcwatch.telemetry.guard.elastic`)."""
    spike_z: float = 8.0
    """A value is a spike when it exceeds the median of recent clean steps by ``spike_z`` robust
    standard deviations (1.4826 x MAD) ..."""
    spike_rel: float = 1.0
    """... and by this fraction of the median (a loss): both must hold. One rank's micro-batch loss
    is noisy (a batch of unusual text runs 40-60% above the median), so the default asks for double."""
    grad_spike_rel: float = 9.0
    """The relative excess that makes a gradient-norm spike (ten times the median by default:
    gradient norms are noisier than losses)."""
    window: int = 64
    """Recent clean steps in the baseline."""
    warmup: int = 20
    """Clean steps seen before spikes are judged (non-finite values are judged from the first step)."""
    rerun_tolerance: float = 0.0
    """Relative difference under which a rerun counts as the same result (0: bit for bit, right for
    deterministic kernels; GPUs with non-deterministic reductions want about 1e-6)."""
    max_skips: int = 3
    """Skipped updates allowed per ``budget_window`` steps; past it the updates go through (a
    lasting change of level is not a fault to skip forever) and the guard says so."""
    max_rollbacks: int = 2
    """Rollbacks allowed per ``budget_window`` steps; past it a rollback naming ranks evicts them,
    one naming none is reported only."""
    budget_window: int = 200
    """Steps over which skips and rollbacks are counted."""
    snapshot_every: int = 50
    """Steps between in-memory snapshots (model and optimizer state). A snapshot copies the model and
    the optimizer state (about 3 ms for the reference model here): every 50 steps keeps that under
    0.5% of the step time; a rollback replays at most this many steps."""
    snapshot_memory_mb: float = 1024.0
    """Memory the snapshots may hold; the oldest are dropped to stay within it (one is always kept)."""
    snapshot_dir: str | None = None
    """Also keep the newest snapshot on disk here (``guard-rank{r}.pt``), e.g. for after an eviction."""
    lr_factor: float = 0.5
    """Learning-rate factor after a rollback the guard decides itself (a control decision carries its own)."""
    lr_cut_steps: int = 50
    """Steps the learning rate stays cut after a rollback."""
    max_reruns: int = 10
    """Reruns allowed per ``budget_window`` steps (a rerun is one extra forward and backward, at most
    one a step, plus one recomputation on a peer). Past it a step is not rerun: it is skipped within
    ``max_skips``, and once both are spent a non-finite or checksum fault naming a rank gets
    ``on_persistent`` (evict by default): reruns that keep disagreeing end, never loop."""
    spike_mitigation: str = "none"
    """After a spike that is not transient (the data or the optimisation): "lr" cuts the learning
    rate by ``mitigation_lr_factor``, "clip" clips the gradient to ``mitigation_clip`` times the
    median recent norm, "lr+clip" both, for ``mitigation_steps`` steps from the spike's; then restored."""
    mitigation_lr_factor: float = 0.5
    """The learning-rate factor of a spike mitigation."""
    mitigation_clip: float = 1.0
    """The gradient-norm clip of a spike mitigation, as a multiple of the median norm of recent clean steps."""
    mitigation_steps: int = 20
    """Steps a spike mitigation lasts (the spike's step included)."""
    max_mitigations: int = 2
    """Spike mitigations allowed per ``budget_window`` steps; past it a spike is only skipped (as
    ``on_spike`` says) and the guard says so."""

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, _MODES)
        _check_choice("on_nonfinite", self.on_nonfinite, _LOCAL_ACTIONS)
        _check_choice("on_checksum", self.on_checksum, _LOCAL_ACTIONS)
        _check_choice("on_spike", self.on_spike, _LOCAL_ACTIONS)
        _check_choice("on_persistent", self.on_persistent, _PERSISTENT_ACTIONS)
        _check_choice("on_evict", self.on_evict, _EVICTIONS)
        _check_choice("spike_mitigation", self.spike_mitigation, _MITIGATIONS)
        for key in ("spike_z", "spike_rel", "grad_spike_rel", "snapshot_memory_mb", "mitigation_clip"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ConfigError(f"guard.{key}", f"must be a number > 0, got {v!r}")
        if (
            isinstance(self.rerun_tolerance, bool)
            or not isinstance(self.rerun_tolerance, (int, float))
            or not (0 <= self.rerun_tolerance < 1)
        ):
            raise ConfigError("guard.rerun_tolerance", f"must be a number in [0, 1), got {self.rerun_tolerance!r}")
        for key, lo in (
            ("window", 4),
            ("warmup", 1),
            ("max_skips", 0),
            ("max_rollbacks", 0),
            ("budget_window", 1),
            ("snapshot_every", 1),
            ("lr_cut_steps", 0),
            ("max_reruns", 0),
            ("mitigation_steps", 1),
            ("max_mitigations", 0),
        ):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"guard.{key}", f"must be an integer >= {lo}, got {v!r}")
        if self.warmup > self.window:
            raise ConfigError("guard.warmup", f"must be <= window ({self.window}), got {self.warmup}")
        for key in ("lr_factor", "mitigation_lr_factor"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ConfigError(f"guard.{key}", f"must be a number in (0, 1], got {v!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GuardConfig":
        """From a plain dict (JSON, TOML); an unknown key is an error naming it."""
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ConfigError(f"guard.{key}", f"unknown setting (known: {', '.join(sorted(known))})")
        return cls(**d)


@dataclass
class GuardOutcome:
    """What the guard did at one step. ``applied``: the optimizer step ran (with the rerun's
    gradient after a transient fault). ``resume_from``: after a rollback, the data position of the
    snapshot (a loop that can replay its data continues from there)."""

    step: int
    action: str = "none"
    reason: str = ""
    verdict: str = ""
    ranks: tuple[int, ...] = ()
    applied: bool = True
    message: str = ""
    resume_from: Any = None
    lr_factor: float = 1.0
    would: str = ""  # report mode: the action that was not taken
    mitigation: str = ""  # a spike mitigation started at this step ("lr", "clip", "lr+clip")

    def telemetry(self) -> dict[str, float]:
        """The scalars for this step's telemetry record (empty when the guard did nothing)."""
        if self.action == "none":
            return {}
        return {
            "guard_action": float(ACTIONS.index(self.action)),
            "guard_reason": float(REASONS.index(self.reason)),
            "guard_verdict": float(VERDICTS.index(self.verdict)),
            "guard_rank": float(self.ranks[0]) if len(self.ranks) == 1 else -1.0,
        }

    def to_dict(self) -> dict[str, Any]:
        """``{step, action, ranks, reason}`` plus the verdict and message (the demo's summary)."""
        return {
            "step": self.step,
            "action": self.action,
            "ranks": list(self.ranks),
            "reason": self.reason,
            "verdict": self.verdict,
            "applied": self.applied,
            "message": self.message,
            **({"mitigation": self.mitigation, "lr_factor": self.lr_factor} if self.mitigation else {}),
        }
