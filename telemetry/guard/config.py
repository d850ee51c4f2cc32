"""What the guard does and what it did: its settings (docs/guard.md explains each), the outcome of a
step, the eviction exit. Shared with the service and the campaign: imports neither torch nor kafka.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from sdcwatch.core.control import ACTIONS, REASONS, VERDICTS
from sdcwatch.core.spike_baseline import SeriesSettings
from sdcwatch.core.validate import check_choice, check_int, check_number, settings_from

__all__ = ["GuardConfig", "GuardPlace", "GuardOutcome", "GuardEviction", "EXIT_CODE_EVICT", "MITIGATIONS"]

#: Exit code of every process when the guard evicts a rank: the value Megatron-LM's
#: RerunStateMachine uses for "restart, on other hardware", so launch scripts that know it restart.
EXIT_CODE_EVICT = 16
_LOCAL_ACTIONS = ("none", "skip", "rerun")
#: The spike mitigations (``GuardConfig.spike_mitigation``).
MITIGATIONS = ("none", "lr", "clip", "lr+clip")


class GuardEviction(SystemExit):
    """Raised on every process when the guard evicts a rank; exits with :data:`EXIT_CODE_EVICT`."""

    def __init__(
        self, step: int, ranks: Sequence[int], hosts: Sequence[str], reason: str, since_step: int | None = None
    ) -> None:
        self.step, self.ranks, self.hosts, self.reason = int(step), tuple(ranks), tuple(hosts), reason
        self.since_step = since_step  # the first step the problem was seen at: restart from before it
        named = ", ".join(f"rank {r}" + (f" (host {h})" if h else "") for r, h in zip(self.ranks, self.hosts))
        self.message = (
            f"sdcwatch guard: evicting {named} at step {self.step}: {reason}; exiting with code "
            f"{EXIT_CODE_EVICT} so the launcher restarts the job without that node"
        )
        super().__init__(EXIT_CODE_EVICT)

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class GuardPlace:
    """Where a guard runs: this process among the job's ranks, and how it agrees with the others.
    A field left None comes from torch.distributed (when initialised), then the launcher's environment."""

    rank: int | None = None
    world: int | None = None
    host: str | None = None
    local_ranks: Iterable[int] | None = None
    """Ranks this process computes (default ``(rank,)``; a simulated run: all)."""
    host_of: Callable[[int], str] | None = None
    """``host_of(rank) -> str`` for the eviction message (default: gathered from the ranks)."""
    group: Any = None
    """The torch.distributed process group to agree through (default: the world)."""
    distributed: bool | None = None
    """Agree through torch.distributed (default: when it is initialised)."""
    environment: Any = None
    """The rank's :class:`~sdcwatch.telemetry.wire.environment.RankEnvironment` (default: the process's)."""


#: Settings of the spike rule before it became the detector's (they meant something else: renamed).
_RENAMED = {
    "spike_z": "loss.z_on and grad_norm.z_on (the spike detector's rule)",
    "spike_rel": "loss.min_ratio (= 1 + spike_rel) (the spike detector's rule)",
    "grad_spike_rel": "grad_norm.min_ratio (= 1 + grad_spike_rel) (the spike detector's rule)",
}


