"""Training-side probes: what a user adds to a PyTorch training loop to feed sdcwatch.

    watch = attach(model, emitter, optimizer=opt, ddp=ddp_model)
    for step, batch in enumerate(data):
        loss = ...; loss.backward(); opt.step(); opt.zero_grad()
        watch.step(step, loss=loss)
    watch.close()

Every metric is computed on the device as a 0-d tensor. At :meth:`Watch.step` they are packed
into one tensor that leaves the device in one asynchronous copy; the host reads it a step later
and hands a record to the emitter. Nothing on the training path calls ``.item()``.
Under DDP a communication hook sees each gradient bucket before and after the all-reduce (local
and global norms, their dot product, the all-reduced gradient's fingerprint). Attention layers
report q, k and logits through :func:`observe_attention`; heads and query positions are sampled.
"""

from __future__ import annotations

import fnmatch
import math
import queue
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy
import torch
from torch import nn

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.names import ATTENTION_STATS
from sdcwatch.telemetry import fingerprint as fp

__all__ = [
    "ProbeConfig",
    "Watch",
    "attach",
    "observe_attention",
    "attention_stats",
    "sampled_heads",
    "sampled_queries",
    "ATTENTION_STATS",
]

# attention module -> [(watch, layer index)]; weak so a dropped model leaves no trace
_ATTENTION: "weakref.WeakKeyDictionary[nn.Module, list[tuple[Watch, int]]]" = weakref.WeakKeyDictionary()


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

    def __post_init__(self) -> None:
        for key, lo in (("every", 1), ("attention_every", 1), ("fingerprint_every", 1), ("heads", 0), ("queries", 1),
                        ("sequences", 0), ("canary_every", 0), ("activations_every", 0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"probes.{key}", f"must be an integer >= {lo}, got {v!r}")
        if not isinstance(self.grad_fingerprint, bool):
            raise ConfigError("probes.grad_fingerprint", f"must be a bool, got {self.grad_fingerprint!r}")
        if not isinstance(self.attention, str) or not self.attention:
            raise ConfigError("probes.attention", f"must be 'auto', 'none' or module globs, got {self.attention!r}")


def observe_attention(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, *, logits: torch.Tensor | None = None,
                      causal: bool = True) -> None:
    """Report one attention layer's q, k (batch, heads, time, d_head) to every watch attached to it.

    ``logits`` (batch, heads, time, time; pre-softmax, masked slots -inf) are used as they are when
    given, so a corrupted score GEMM shows; otherwise sampled logits are recomputed from q and k.
    Costs one dictionary look-up when no watch is attached.
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"observe_attention() takes the attention module, got {type(layer).__name__}; "
                        "use watch.observe_attention(index, q, k) for a layer index")
    entries = _ATTENTION.get(layer)
    if entries and not getattr(_CANARY, "active", False):
        for watch, index in entries:
            if watch.enabled:
                watch.observe_attention(index, q, k, logits=logits, causal=causal)


_CANARY = threading.local()  # set while a canary forward runs: its attention is not the step's


def canary_fingerprint(model: nn.Module, inputs: Any) -> torch.Tensor:
    """Raw device fingerprint of ``model(inputs)``, run without gradients, in eval mode.

    The canary check: every data-parallel replica runs the same fixed input through the same
    parameters, so the outputs must agree bit for bit; one that does not points at that rank's
    hardware. The probes do not record this forward pass (its attention is not the step's).
    """
    was_training = model.training
    _CANARY.active = True
    try:
        model.eval()
        with torch.no_grad():
            out = model(inputs)
    finally:
        model.train(was_training)
        _CANARY.active = False
    tensor = out if isinstance(out, torch.Tensor) else _first_tensor_of(out)
    return fp.fingerprint_device([tensor])


def _first_tensor_of(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        out = list(out.values())
    for item in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(item, torch.Tensor):
            return item
    raise TypeError(f"the canary forward returned no tensor ({type(out).__name__})")


def sampled_heads(heads: int, n_head: int) -> slice:
    """The heads probed: ``heads`` of ``n_head``, evenly strided from head 0 (0 = all)."""
    if heads <= 0 or heads >= n_head:
        return slice(0, n_head)
    stride = n_head // heads
    return slice(0, stride * heads, stride)


def sampled_queries(queries: int, t: int) -> slice:
    """The query positions probed: ``queries`` strided positions from ``t // 4`` (early positions
    see too few keys for their entropy to mean much)."""
    start = t // 4
    stride = max(1, (t - start) // queries)
    return slice(start, min(t, start + stride * queries), stride)


def attention_stats(q: torch.Tensor, k: torch.Tensor, *, logits: torch.Tensor | None = None, heads: int = 4,
                    queries: int = 16, sequences: int = 0, causal: bool = True) -> torch.Tensor:
    """The :data:`ATTENTION_STATS` of one layer as a float32 (7,) tensor on the device.

    q and k norms cover every (sequence, head, position). The entropy (nats) covers the sampled
    heads and query positions (:func:`sampled_heads`, :func:`sampled_queries`) of the first
    ``sequences`` sequences (0 = all): mean over sequences and queries per head, then the mean and
    the minimum over heads. The largest logit is over the whole ``logits`` tensor when given (one
    pass that catches a NaN, Inf or near-INF anywhere), else over the sampled logits.
    """
    with torch.no_grad():
        if q.dim() == 3:
            q, k = q.unsqueeze(1), k.unsqueeze(1)
        if q.dim() != 4 or k.dim() != 4:
            raise ValueError(f"q and k must be (batch, heads, time, d_head), got {tuple(q.shape)} and {tuple(k.shape)}")
        q, k = q.detach(), k.detach()
        n_head, t, d_head = q.shape[1:]
        qn = torch.linalg.vector_norm(q, dim=-1)
        kn = torch.linalg.vector_norm(k, dim=-1)
        seqs = slice(0, sequences if sequences > 0 else q.shape[0])
        hs, qs = sampled_heads(heads, n_head), sampled_queries(queries, t)
        if logits is not None:
            logits = logits.detach()
            sampled = logits[seqs, hs, qs]
            top = logits.amax()
        else:
            sampled = (q[seqs, hs, qs] @ k[seqs, hs].transpose(-2, -1)) * (1.0 / math.sqrt(d_head))
            if causal:
                positions = torch.arange(qs.start, qs.stop, qs.step, device=q.device)
                future = torch.arange(k.shape[2], device=q.device)[None, :] > positions[:, None]
                sampled = sampled.masked_fill(future, float("-inf"))
            top = sampled.amax()
        logp = torch.log_softmax(sampled.float(), dim=-1)
        # -sum p log p; masked keys have p = 0 and log p = -inf: clamping makes their term 0, not NaN
        entropy = -(logp.exp() * logp.clamp_min(-1e4)).sum(-1).mean(dim=(0, 2))  # per sampled head
        return torch.stack([entropy.mean(), entropy.min(), qn.mean(), qn.amax(), kn.mean(), kn.amax(),
                            top]).float()


class Watch:
    """Probes attached to one model replica (one rank). Build with :func:`attach`."""

    def __init__(self, model: nn.Module, emitter: Any, *, optimizer: Any = None, ddp: Any = None,
                 config: ProbeConfig | None = None, external: bool = False, background: bool = True,
                 canary_input: Any = None) -> None:
        if not callable(getattr(emitter, "emit", None)):
            raise ConfigError("probes.emitter", f"needs an object with an emit() method, got {type(emitter).__name__}")
        self.model = model
        self.emitter = emitter
        self.optimizer = optimizer
        self.config = config or ProbeConfig()
        self.canary_input = canary_input
        if self.config.canary_every and canary_input is None and not external:
            raise ConfigError("probes.canary_every", "needs canary_input= (a fixed input for the model)")
        self.enabled = True
        self.errors = 0
        """Failures while building or emitting a record (they never reach the training loop)."""
        self._external = external
        self._params = [p for p in model.parameters()]
        self._layers: list[nn.Module] = []
        self._handles: list[Any] = []
        self._hint = 0  # the step we expect next: decides what the hooks measure
        self._last_time: float | None = time.perf_counter()
        self._pending: tuple | None = None
        self._outbox: queue.Queue = queue.Queue()
        self._sender: threading.Thread | None = None
        self._background = background  # False: records are built on the caller's thread (simulation)
        self._closed = False
        self._reset()
        self._discover_attention(model)
        # leaf modules whose outputs act_max covers; hooked only during sampled steps, because a
        # module with a forward hook leaves PyTorch's fast call path on every step
        self._leaves = [m for n, m in model.named_modules() if n and not any(True for _ in m.children())]
        self._act_handles: list[Any] = []
        self._sync_activation_hooks()
        self._group = None
        self._ddp = ddp is not None and not external
        if self._ddp:
            self._group = getattr(ddp, "process_group", None)
            ddp.register_comm_hook(self, _comm_hook)
        elif optimizer is not None and not external:
            self._handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._local_gradients()))

    # -- discovery -----------------------------------------------------------------------------
    def _discover_attention(self, model: nn.Module) -> None:
        spec = self.config.attention
        named = [(n, m) for n, m in model.named_modules()]
        if spec == "none":
            chosen = []
        elif spec == "auto":
            chosen = [(n, m) for n, m in named
                      if getattr(m, "_sdcwatch_attention", False) or isinstance(m, nn.MultiheadAttention)]
        else:
            globs = [g.strip() for g in spec.split(",") if g.strip()]
            chosen = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, g) for g in globs)]
            if not chosen:
                raise ConfigError("probes.attention", f"{spec!r} matches no module")
        for _, m in chosen:
            self._register_layer(m)

    def _register_layer(self, module: nn.Module) -> int:
        index = len(self._layers)
        self._layers.append(module)
        _ATTENTION.setdefault(module, []).append((self, index))
        if isinstance(module, nn.MultiheadAttention):
            self._handles.append(module.register_forward_pre_hook(self._mha_hook(index), with_kwargs=True))
        return index

    @property
    def n_layers(self) -> int:
        """Number of attention layers this watch measures."""
        return len(self._layers)

    # -- per-step collection ---------------------------------------------------------------------
    def _reset(self) -> None:
        self._scalars: dict[str, torch.Tensor] = {}
        self._nonfinite: list[torch.Tensor] = []
        self._host_scalars: dict[str, float] = {}
        self._attn: dict[int, torch.Tensor] = {}
        self._fps: dict[str, torch.Tensor] = {}
        self._buckets: list[tuple] = []
        self._grads_seen = False
        self._act_max: torch.Tensor | None = None

    @property
    def recording(self) -> bool:
        """Whether the step in progress produces a record."""
        return self._hint % self.config.every == 0

    @property
    def _recording_attention(self) -> bool:
        return self.recording and (self._hint // self.config.every) % self.config.attention_every == 0

    @property
    def _recording_activations(self) -> bool:
        every = self.config.activations_every
        return bool(every) and self.recording and (self._hint // self.config.every) % every == 0

    def _sync_activation_hooks(self) -> None:
        """Hook the leaf modules for the step about to run if it is sampled, unhook them if not."""
        want = self._recording_activations and not self._closed
        if want and not self._act_handles:
            self._act_handles = [m.register_forward_hook(self._activation_hook) for m in self._leaves]
        elif not want and self._act_handles:
            for h in self._act_handles:
                h.remove()
            self._act_handles = []

    def _activation_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        """Keep the running max |output| of the step, on the device (no sync)."""
        if not (self.enabled and self._recording_activations) or getattr(_CANARY, "active", False):
            return
        out = output if isinstance(output, torch.Tensor) else None
        if out is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            out = output[0]
        if out is None or not out.is_floating_point() or out.numel() == 0:
            return
        # -inf is how masked attention slots are written: not a fault; NaN and +inf count
        m = out.detach().nan_to_num(nan=math.nan, posinf=math.inf, neginf=0.0).abs().amax().float()
        self._act_max = m if self._act_max is None else torch.maximum(self._act_max, m)

    def begin_step(self, step: int) -> None:
        """Optional: announce the step about to run (else the one after the last ``step()``)."""
        self._hint = int(step)
        self._sync_activation_hooks()
        if self._last_time is None:
            self._last_time = time.perf_counter()

    def observe_attention(self, layer: int | nn.Module, q: torch.Tensor, k: torch.Tensor, *,
                          logits: torch.Tensor | None = None, causal: bool = True) -> None:
        """Measure one attention layer (index, or a module; an unknown module becomes a new layer)."""
        if not self._recording_attention:
            return
        if isinstance(layer, nn.Module):
            known = [i for w, i in _ATTENTION.get(layer, []) if w is self]
            layer = known[0] if known else self._register_layer(layer)
        if not 0 <= layer < len(self._layers):
            raise ConfigError("probes.layer", f"layer {layer} out of range [0, {len(self._layers)})")
        cfg = self.config
        stats = attention_stats(q, k, logits=logits, heads=cfg.heads, queries=cfg.queries, sequences=cfg.sequences,
                                causal=causal)
        self._attn[layer] = stats

    def _mha_hook(self, index: int) -> Callable:
        def hook(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
            if not (self.enabled and self._recording_attention):
                return
            names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
                     "is_causal")
            bound = dict(zip(names, args)) | kwargs
            q, k = _mha_project(module, bound["query"], bound["key"])
            with torch.no_grad():
                logits = None
                mask = bound.get("attn_mask")
                if mask is not None or bound.get("is_causal"):
                    logits = (q[:1] @ k[:1].transpose(-2, -1)) / math.sqrt(q.shape[-1])
                    if mask is not None:
                        m = mask if mask.dim() == 2 else mask[: module.num_heads]
                        logits = logits.masked_fill(m, float("-inf")) if m.dtype == torch.bool else logits + m
                    else:
                        t = logits.shape[-1]
                        logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1),
                                                    float("-inf"))
                self.observe_attention(index, q, k, logits=logits, causal=False)

        return hook

    def observe_gradients(self, *, local_sq: torch.Tensor, global_sq: torch.Tensor, dot: torch.Tensor,
                          nonfinite: torch.Tensor | None = None, grad_fp: torch.Tensor | None = None) -> None:
        """Gradient statistics computed elsewhere (the DDP hook, the simulated all-reduce): sums of
        squares and the dot product of the local with the global gradient, on the device.
        ``nonfinite`` is an extra count of non-finite values seen there (added to the record's own)."""
        self._scalars["grad_norm_local"] = local_sq.sqrt()
        self._scalars["grad_norm_global"] = global_sq.sqrt()
        self._scalars["grad_cosine"] = dot / (local_sq.sqrt() * global_sq.sqrt()).clamp_min(1e-30)
        if nonfinite is not None:
            self._nonfinite.append(nonfinite)
        if grad_fp is not None:
            self._fps["grad_fp"] = grad_fp
        self._grads_seen = True

    def observe_fingerprint(self, name: str, raw: torch.Tensor) -> None:
        """A raw device fingerprint (see :mod:`sdcwatch.telemetry.fingerprint`) computed elsewhere."""
        self._fps[name] = raw

    def _local_gradients(self) -> None:
        """World-size-1 gradient statistics from ``p.grad`` (no all-reduce: local is global).

        One fused norm over all gradient tensors (a NaN or Inf anywhere makes it non-finite, which
        the record's ``nonfinite`` count then shows).
        """
        if not (self.enabled and self.recording) or self._grads_seen:
            return
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        self._set_world1_norm(norm)
        if self.config.grad_fingerprint and self._fingerprint_step:
            self._fps["grad_fp"] = fp.flat_fingerprint_device(grads)

    def _set_world1_norm(self, norm: torch.Tensor) -> None:
        self._scalars["grad_norm_local"] = norm
        self._scalars["grad_norm_global"] = norm
        self._host_scalars["grad_cosine"] = 1.0  # one replica: the local gradient is the global one
        self._grads_seen = True

    @property
    def _fingerprint_step(self) -> bool:
        return self._hint % self.config.fingerprint_every == 0

    # -- the step ----------------------------------------------------------------------------------
    def step(self, step: int, *, loss: Any = None, step_time: float | None = None, **scalars: Any) -> None:
        """Close ``step``: pack this step's metrics, start their copy, emit the previous step's record.

        ``loss`` is the rank's own micro-batch loss (a tensor stays on the device); other keyword
        scalars (``loss_global=...``) go into the record as they are. Never raises.
        """
        now = time.perf_counter()
        try:
            self._step(int(step), loss, step_time, scalars, now)
        except Exception as exc:  # the job must not die for its telemetry
            self._fail(exc)
            self._reset()
        self._hint = int(step) + 1
        self._last_time = now
        try:
            self._sync_activation_hooks()
        except Exception as exc:
            self._fail(exc)

    def _step(self, step: int, loss: Any, step_time: float | None, scalars: dict, now: float) -> None:
        if not self.enabled:
            self._reset()
            return
        if not self.recording:
            self._reset()
            self._handoff()
            return
        if not self._external and not self._ddp and not self._grads_seen:
            self._local_gradients()
        if self._buckets:
            self._reduce_buckets()
        if not self._external and step % self.config.fingerprint_every == 0 and self._params:
            self._fps["param_fp"] = fp.flat_fingerprint_device(self._params)
        if (not self._external and self.canary_input is not None and self.config.canary_every
                and step % self.config.canary_every == 0):
            self._fps["canary_fp"] = canary_fingerprint(self.model, self.canary_input)
        host: dict[str, float] = dict(self._host_scalars)
        if step_time is None and self._last_time is not None:
            step_time = now - self._last_time
        if step_time is not None:
            host["step_time"] = float(step_time)
        if self.optimizer is not None and self.optimizer.param_groups:
            host["lr"] = float(self.optimizer.param_groups[0]["lr"])
        dropped = getattr(self.emitter, "dropped", None)
        if isinstance(dropped, (int, float)) and not isinstance(dropped, bool):
            host["emitter_dropped"] = float(dropped)
        device_scalars = dict(self._scalars)
        if self._act_max is not None:
            device_scalars["act_max"] = self._act_max
        if loss is not None:
            if isinstance(loss, torch.Tensor):
                device_scalars["loss"] = _scalar(loss)
            else:
                host["loss"] = float(loss)
        for name, value in scalars.items():
            if isinstance(value, torch.Tensor):
                device_scalars[name] = _scalar(value)
            elif value is not None:
                host[name] = float(value)
        attn = None
        if self._attn and len(self._attn) == len(self._layers):
            attn = torch.stack([self._attn[i] for i in range(len(self._layers))])  # (layers, 7)
        self._pack(step, device_scalars, attn, host)
        self._reset()

    def _pack(self, step: int, device_scalars: dict, attn: torch.Tensor | None, host: dict) -> None:
        """One device tensor (float64 values bit-cast to int64, then fingerprints) and its async copy."""
        names = list(device_scalars)
        values = [t if t.dtype == torch.float32 else t.float() for t in device_scalars.values()]  # all 0-d
        if self._nonfinite:
            names.append("_nonfinite_extra")
            values.append(sum(self._nonfinite[1:], self._nonfinite[0]).reshape(()).float())
        if len({v.device for v in values}) > 1:
            values = [v.to(values[0].device) for v in values]
        floats = torch.stack(values) if values else None
        n_attn = 0
        if attn is not None:
            floats = attn.reshape(-1).float() if floats is None else torch.cat([floats, attn.reshape(-1).float()])
            n_attn = attn.shape[0]
        fp_names = list(self._fps)
        pieces = [floats.double().view(torch.int64)] if floats is not None else []
        if fp_names:
            pieces.append(torch.stack([self._fps[n].reshape(()) for n in fp_names]))
        if not pieces:
            packed = torch.zeros(0, dtype=torch.int64)
        else:
            device = pieces[0].device
            packed = torch.cat([pc.to(device) for pc in pieces]) if len(pieces) > 1 else pieces[0]
        event = None
        if packed.device.type == "cuda":
            host_buf = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host_buf.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            packed = host_buf
        elif packed.device.type != "cpu":
            packed = packed.to("cpu", non_blocking=True)
        self._handoff()
        self._pending = (step, packed, event, names, n_attn, fp_names, host)

    def _handoff(self) -> None:
        """Pass the record whose copy was started a step ago to the sender thread.

        Decoding it into a record and calling the emitter happens off the training thread.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not self._background:
            self._emit_pending(pending)
            return
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name="sdcwatch-probes", daemon=True)
            self._sender.start()
        self._outbox.put(pending)

    def _send_loop(self) -> None:
        while True:
            pending = self._outbox.get()
            try:
                if pending is None:
                    return
                self._emit_pending(pending)
            finally:
                self._outbox.task_done()

    def _emit_pending(self, pending: tuple) -> None:
        """Read one packed step on the host and hand it to the emitter as a record."""
        try:
            step, packed, event, names, n_attn, fp_names, host = pending
            if event is not None:
                event.synchronize()
            values = packed.numpy()
            n_float = len(names) + n_attn * len(ATTENTION_STATS)
            floats = values[:n_float].view("float64")
            scalars = dict(host)
            scalars.update(zip(names, floats[: len(names)].tolist()))
            # non-finite values among the metrics themselves: the loss, the gradient norms (a NaN or
            # Inf anywhere in the gradient makes them so), the attention statistics (q, k, logits)
            extra = scalars.pop("_nonfinite_extra", 0.0)
            seen = numpy.count_nonzero(~numpy.isfinite(floats))
            scalars["nonfinite"] = float(seen) + (extra if math.isfinite(extra) else 0.0)
            layers = None
            if n_attn:
                grid = floats[len(names):].reshape(n_attn, len(ATTENTION_STATS))
                layers = dict(zip(ATTENTION_STATS, grid.T.tolist()))
            fingerprints = {n: fp.finalize(v) for n, v in zip(fp_names, values[n_float:].tolist())} or None
            self.emitter.emit(step, layers=layers, fingerprints=fingerprints, **scalars)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.errors += 1
        if self.errors == 1:
            warnings.warn(f"sdcwatch probes: record dropped ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=3)

    # -- DDP ------------------------------------------------------------------------------------------
    def _reduce_buckets(self) -> None:
        buckets = sorted(self._buckets, key=lambda b: b[0])
        local_sq = torch.stack([b[1] for b in buckets]).sum()
        dot = torch.stack([b[2] for b in buckets]).sum()
        global_sq = torch.stack([b[3] for b in buckets]).sum()
        parts = [b[4] for b in buckets if b[4] is not None]
        grad_fp = fp.combine_parts(parts) if parts and len(parts) == len(buckets) else None
        self.observe_gradients(local_sq=local_sq, global_sq=global_sq, dot=dot, grad_fp=grad_fp)

    # -- lifecycle --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Emit every record packed so far, the last step's included, and wait until they are."""
        self._handoff()
        if self._sender is not None:
            self._outbox.join()

    def close(self) -> None:
        """Emit the pending record and remove the hooks this watch registered (the emitter stays open)."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join(timeout=10.0)
        for h in self._handles + self._act_handles:
            h.remove()
        self._handles.clear()
        self._act_handles = []
        for m in self._layers:
            entries = _ATTENTION.get(m)
            if entries:
                entries[:] = [(w, i) for w, i in entries if w is not self]

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """A detached 0-d view of a one-element tensor (no copy, no sync)."""
    t = t.detach()
    return t if t.dim() == 0 else t.reshape(())


def _comm_hook(watch: Watch, bucket):  # noqa: ANN001,ANN201 - DDP rejects string annotations here
    """DDP all-reduce (average) that also measures the bucket before and after the reduction."""
    import torch.distributed as dist

    group = watch._group if watch._group is not None else dist.group.WORLD
    buf = bucket.buffer()
    measure = watch.enabled and watch.recording
    if measure:
        local = buf.detach().clone()  # transient, one bucket: the local gradient for the dot product
        local_sq = local.float().pow(2).sum()
    buf.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    if not measure:
        return fut.then(lambda f: f.value()[0])
    index = bucket.index()
    want_fp = watch.config.grad_fingerprint and watch._fingerprint_step

    def measured(f: Any) -> torch.Tensor:
        g = f.value()[0]
        with torch.no_grad():
            watch._buckets.append((index, local_sq, (local.float() * g.float()).sum(), g.float().pow(2).sum(),
                                   fp.tensor_parts(g) if want_fp else None))
        return g

    return fut.then(measured)


def _mha_project(m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of the first sequence, (1, heads, time, d_head), from an ``nn.MultiheadAttention``'s inputs."""
    with torch.no_grad():
        if query.dim() == 2:  # unbatched
            query, key = query.unsqueeze(0), key.unsqueeze(0)
        elif not m.batch_first:
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        query, key = query[:1], key[:1]
        e = m.embed_dim
        if m.in_proj_weight is not None:
            wq, wk = m.in_proj_weight[:e], m.in_proj_weight[e: 2 * e]
        else:
            wq, wk = m.q_proj_weight, m.k_proj_weight
        bq = bk = None
        if m.in_proj_bias is not None:
            bq, bk = m.in_proj_bias[:e], m.in_proj_bias[e: 2 * e]
        q = nn.functional.linear(query, wq, bq)
        k = nn.functional.linear(key, wk, bk)
        h = m.num_heads
        q = q.view(1, q.shape[1], h, e // h).transpose(1, 2)
        k = k.view(1, k.shape[1], h, e // h).transpose(1, 2)
        return q, k


def attach(model: nn.Module, emitter: Any, *, optimizer: Any = None, ddp: Any = None, every: int = 1,
           config: ProbeConfig | None = None, canary_input: Any = None, **settings: Any) -> Watch:
    """Attach probes to ``model`` (and its optimizer, and its DDP wrapper) reporting to ``emitter``.

    ``settings`` are :class:`ProbeConfig` fields (``every``, ``attention_every``, ``heads``...);
    an unknown one is a ConfigError. With ``ddp`` a communication hook is registered (before the
    first backward); without it the gradient statistics come from ``p.grad`` just before
    ``optimizer.step()`` (or at ``watch.step()``): world size one. ``canary_input`` (a fixed
    input, the same on every rank) with ``canary_every=N`` turns on the canary check.
    """
    known = set(ProbeConfig.__dataclass_fields__)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"probes.{unknown[0]}", f"unknown setting (known: {', '.join(sorted(known))})")
    if config is None:
        config = ProbeConfig(every=every, **settings)
    if ddp is not None and model is ddp:
        model = ddp.module
    return Watch(model, emitter, optimizer=optimizer, ddp=ddp, config=config, canary_input=canary_input)
