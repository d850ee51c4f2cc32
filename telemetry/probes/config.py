"""The sampling settings of the probes: what runs on every step and what only on sampled steps."""

from __future__ import annotations

from dataclasses import dataclass

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import check_int, check_type, settings_from

__all__ = ["ProbeConfig"]


@dataclass(frozen=True)
class ProbeConfig:
    """Sampling settings of a :class:`Watch`; the defaults keep the cost near 1-2% of a CPU step.

    Per-step work is a handful of reductions; the costlier probes run on sampled steps. On a
    large model every probe is cheap next to the step, and ``attention_every=1``,
    ``fingerprint_every=1`` cost little.
    """

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
    """Sequences of the micro-batch whose sampled queries go into the entropy (0 = all); q and k
    norms always cover the whole micro-batch."""
    attention: str = "auto"
    """Which modules are attention layers: "auto" (the reference model's and
    ``nn.MultiheadAttention``), "none", or a comma-separated list of module-name globs."""
    attention_compiled: bool = False
    """Keep the attention tap on in forward passes that torch.compile runs: the attention statistics
    of layers that do not report themselves, at the cost of a graph break at each attention call on
    sampled steps. Off (the default), compiled code gets no graph break from sdcwatch and such layers
    report nothing while compiled (layers calling ``observe_attention`` still report)."""
    activations_every: int = 16
    """Record ``act_max``, the largest |output| of every leaf module of the model, on every
    this-many-th recorded step; 0 = off (-inf, the mark of a masked attention slot, is skipped). It catches a NaN, Inf or near-INF value wherever it
    appears in the forward pass, also where no other probe looks (an MLP, an attention mix)."""
    canary_every: int = 0
    """Run a fixed canary input through the model every this many steps and fingerprint the
    output (``canary_fp``); 0 = off. Replicas hold the same parameters, so their canary outputs
    must be bit-identical: a rank whose compute is faulty stands out in the replica vote even when
    the fault is far too small to move any statistic (an unhealthy node). Needs ``canary_input``
    and replicas of one hardware type (kernels must be deterministic across them)."""
    gemm_canary_every: int = 1
    """Run one linear layer's product on a fixed known input on every this-many-th recorded step,
    the layers in rotation, and fingerprint the result (``gemm_canary_fp``); 0 = off. Replicas must
    get the same bits: the vote names a rank whose products are persistently a little off (an
    unhealthy node, below the checksums' rounding bound) within one rotation of the layers. A few
    rows times one weight: no input needed, next to nothing in cost
    (:mod:`sdcwatch.telemetry.probes.gemm_canary`)."""

    checksum_every: int = 16
    """Check every linear layer's product (``nn.Linear``, Hugging Face's ``Conv1D``; forward, weight gradient, weights in memory) on every
    this-many-th recorded step with matrix checksums (:mod:`sdcwatch.telemetry.probes.checksum_bounds`); 0 = off.
    Catches finite corruption (a flipped bit) that no statistic shows, naming the layer. Every
    step (1) catches a one-off flip at its step but costs several percent of a step (the checks
    read every activation again, unfused); sampled, a device that keeps flipping bits is caught
    within this many steps (the ``checksums`` preset checks every step)."""
    checksum_forward_every: int = 0
    """Also check the forward products and the weights in memory (``gemm_fwd``, ``gemm_weight``)
    on every this-many-th recorded step; the weight-gradient check (``gemm_bwd``) stays on
    ``checksum_every``'s steps; 0 = only on those. The forward check reuses the row sums the scan
    takes anyway (``gemm_out``) and adds one matrix-vector product with the input; the weight
    check re-sums each weight (O(d^2), nothing next to the product's O(N d^2)) against its sums
    taken after the optimizer step. So 1 names a one-off flip in a product's output or a weight
    flipped in memory at its step for a fraction of what every check on every step costs (a
    gradient flip is still caught on ``checksum_every``'s steps only)."""
    stream_every: int = 1
    """On every this-many-th recorded step, record the extreme values: the largest |value| of every
    block's output (``stream_max``, the residual stream), the largest logit of every attention
    layer (``attn_logit_max``) and, on the steps the checksums do not check, the largest |row sum|
    of every product's output (``gemm_out``: one reduction per product); 0 = off
    (:mod:`sdcwatch.telemetry.probes.residual_stream`, :mod:`sdcwatch.telemetry.probes.gemm_checks`). With it, a NaN,
    Inf or near-INF value anywhere in the forward pass shows at its step."""

    @classmethod
    def from_settings(cls, **settings: object) -> "ProbeConfig":
        """A config from keyword settings (``attach``'s, a callback's); an unknown one is a
        ConfigError naming it and the known ones."""
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