@dataclass(frozen=True)
class GuardConfig:
    """What the guard does, and when. The defaults only report; ``mode="act"`` turns actions on."""

    mode: str = "report"
    """"report": decide and log what would be done, change nothing; "act": take the actions."""
    on_nonfinite: str = "rerun"
    """Action on a non-finite loss or all-reduced gradient: "rerun", "skip" or "none"."""
    on_checksum: str = "rerun"
    """Action on a matrix product's checksum above its rounding bound: "rerun", "skip" or "none"."""
    on_spike: str = "rerun"
    """Action on a loss or gradient-norm spike: "rerun", "skip" or "none"."""
    on_persistent: str = "evict"
    """Action on a fault a rerun finds on one rank only: "evict", "rollback", "skip" or "none"."""
    on_evict: str = "exit"
    """"exit": raise :class:`GuardEviction` on every process (exit code 16); "leave": the evicted
    rank's replica group leaves the quorum (needs ``Guard(elastic=...)``)."""
    loss: SeriesSettings = field(default_factory=lambda: SeriesSettings(z_on=5.0, min_ratio=2.0))
    """When a rank's loss is a spike (:mod:`sdcwatch.core.spike_baseline`; a micro-batch loss is noisy:
    double by default)."""
    grad_norm: SeriesSettings = field(default_factory=lambda: SeriesSettings(z_on=5.0, min_ratio=10.0))
    """When a gradient norm is a spike (ten times the baseline by default)."""
    window: int = 9
    """Clean values whose median is the baseline."""
    warmup: int = 11
    """Clean steps, after the window filled, before spikes are judged."""
    scale_alpha: float = 0.02
    """Weight of each new residual in the noise scale (an exponentially weighted mean)."""
    rerun_tolerance: float = 0.0
    """Relative difference under which a rerun is the same result (0: bit for bit)."""
    max_skips: int = 3
    """Skipped updates allowed per ``budget_window`` steps; past it updates go through, reported."""
    max_rollbacks: int = 2
    """Rollbacks allowed per ``budget_window`` steps; past it one naming ranks evicts them."""
    budget_window: int = 200
    """Steps over which the budgets are counted."""
    snapshot_every: int = 50
    """Steps between in-memory snapshots of the model and optimizer state."""
    snapshot_memory_mb: float = 1024.0
    """Memory the snapshots may hold (the oldest dropped first; one is always kept)."""
    snapshot_dir: str | None = None
    """Also keep the newest snapshot on disk here (``guard-rank{r}.pt``)."""
    lr_factor: float = 0.5
    """Learning-rate factor after a rollback the guard decides itself."""
    lr_cut_steps: int = 50
    """Steps the learning rate stays cut after a rollback."""
    max_reruns: int = 10
    """Reruns allowed per ``budget_window`` steps; past it a step is skipped within ``max_skips``,
    then a fault naming a rank gets ``on_persistent``."""
    spike_mitigation: str = "none"
    """After a spike that is not transient: "lr", "clip", "lr+clip" or "none"."""
    mitigation_lr_factor: float = 0.5
    """The learning-rate factor of a spike mitigation."""
    mitigation_clip: float = 1.0
    """The gradient-norm clip of a spike mitigation, times the median norm of recent clean steps."""
    mitigation_steps: int = 20
    """Steps a spike mitigation lasts (the spike's step included)."""
    max_mitigations: int = 2
    """Spike mitigations allowed per ``budget_window`` steps; past it a spike is only skipped."""

    def __post_init__(self) -> None:
        for key, choices in (
            ("mode", ("report", "act")),
            ("on_nonfinite", _LOCAL_ACTIONS),
            ("on_checksum", _LOCAL_ACTIONS),
            ("on_spike", _LOCAL_ACTIONS),
            ("on_persistent", ("none", "skip", "rollback", "evict")),
            ("on_evict", ("exit", "leave")),
            ("spike_mitigation", MITIGATIONS),
        ):
            check_choice(f"guard.{key}", getattr(self, key), choices)
        for key in ("loss", "grad_norm"):  # a table read from TOML or JSON becomes the settings
            object.__setattr__(self, key, SeriesSettings.of(getattr(self, key), f"guard.{key}"))
        for key in ("scale_alpha", "snapshot_memory_mb", "mitigation_clip"):
            check_number(f"guard.{key}", getattr(self, key), lo=0, lo_open=True)
        check_number("guard.rerun_tolerance", self.rerun_tolerance, 0, 1, hi_open=True)
        for key in ("lr_factor", "mitigation_lr_factor"):
            check_number(f"guard.{key}", getattr(self, key), 0, 1, lo_open=True)
        for key, lo in (
            ("window", 1),
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
            check_int(f"guard.{key}", getattr(self, key), lo=lo)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GuardConfig":
        """From a plain dict (JSON, TOML); an unknown key is an error naming it (a renamed one, its new name)."""
        return settings_from(cls, "guard", d, renamed=_RENAMED)


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
