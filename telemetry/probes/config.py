"""The sampling settings of the probes: what runs on every step and what only on sampled steps."""

from __future__ import annotations

from dataclasses import dataclass

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import check_int, check_type, settings_from

__all__ = ["ProbeConfig"]


@dataclass(frozen=True)
class ProbeConfig:
    """Sampling settings of a :class:`Watch` (docs/probes.md); the defaults keep the cost near 1-2% of
    a CPU step: per-step work is a handful of reductions, the costlier probes run on sampled steps."""

    every: int = 1
    """Emit a record every this many steps (loss, gradient norms and cosine, step time...)."""
    attention_every: int = 16
    """Measure attention on every this-many-th recorded step (other records carry no layers)."""
    fingerprint_every: int = 50
    """Fingerprint the parameters and the all-reduced gradient every this many steps."""
    grad_fingerprint: bool = True
    """Include the all-reduced gradient's fingerprint on fingerprint steps."""
    heads: int = 4
    """Attention heads sampled per layer (evenly strided; 0 = all)."""
    queries: int = 16
    """Query positions sampled per head (strided over the last three quarters of the sequence)."""
    sequences: int = 2
    """Sequences whose sampled queries go into the entropy (0 = all; q and k norms cover all)."""
    attention: str = "auto"
    """Which modules are attention layers: "auto" (the reference model's and
    ``nn.MultiheadAttention``), "none", or a comma-separated list of module-name globs."""
    attention_compiled: bool = False
    """Keep the attention tap on in compiled forwards (a graph break at each attention call on
    sampled steps); off, layers that do not call ``observe_attention`` report nothing while compiled."""
    activations_every: int = 16
    """Record ``act_max``, the largest |output| of every leaf module (-inf skipped), on every
    this-many-th recorded step; 0 = off. Catches a NaN, Inf or near-INF where no other probe looks."""
    canary_every: int = 0
    """Fingerprint the model's output on a fixed ``canary_input`` every this many steps
    (``canary_fp``, bit-identical across replicas of one hardware type); 0 = off."""
    gemm_canary_every: int = 1
    """Fingerprint one linear layer's product on a fixed known input (``gemm_canary_fp``) on every
    this-many-th recorded step, the layers in rotation; 0 = off."""

    checksum_every: int = 16
    """Check every linear layer (forward, weight gradient, weights in memory) with matrix checksums
    on every this-many-th recorded step; 0 = off. Catches a flipped bit no statistic shows."""
    checksum_forward_every: int = 0
    """Also check the forward products and the weights in memory (``gemm_fwd``, ``gemm_weight``)
    on every this-many-th recorded step, at a fraction of the full check's cost; 0 = off."""
    stream_every: int = 1
    """On every this-many-th recorded step, record the extremes of every block's output
    (``stream_max``), attention logits (``attn_logit_max``) and, unchecked, product outputs
    (``gemm_out``); 0 = off."""

    @classmethod
    def from_settings(cls, **settings: object) -> "ProbeConfig":
        """A config from keyword settings; an unknown one is a ConfigError naming the known ones."""
        return settings_from(cls, "probes", settings)

    def __post_init__(self) -> None:
        for key, lo in _LOWEST.items():
            check_int(f"probes.{key}", getattr(self, key), lo=lo)
        check_type("probes.attention_compiled", self.attention_compiled, bool)
        check_type("probes.grad_fingerprint", self.grad_fingerprint, bool)
        if not isinstance(self.attention, str) or not self.attention:
            raise ConfigError("probes.attention", f"must be 'auto', 'none' or module globs, got {self.attention!r}")


#: The smallest value of each integer setting (0: the probe can be off).
_LOWEST = {
    "every": 1,
    "attention_every": 1,
    "fingerprint_every": 1,
    "heads": 0,
    "queries": 1,
    "sequences": 0,
    "canary_every": 0,
    "gemm_canary_every": 0,
    "activations_every": 0,
    "checksum_every": 0,
    "checksum_forward_every": 0,
    "stream_every": 0,
}
