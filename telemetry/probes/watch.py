"""The watch, what ``attach()`` adds to a training loop: parts write one step's device values into a
:class:`~sdcwatch.telemetry.probes.gradients.StepBuffer`, packed into one tensor copied asynchronously
and handed to the emitter a step later, off the training thread: nothing on the training path syncs.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Sequence

import torch
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.vocabulary import CANARY_PRODUCT, FIRST_BAD
from sdcwatch.telemetry.wire.environment import RankEnvironment
from sdcwatch.telemetry.probes import fingerprint as fp
from sdcwatch.telemetry.probes.activations import ActivationMax
from sdcwatch.telemetry.probes.attention import LIVE_WATCHES, finish_attention
from sdcwatch.telemetry.probes.attention_layers import AttentionLayers
from sdcwatch.telemetry.probes.canary import canary_fingerprint, canary_running
from sdcwatch.telemetry.probes.compiled import watch_compiled_code
from sdcwatch.telemetry.probes.compiled_calls import remove_hooks
from sdcwatch.telemetry.probes.config import ProbeConfig
from sdcwatch.telemetry.probes.ddp_hook import comm_hook
from sdcwatch.telemetry.probes.sampled_checks import SampledChecks
from sdcwatch.telemetry.probes.fsdp import ShardedGradients, is_sharded, local_tensors
from sdcwatch.telemetry.probes.gemm_canary import GemmCanary
from sdcwatch.telemetry.probes.gradients import GradientStats, StepBuffer, unless_closure
from sdcwatch.telemetry.probes.name_handoff import NameHandoff
from sdcwatch.telemetry.probes.mesh_torch import coords_from_mesh
from sdcwatch.telemetry.probes.packing import PackedStep, RecordSender, pack_step, unpack_step
from sdcwatch.telemetry.probes.sdpa import AttentionTap
from torch import nn

__all__ = ["Watch", "attach", "canary_product"]


class Watch:
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
        environment: RankEnvironment | None = None,
        canary_names: Sequence[str] = (),
    ) -> None:
        if not callable(getattr(emitter, "emit", None)):
            raise ConfigError("probes.emitter", f"needs an object with an emit() method, got {type(emitter).__name__}")
        self.model = model
        self.emitter = emitter
        self.coords = _rank_coords(model, emitter, mesh, mesh_names)  # this rank's, on every record
        self.optimizer = optimizer
        self.config = config or ProbeConfig()
        self.canary_input = canary_input
        # external: the products of the driver's own canary, which its records' gemm_canary_product indexes
        self.canary_names = list(canary_names)
        if self.config.canary_every and canary_input is None and not external:
            raise ConfigError("probes.canary_every", "needs canary_input= (a fixed input for the model)")
        self.enabled = True
        self.errors = 0  # failures while building or emitting a record (they never reach the training loop)
        self.buffer = StepBuffer()  # this step's values, written by the parts, packed at the step's end
        self.module_names: dict[nn.Module, str] = {m: n for n, m in model.named_modules()}
        self.act_max_module: str | None = None  # the last emitted sampled step's largest output's
        self.attention_on = False  # the step in progress measures attention (fixed for the step)
        self.next_step = 0  # the step expected next: decides what the hooks measure
        self.closed = False
        self._handles: list[Any] = []
        self._last_time = time.perf_counter()  # the previous step's close: the step time's start
        # background False: records are built on the caller's thread (simulation)
        self.sender = RecordSender(self._emit, background=background)  # a step later, off the training thread
        self._build_parts(model, ddp, optimizer, external, environment or RankEnvironment.read())
        LIVE_WATCHES.add(self)

    def _build_parts(
        self, model: nn.Module, ddp: Any, optimizer: Any, external: bool, environment: RankEnvironment
    ) -> None:
        """The parts, in the order their hooks must run, and the gradient hooks last."""
        self._external = external
        self._ddp = ddp is not None and not external
        # FSDP2: the gradient statistics come from the model's reduce-scatters (a ConfigError here,
        # before any hook is registered, when they cannot)
        sharded = ddp is None and not external and is_sharded(model)
        self.gradients = GradientStats(
            self,
            self.buffer,
            list(model.parameters()),
            group=getattr(ddp, "process_group", None) if self._ddp else None,
            reduced_elsewhere=self._ddp or external,
            sharded=sharded,
        )
        self._sharded = ShardedGradients(self.gradients, model) if sharded else None
        self._activations = ActivationMax(model, self.module_names, lambda: self.enabled and not canary_running())
        self.attention = AttentionLayers(self, self.buffer, model)
        self._tap = None
        if self.config.attention != "none" and not external:
            self._tap = AttentionTap(self)
            self._handles += self._tap.install(model)
        # the checksums and the residual stream
        self.sampled_checks = SampledChecks(
            self, model, environment=environment, optimizer=optimizer, external=external
        )
        self.checksums = self.sampled_checks.checksums  # .names: the product of each gemm_* layer
        self._names = NameHandoff(self)  # the emitter sends the name lists ahead of the records
        self.gemm_canary = None if external else GemmCanary.of(model, self.config)  # gemm_canary_fp
        self._sync_activation_hooks()
        if self._ddp:
            ddp.register_comm_hook(self.gradients, comm_hook)
        elif not self._external:
            if self._sharded is None:  # world size one: read at the end of each backward, before clipping
                self._handles += self.gradients.hook_backward()
            before = self.gradients.local_gradients if self._sharded is None else self._sharded.before_optimizer
            if optimizer is not None:
                self._handles.append(optimizer.register_step_pre_hook(unless_closure(before)))

    @property
    def leaf_names(self) -> list[str]:
        """Names of the modules ``act_max`` covers; a record's ``act_max_module`` indexes this list."""
        return self._activations.leaf_names

    @property
    def n_layers(self) -> int:
        """Number of attention layers this watch measures."""
        return len(self.attention.layers)

    @property
    def layer_names(self) -> list[str]:
        """Module names of the attention layers, in layer-index order."""
        return [self.module_names.get(m, "") for m in self.attention.layers]

    def begin_forward(self) -> None:
        """Mark the start of a forward pass that bypasses the model's call (Lightning's ``training_step``)."""
        if self._tap is not None:
            self._tap.forward_begin()

    def end_forward(self) -> None:
        """Mark the end of the forward pass :meth:`begin_forward` began."""
        if self._tap is not None:
            self._tap.forward_end()

    def observe_gradients(self, **stats: torch.Tensor | None) -> None:
        """Gradient statistics computed elsewhere (:meth:`GradientStats.observe_gradients`)."""
        self.gradients.observe_gradients(**stats)

    def observe_fingerprint(self, name: str, raw: torch.Tensor) -> None:
        """A raw device fingerprint (see :mod:`sdcwatch.telemetry.probes.fingerprint`) computed elsewhere."""
        self.buffer.fps[name] = raw

    def clip_grad_norm_(self, max_norm: float, **kwargs: Any) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``, bit for bit, once the watch read the step's gradient
        (:meth:`GradientStats.clip_grad_norm_`)."""
        return self.gradients.clip_grad_norm_(max_norm, **kwargs)

    # -- per-step collection ---------------------------------------------------------------------
    def _reset(self) -> None:
        self.buffer.clear()
        self.attention.discard()  # compiled code's observations of a dropped step
        self._activations.clear()

    @property
    def recording(self) -> bool:
        """Whether the step in progress produces a record."""
        return self.next_step % self.config.every == 0

    def _sync_activation_hooks(self) -> None:
        """Fix what the hooks measure in the step about to run (under torch.compile a hook reading
        the step number would recompile at every sampled step)."""
        cfg, sampled = self.config, self.next_step // self.config.every
        live = self.recording and not self.closed
        self._activations.sync(live and bool(cfg.activations_every) and sampled % cfg.activations_every == 0)
        self.attention_on = live and sampled % cfg.attention_every == 0
        self.sampled_checks.sync(self.closed)

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
        self.sampled_checks.observe_logits(layer, logits)
        self.attention.observe(layer, q, k, logits=logits, causal=causal)

    def begin_step(self, step: int) -> None:
        """Optional: announce the step about to run (else the one after the last ``step()``)."""
        self.next_step = int(step)
        self._sync_activation_hooks()

    @property
    def fingerprint_due(self) -> bool:
        """Whether the step in progress fingerprints the parameters and the gradient."""
        return self.next_step % self.config.fingerprint_every == 0

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
            self.fail(exc)
            self._reset()
        self.next_step = int(step) + 1
        self._last_time = now
        try:
            self._sync_activation_hooks()
        except Exception as exc:
            self.fail(exc)

    def _step(self, step: int, loss: Any, step_time: float | None, scalars: dict, now: float) -> None:
        if not self.enabled:
            self._reset()
            return
        if not self.recording:
            self._reset()
            self.sender.handoff()
            return
        buf = self.buffer
        if self._sharded is not None:
            self._sharded.reduce()
        elif not self._external and not self._ddp and not buf.grads_seen:
            self.gradients.local_gradients()
        if buf.buckets:
            self.gradients.reduce_buckets()
        params = self.gradients.params
        if not self._external and step % self.config.fingerprint_every == 0 and params:
            # the local shards under FSDP2: equal across the replicas of a shard
            buf.fps["param_fp"] = fp.flat_fingerprint_device(local_tensors(params))
        if not self._external and self.config.canary_every and step % self.config.canary_every == 0:
            buf.fps["canary_fp"] = canary_fingerprint(self.model, self.canary_input)
        host: dict[str, float] = dict(buf.host)
        if self.gemm_canary is not None:  # a collective under FSDP2 (every rank): one product of a known input
            self.gemm_canary.report(step, buf.fps)
            if "gemm_canary_fp" in buf.fps:  # which product: an incident on it names it
                host.update(canary_product(self.gemm_canary, step))
        host["step_time"] = float(now - self._last_time if step_time is None else step_time)
        if self.optimizer is not None and self.optimizer.param_groups:
            host["lr"] = float(self.optimizer.param_groups[0]["lr"])
        dropped = getattr(self.emitter, "dropped", None)
        if isinstance(dropped, (int, float)) and not isinstance(dropped, bool):
            host["emitter_dropped"] = float(dropped)
        device_scalars = {**buf.scalars, **self._activations.take()}
        for name, value in {"loss": loss, **scalars}.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()  # as a 0-d view: no copy, no sync
                device_scalars[name] = value if value.dim() == 0 else value.reshape(())
            elif value is not None:
                host[name] = float(value)
        attn = None
        self.attention.drain()
        n_layers = len(self.attention.layers)
        if buf.attention and len(buf.attention) == n_layers:
            attn = torch.stack([finish_attention(*buf.attention[i]) for i in range(n_layers)])  # (layers, 7)
        elif self._tap is not None:
            self._tap.check_seen()
        self._pack(step, device_scalars, attn, host)
        self._reset()

    def _pack(self, step: int, device_scalars: dict, attn: torch.Tensor | None, host: dict) -> None:
        """Start this step's copy to the host; the previous step's record goes to the sender."""
        buf = self.buffer
        extra = sum(buf.nonfinite[1:], buf.nonfinite[0]).reshape(()).float() if buf.nonfinite else None
        layers, sampled_scalars = self.sampled_checks.collect()
        packed = pack_step(
            step, {**device_scalars, **sampled_scalars}, attn, buf.fps, host, nonfinite_extra=extra, layers=layers
        )
        self.sender.put(packed)

    def _emit(self, packed: PackedStep) -> None:
        """Read one packed step on the host and hand it to the emitter as a record (the sender's thread)."""
        try:
            step, scalars, layers, fingerprints = unpack_step(packed)
            if scalars.get(FIRST_BAD, 0.0) < 0:  # a clean step: nothing to place
                del scalars[FIRST_BAD]
            self._names(scalars)  # act_max_module's layer; the name lists to the emitter when they grew
            self.emitter.emit(step, layers=layers, fingerprints=fingerprints, **scalars)
        except Exception as exc:
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        """Count a failure of a probe (warned once; never raised into the training loop)."""
        self.errors += 1
        if self.errors == 1:
            warnings.warn(
                f"sdcwatch probes: record dropped ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=3
            )

    def checkpoint(self, step: int, path: Any = "") -> None:
        """The emitter's :meth:`~sdcwatch.telemetry.wire.emitter.Emitter.checkpoint`; never raises."""
        note = getattr(self.emitter, "checkpoint", None)  # a stand-in emitter may have none
        if note is not None:
            with contextlib.suppress(Exception):  # never into the training loop
                note(step, path)

    # -- lifecycle --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Emit every record packed so far, the last step's included, and wait until they are."""
        self.sender.flush()

    def close(self) -> None:
        """Emit the pending record and remove the hooks this watch registered (the emitter stays open)."""
        if self.closed:
            return
        self.closed = True
        self.sender.close()
        remove_hooks(self._handles)
        self._activations.remove()
        self.sampled_checks.remove()
        if self._sharded is not None:
            self._sharded.remove()
        LIVE_WATCHES.discard(self)
        if self._tap is not None:
            self._tap.close()
        self.attention.remove()

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _rank_coords(model: nn.Module, emitter: Any, mesh: Any, names: Any) -> dict[str, int]:
    """This rank's coordinates in ``mesh`` (none without one), handed to the emitter too."""
    if mesh is None:
        return {}
    coords = coords_from_mesh(mesh, names, sharded=is_sharded(model))
    set_coords = getattr(emitter, "set_coords", None)  # the Emitter's; a stand-in may have none
    if set_coords is not None:
        set_coords(coords)
    return coords


def canary_product(canary: GemmCanary, step: int) -> dict[str, float]:
    """``{CANARY_PRODUCT: index}`` of the product ``canary`` checks at ``step``; empty without one."""
    k = canary.index_at(step)
    return {} if k is None else {CANARY_PRODUCT: float(k)}


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
    environment: RankEnvironment | None = None,
    **settings: Any,
) -> Watch:
    """Attach probes to ``model`` (and its optimizer, and its DDP wrapper) reporting to ``emitter``.

    ``settings`` are :class:`ProbeConfig` fields (an unknown one is a ConfigError); a
    ``DistributedDataParallel`` passed as ``model`` is its own ``ddp``; attach after FSDP2's
    ``fully_shard``. ``mesh`` (the job's ``DeviceMesh``; ``mesh_names`` maps other dim names, e.g.
    ``{"model": "tp"}``) puts this rank's coordinates on every record. docs/probes.md has the rest.
    """
    built = ProbeConfig.from_settings(every=every, **settings)  # an unknown setting is a ConfigError
    config = built if config is None else config
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: hooks go on the module it compiles
    if ddp is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        ddp = model  # attach(DDP(model), ...): the wrapper is the DDP hook's, as if ddp= were given
    if ddp is not None and model is ddp:
        model = getattr(ddp.module, "_orig_mod", ddp.module)  # DDP(torch.compile(model)) as nanoGPT wraps it
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
        environment=environment or RankEnvironment.read(),
    )
