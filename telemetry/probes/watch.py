"""Training-side probes, the watch: what a user adds to a PyTorch training loop to feed sdcwatch.

    watch = attach(model, emitter, optimizer=opt, ddp=ddp_model)
    for step, batch in enumerate(data):
        loss = ...; loss.backward(); opt.step(); opt.zero_grad()
        watch.step(step, loss=loss)
    watch.close()

Every metric is computed on the device as a 0-d tensor. At :meth:`Watch.step` they are packed
into one tensor that leaves the device in one asynchronous copy; the host reads it a step later
and hands a record to the emitter. Nothing on the training path calls ``.item()``.
Under DDP a communication hook sees each gradient bucket before and after the all-reduce (local
and global norms, their dot product, the all-reduced gradient's fingerprint); under FSDP2 each
module's reduce-scatter does (:mod:`~sdcwatch.telemetry.probes.fsdp`). Attention is seen
from outside on sampled steps (:mod:`~sdcwatch.telemetry.probes.sdpa`), or layers report q, k and logits
through :func:`observe_attention`; heads and query positions are sampled.

The parts live beside it: :mod:`~sdcwatch.telemetry.probes.attention` (the attention statistics),
:mod:`~sdcwatch.telemetry.probes.sdpa` (the attention tap), :mod:`~sdcwatch.telemetry.probes.activations` (act_max),
:mod:`~sdcwatch.telemetry.probes.ddp_hook` (the communication hook), :mod:`~sdcwatch.telemetry.probes.packing`
(the device-to-host hand-off) and :mod:`~sdcwatch.telemetry.probes.canary` (the canary check).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from typing import Any

import torch
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.vocabulary import CANARY_PRODUCT, FIRST_BAD
from sdcwatch.telemetry.probes import fingerprint as fp
from sdcwatch.telemetry.probes.activations import ActivationMax
from sdcwatch.telemetry.probes.attention import (
    ATTENTION_WATCHES,
    LIVE_WATCHES,
    finish_attention,
)
from sdcwatch.telemetry.probes.attention_layers import AttentionLayers
from sdcwatch.telemetry.probes.canary import canary_fingerprint, canary_running
from sdcwatch.telemetry.probes.compiled import watch_compiled_code
from sdcwatch.telemetry.probes.kept import kept_calls
from sdcwatch.telemetry.probes.config import ProbeConfig
from sdcwatch.telemetry.probes.ddp_hook import comm_hook
from sdcwatch.telemetry.probes.finite import FiniteChecks
from sdcwatch.telemetry.probes.fsdp import ShardedGradients, is_sharded, local_tensors
from sdcwatch.telemetry.probes.gemm_canary import GemmCanary
from sdcwatch.telemetry.probes.gradients import GradientStats, unless_closure
from sdcwatch.telemetry.probes.layer_names import NameHandoff
from sdcwatch.telemetry.probes.mesh_torch import coords_from_mesh
from sdcwatch.telemetry.probes.packing import PackedStep, pack_step, unpack_step
from torch import nn

__all__ = ["Watch", "attach", "canary_product"]


class Watch(GradientStats, AttentionLayers):
    """Probes attached to one model replica (one rank). Build with :func:`attach`."""

    def __init__(
        self,
        model: nn.Module,
        emitter: Any,
        *,
        optimizer: Any = None,
        ddp: Any = None,
        config: ProbeConfig | None = None,
        external: bool = False,
        background: bool = True,
        canary_input: Any = None,
        mesh: Any = None,
        mesh_names: Any = None,
    ) -> None:
        if not callable(getattr(emitter, "emit", None)):
            raise ConfigError("probes.emitter", f"needs an object with an emit() method, got {type(emitter).__name__}")
        self.model = model
        self.emitter = emitter
        self.coords: dict[str, int] = {}
        """This rank's parallel coordinates (from ``mesh``), carried by every record."""
        if mesh is not None:
            self.coords = coords_from_mesh(mesh, mesh_names, sharded=is_sharded(model))
            set_coords = getattr(emitter, "set_coords", None)  # the Emitter's; a stand-in may have none
            if set_coords is not None:
                set_coords(self.coords)
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
        self._layer_index: dict[nn.Module, int] = {}
        self.module_names: dict[nn.Module, str] = {m: n for n, m in model.named_modules()}
        self._self_reporting: set[nn.Module] = set()  # layers that call observe_attention themselves
        # FSDP2: the gradient statistics come from the model's reduce-scatters (a ConfigError here,
        # before any hook is registered, when they cannot)
        sharded = ddp is None and not external and is_sharded(model)
        self._sharded = ShardedGradients(self, model) if sharded else None
        self._activations = ActivationMax(model, self.module_names, lambda: self.enabled and not canary_running())
        self.act_max_module: str | None = None
        """The module that produced the largest output of the last sampled step emitted."""
        self.attention_on = False  # the step in progress measures attention (fixed for the step)
        self._handles: list[Any] = []
        self._hint = 0  # the step we expect next: decides what the hooks measure
        self._last_time: float | None = time.perf_counter()
        self._pending: PackedStep | None = None
        self._outbox: queue.Queue = queue.Queue()
        self._sender: threading.Thread | None = None
        self._background = background  # False: records are built on the caller's thread (simulation)
        self._closed = False
        self._reset()
        self._discover_attention(model)
        self._tap = None
        if self.config.attention != "none" and not external:
            from sdcwatch.telemetry.probes.sdpa import AttentionTap

            self._tap = AttentionTap(self)
            self._handles += self._tap.install(model)
        self._finite = FiniteChecks(self, model, optimizer=optimizer, external=external)
        self.checksums = self._finite.checksums  # GemmChecks: .names says which product each gemm_* layer is
        self._names = NameHandoff(self)  # the emitter sends the name lists ahead of the records
        self.gemm_canary = None if external else GemmCanary.of(model, self.config)  # gemm_canary_fp
        self._sync_activation_hooks()
        self._group = None
        self._ddp = ddp is not None and not external
        if self._ddp:
            self._group = getattr(ddp, "process_group", None)
            ddp.register_comm_hook(self, comm_hook)
        elif not external:
            if self._sharded is None:  # world size one: read at the end of each backward, before clipping
                self._handles += self._watch_backward()
            before = self._local_gradients if self._sharded is None else self._sharded.before_optimizer
            if optimizer is not None:
                self._handles.append(optimizer.register_step_pre_hook(unless_closure(before)))
        LIVE_WATCHES.add(self)

    @property
    def leaf_names(self) -> list[str]:
        """Names of the modules ``act_max`` covers; a record's ``act_max_module`` indexes this list."""
        return self._activations.leaf_names

    @property
    def n_layers(self) -> int:
        """Number of attention layers this watch measures."""
        return len(self._layers)

    # -- per-step collection ---------------------------------------------------------------------
    def _reset(self) -> None:
        self._scalars: dict[str, torch.Tensor] = {}
        self._nonfinite: list[torch.Tensor] = []
        self._host_scalars: dict[str, float] = {}
        self._attn: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> (folded statistics, observations)
        if getattr(self, "_layers", None):
            kept_calls(self._layers, self._attn_attr)  # compiled code's observations of a dropped step
        self._fps: dict[str, torch.Tensor] = {}
        self._buckets: list[tuple] = []
        self._grads_seen = False
        self._backward_queued = False  # a backward that failed never ran its end-of-backward read
        self._activations.clear()

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
        """Set what the hooks measure in the step about to run (fixed for the step: under
        torch.compile a hook reading the step number would recompile at every sampled step)."""
        self._activations.sync(self._recording_activations and not self._closed)
        self.attention_on = self._recording_attention and not self._closed
        self._finite.sync(self._closed)

    def observe_attention(
        self,
        layer: int | nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        logits: torch.Tensor | None = None,
        causal: bool = True,
    ) -> None:
        """Measure one attention layer; its logits' extremes go to the residual-stream check."""
        self._finite.observe_logits(layer, logits)
        super().observe_attention(layer, q, k, logits=logits, causal=causal)

    def begin_step(self, step: int) -> None:
        """Optional: announce the step about to run (else the one after the last ``step()``)."""
        self._hint = int(step)
        self._sync_activation_hooks()
        if self._last_time is None:
            self._last_time = time.perf_counter()

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
        if self._sharded is not None:
            self._sharded.reduce()
        elif not self._external and not self._ddp and not self._grads_seen:
            self._local_gradients()
        if self._buckets:
            self._reduce_buckets()
        if not self._external and step % self.config.fingerprint_every == 0 and self._params:
            # the local shards under FSDP2: equal across the replicas of a shard
            self._fps["param_fp"] = fp.flat_fingerprint_device(local_tensors(self._params))
        if (
            not self._external
            and self.canary_input is not None
            and self.config.canary_every
            and step % self.config.canary_every == 0
        ):
            self._fps["canary_fp"] = canary_fingerprint(self.model, self.canary_input)
        host: dict[str, float] = dict(self._host_scalars)
        if self.gemm_canary is not None:  # a collective under FSDP2 (every rank): one product of a known input
            self.gemm_canary.report(step, self._fps)
            if "gemm_canary_fp" in self._fps:  # which product: an incident on it names it
                host.update(canary_product(self.gemm_canary, step))
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
        device_scalars.update(self._activations.take())
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
        self._drain_attention()
        if self._attn and len(self._attn) == len(self._layers):
            attn = torch.stack([finish_attention(*self._attn[i]) for i in range(len(self._layers))])  # (layers, 7)
        elif self._tap is not None:
            self._tap.check_seen()
        self._pack(step, device_scalars, attn, host)
        self._reset()

    def _pack(self, step: int, device_scalars: dict, attn: torch.Tensor | None, host: dict) -> None:
        """Start this step's copy to the host; the previous step's record goes to the sender."""
        extra = sum(self._nonfinite[1:], self._nonfinite[0]).reshape(()).float() if self._nonfinite else None
        layers, finite_scalars = self._finite.collect()
        packed = pack_step(
            step, {**device_scalars, **finite_scalars}, attn, self._fps, host, nonfinite_extra=extra, layers=layers
        )
        self._handoff()
        self._pending = packed

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

    def _emit_pending(self, pending: PackedStep) -> None:
        """Read one packed step on the host and hand it to the emitter as a record."""
        try:
            step, scalars, layers, fingerprints = unpack_step(pending)
            if scalars.get(FIRST_BAD, 0.0) < 0:  # a clean step: nothing to place
                del scalars[FIRST_BAD]
            self._names(scalars)  # act_max_module's layer; the name lists to the emitter when they grew
            self.emitter.emit(step, layers=layers, fingerprints=fingerprints, **scalars)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.errors += 1
        if self.errors == 1:
            warnings.warn(
                f"sdcwatch probes: record dropped ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=3
            )

    def checkpoint(self, step: int, path: Any = "") -> None:
        """Tell the service the job saved a checkpoint holding the update of ``step`` at ``path``
        (the emitter's :meth:`~sdcwatch.telemetry.wire.emitter.Emitter.checkpoint`; never raises)."""
        note = getattr(self.emitter, "checkpoint", None)  # a stand-in emitter may have none
        if note is not None:
            try:
                note(step, path)
            except Exception:  # never into the training loop
                pass

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
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._activations.remove()
        self._finite.remove()
        if self._sharded is not None:
            self._sharded.remove()
        LIVE_WATCHES.discard(self)
        if self._tap is not None:
            self._tap.close()
        for m in self._layers:
            entries = ATTENTION_WATCHES.get(m)
            if entries:
                entries[:] = [(w, i) for w, i in entries if w is not self]

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def canary_product(canary: GemmCanary, step: int) -> dict[str, float]:
    """``{CANARY_PRODUCT: index}`` of the product ``canary`` checks at ``step`` (its index in
    ``canary.products``), sent with that step's ``gemm_canary_fp``; empty without a product."""
    k = canary.index_at(step)
    return {} if k is None else {CANARY_PRODUCT: float(k)}


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """A detached 0-d view of a one-element tensor (no copy, no sync)."""
    t = t.detach()
    return t if t.dim() == 0 else t.reshape(())


