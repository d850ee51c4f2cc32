"""The gradient part of a watch: per-step gradient statistics, however the job reduces gradients,
written into the watch's :class:`StepBuffer` (the step's device values, which the watch packs).
(docs/probes.md, "How the probes are built", says how and why.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from sdcwatch.telemetry.probes import fingerprint as fp

if TYPE_CHECKING:
    from sdcwatch.telemetry.probes.watch import Watch

__all__ = ["StepBuffer", "GradientStats", "unless_closure"]


@dataclass
class StepBuffer:
    """One step's values as the watch's parts measure them, cleared at each step's end: device
    scalars, host scalars, raw fingerprints, extra non-finite counts, folded attention statistics
    per layer, the DDP hook's buckets, and whether the gradient was read."""

    scalars: dict[str, torch.Tensor] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    fps: dict[str, torch.Tensor] = field(default_factory=dict)
    nonfinite: list[torch.Tensor] = field(default_factory=list)
    attention: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    buckets: list[tuple] = field(default_factory=list)
    grads_seen: bool = False
    backward_queued: bool = False
    """A backward queued its end-of-backward read (one that failed never ran it)."""

    def clear(self) -> None:
        self.scalars, self.host, self.fps, self.nonfinite = {}, {}, {}, []
        self.attention, self.buckets = {}, []
        self.grads_seen = self.backward_queued = False


class GradientStats:
    """Gradient statistics of one watch's step (see the module docstring), into ``buffer``.

    ``reduced_elsewhere``: the gradients are reduced by DDP or measured outside the watch (no read
    of ``p.grad``); ``sharded``: FSDP2 measures them (torch computes the norm for clipping)."""

    def __init__(
        self,
        watch: "Watch",
        buffer: StepBuffer,
        params: list[torch.Tensor],
        *,
        group: Any = None,
        reduced_elsewhere: bool = False,
        sharded: bool = False,
    ) -> None:
        self.watch = watch
        self.buffer = buffer
        self.params = params
        self.group = group
        """The DDP process group the communication hook all-reduces over (None: the world)."""
        self.reduced_elsewhere = reduced_elsewhere
        self.sharded = sharded

    @property
    def measuring(self) -> bool:
        """Whether the step in progress is recorded (and the watch enabled)."""
        return self.watch.enabled and self.watch.recording

    @property
    def fingerprint_due(self) -> bool:
        """Whether the step in progress fingerprints the gradient."""
        return self.watch.config.grad_fingerprint and self.watch.fingerprint_due

    def observe_gradients(
        self,
        *,
        local_sq: torch.Tensor,
        global_sq: torch.Tensor,
        dot: torch.Tensor,
        nonfinite: torch.Tensor | None = None,
        grad_fp: torch.Tensor | None = None,
    ) -> None:
        """Gradient statistics computed elsewhere (the DDP hook, the simulated all-reduce): sums of
        squares and the dot product of the local with the global gradient, on the device.
        ``nonfinite`` is an extra count of non-finite values seen there (added to the record's own)."""
        buf = self.buffer
        buf.scalars["grad_norm_local"] = local_sq.sqrt()
        buf.scalars["grad_norm_global"] = global_sq.sqrt()
        buf.scalars["grad_cosine"] = dot / (local_sq.sqrt() * global_sq.sqrt()).clamp_min(1e-30)
        if nonfinite is not None:
            buf.nonfinite.append(nonfinite)
        if grad_fp is not None:
            buf.fps["grad_fp"] = grad_fp
        buf.grads_seen = True

    def hook_backward(self) -> list[Any]:
        """World size one: read ``p.grad`` once each backward has finished accumulating it, before any
        clipping (docs/integrations.md says why there). Returns the hooks' handles."""
        return [p.register_post_accumulate_grad_hook(self._grad_accumulated) for p in self.params if p.requires_grad]

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        # compiled autograd traces the hooks (and queues a callback only under fullgraph): there
        # the read falls back to optimizer.step()
        if self.buffer.backward_queued or torch.compiler.is_compiling() or not self.measuring:
            return
        try:  # torch's own DDP and FSDP end their backward work this way
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self.buffer.backward_queued = True
        except Exception as exc:  # the read falls back to optimizer.step() / watch.step()
            self.watch.fail(exc)

    def _backward_done(self) -> None:
        self.buffer.backward_queued = False
        try:
            with torch.no_grad():
                self.read_world1([p.grad for p in self.params if p.grad is not None])
        except Exception as exc:  # raised here, it would fail the user's backward
            self.watch.fail(exc)

    def local_gradients(self) -> None:
        """World-size-1 gradient statistics from ``p.grad`` where no backward read them (gradients
        set by hand): just before ``optimizer.step()``, else at ``watch.step()``."""
        if self.measuring and not self.buffer.grads_seen:
            self.read_world1([p.grad for p in self.params if p.grad is not None])

    def read_world1(self, grads: list[torch.Tensor]) -> None:
        """The norm (and, when due, the fingerprint) of ``grads``, the whole gradient of one replica:
        local is global, no all-reduce. One fused norm over all the tensors (a NaN or Inf anywhere
        makes it non-finite, which the record's ``nonfinite`` count then shows)."""
        if not grads:
            return
        buf = self.buffer
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        buf.scalars["grad_norm_local"] = norm
        buf.scalars["grad_norm_global"] = norm
        buf.host["grad_cosine"] = 1.0  # one replica: the local gradient is the global one
        buf.grads_seen = True
        if self.fingerprint_due:
            buf.fps["grad_fp"] = fp.flat_fingerprint_device(grads)

    def clip_grad_norm_(
        self, max_norm: float, *, parameters: Any = None, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the model's gradients (or ``parameters``'), bit for
        bit, once the watch read the step's gradient; returns torch's total norm. Its own pass over
        the gradients, not the watch's norm (docs/integrations.md says why)."""
        if not self.buffer.grads_seen and self.measuring and not self.reduced_elsewhere and not self.sharded:
            self.local_gradients()  # the end-of-backward read did not run (compiled autograd, say)
        params = self.params if parameters is None else parameters
        return torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def reduce_buckets(self) -> None:
        """Fold the DDP hook's buckets into the step's gradient statistics."""
        buckets = sorted(self.buffer.buckets, key=lambda b: b[0])
        local_sq = torch.stack([b[1] for b in buckets]).sum()
        dot = torch.stack([b[2] for b in buckets]).sum()
        global_sq = torch.stack([b[3] for b in buckets]).sum()
        parts = [b[4] for b in buckets if b[4] is not None]
        grad_fp = fp.combine_parts(parts) if parts and len(parts) == len(buckets) else None
        self.observe_gradients(local_sq=local_sq, global_sq=global_sq, dot=dot, grad_fp=grad_fp)


def unless_closure(read: Callable[[], None]) -> Callable[[Any, tuple, dict], None]:
    """An optimizer step pre-hook that reads the gradient, except for ``optimizer.step(closure)``
    (Lightning's automatic optimisation, LBFGS): the closure runs this step's forward and backward
    after the pre-hooks, so ``p.grad`` still holds the previous step's gradient there; the watch
    reads it at ``watch.step()`` instead."""

    def hook(optimizer: Any, args: tuple, kwargs: dict) -> None:
        # torch hands the pre-hook step's positional arguments with the optimizer first
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:
            read()

    return hook