def attach(
    model: nn.Module,
    emitter: Any,
    *,
    optimizer: Any = None,
    ddp: Any = None,
    every: int = 1,
    config: ProbeConfig | None = None,
    canary_input: Any = None,
    mesh: Any = None,
    mesh_names: Any = None,
    **settings: Any,
) -> Watch:
    """Attach probes to ``model`` (and its optimizer, and its DDP wrapper) reporting to ``emitter``.

    ``settings`` are :class:`ProbeConfig` fields (``every``, ``attention_every``, ``heads``...);
    an unknown one is a ConfigError. With ``ddp`` a communication hook is registered (before the
    first backward); without it the gradient statistics come from ``p.grad`` at the end of each
    backward, before any clipping (world size one). A ``DistributedDataParallel``
    passed as ``model`` is taken as its own ``ddp``. ``canary_input`` (a fixed
    input, the same on every rank) with ``canary_every=N`` turns on the canary check.

    A model sharded by FSDP2 (``fully_shard``, HSDP included) is measured through its
    reduce-scatters (:mod:`~sdcwatch.telemetry.probes.fsdp`): attach after ``fully_shard``. ``mesh`` (a
    torch ``DeviceMesh``, the job's whole mesh) puts this rank's parallel coordinates on every
    record (:func:`~sdcwatch.telemetry.probes.mesh_torch.coords_from_mesh`); ``mesh_names`` says what
    mesh dims with other names are, e.g. ``{"model": "tp"}``.
    """
    built = ProbeConfig.from_settings(every=every, **settings)  # an unknown setting is a ConfigError
    if config is None:
        config = built
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: hooks go on the module it compiles
    if ddp is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        ddp = model  # attach(DDP(model), ...): the wrapper is the DDP hook's, as if ddp= were given
    if ddp is not None and model is ddp:
        model = ddp.module
    watch_compiled_code(model)  # compiled code runs the hooks the watch adds
    return Watch(
        model,
        emitter,
        optimizer=optimizer,
        ddp=ddp,
        config=config,
        canary_input=canary_input,
        mesh=mesh,
        mesh_names=mesh_names,
    )
