"""The gradient half of a watch: per-step gradient statistics, however the job reduces gradients.

Three sources hand them in, all on the device as 0-d tensors (nothing here syncs):

- under DDP the communication hook (:mod:`~sdcwatch.telemetry.probes.ddp_hook`) sees each bucket before
  and after the all-reduce; :meth:`GradientStats._reduce_buckets` folds the buckets into the
  local and global norms, their cosine and the all-reduced gradient's fingerprint;
- under FSDP2 the reduce-scatter hooks (:mod:`~sdcwatch.telemetry.probes.fsdp`), and in simulations the
  simulated all-reduce, call :meth:`GradientStats.observe_gradients` with the same sums;
- with neither (world size one) :meth:`GradientStats._watch_backward` reads ``p.grad`` when each
  backward has finished accumulating it, before any clipping, as the DDP hook does (local is
  global); :meth:`GradientStats._local_gradients` reads it just before ``optimizer.step()`` or at
  ``watch.step()`` when no backward was seen (gradients set by hand).

:class:`~sdcwatch.telemetry.probes.watch.Watch` mixes this in; it owns the state used here (the step's
``_scalars``, ``_fps``, ``_nonfinite``, ``_buckets``...).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from sdcwatch.telemetry.probes import fingerprint as fp

__all__ = ["GradientStats", "unless_closure"]


class GradientStats:
    """Gradient statistics of one watch's step (see the module docstring)."""

    _scalars: dict[str, Any]
    _host_scalars: dict[str, float]
    _fps: dict[str, Any]
    _nonfinite: list[Any]
    _buckets: list[Any]
    _grads_seen: bool
    _params: list[Any]
    enabled: bool
    recording: bool
    config: Any
    _fingerprint_step: bool
    _backward_queued: bool = False
    _fail: Callable[[Exception], None]

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
        self._scalars["grad_norm_local"] = local_sq.sqrt()
        self._scalars["grad_norm_global"] = global_sq.sqrt()
        self._scalars["grad_cosine"] = dot / (local_sq.sqrt() * global_sq.sqrt()).clamp_min(1e-30)
        if nonfinite is not None:
            self._nonfinite.append(nonfinite)
        if grad_fp is not None:
            self._fps["grad_fp"] = grad_fp
        self._grads_seen = True

    def observe_fingerprint(self, name: str, raw: torch.Tensor) -> None:
        """A raw device fingerprint (see :mod:`sdcwatch.telemetry.probes.fingerprint`) computed elsewhere."""
        self._fps[name] = raw

    def _watch_backward(self) -> list[Any]:
        """World size one: read the gradient each time a backward has finished accumulating it.

        A post-accumulate-grad hook on every trainable parameter queues, once per backward, a
        callback that autograd runs when that backward is over: all of ``p.grad`` is read there, as
        the optimizer will see it, but before any clipping (``clip_grad_norm_``, the Hugging Face
        Trainer's and Lightning's clipping run after the backward). Under gradient accumulation the
        last backward of the step wins: the accumulated gradient. Returns the hooks' handles.
        """
        return [p.register_post_accumulate_grad_hook(self._grad_accumulated) for p in self._params if p.requires_grad]

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        # compiled autograd traces the hooks (and queues a callback only under fullgraph): there
        # the read falls back to optimizer.step()
        if self._backward_queued or torch.compiler.is_compiling() or not (self.enabled and self.recording):
            return
        try:  # torch's own DDP and FSDP end their backward work this way
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self._backward_queued = True
        except Exception as exc:  # the read falls back to optimizer.step() / watch.step()
            self._fail(exc)

    def _backward_done(self) -> None:
        self._backward_queued = False
        try:
            with torch.no_grad():
                self._read_local_gradients()
        except Exception as exc:  # raised here, it would fail the user's backward
            self._fail(exc)

    def _local_gradients(self) -> None:
        """World-size-1 gradient statistics from ``p.grad`` where no backward read them (gradients
        set by hand): just before ``optimizer.step()``, else at ``watch.step()``."""
        if not (self.enabled and self.recording) or self._grads_seen:
            return
        self._read_local_gradients()

    def _read_local_gradients(self) -> None:
        """One fused norm over all gradient tensors (no all-reduce: local is global; a NaN or Inf
        anywhere makes it non-finite, which the record's ``nonfinite`` count then shows)."""
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

    def clip_grad_norm_(
        self, max_norm: float, *, parameters: Any = None, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the model's gradients (or ``parameters``'), reusing
        the norm the watch measured this step: one pass over the gradients for the record and the
        clipping instead of two (on a billion parameters that pass is about 1% of a GPU step).

        Call it where the loop clips, after the backward and before ``optimizer.step()``; it returns
        the total norm, as torch's does. The norm is reused when the watch read it this step, from
        the gradients the clipping sees: the model's own parameters, world size one or DDP. Otherwise
        (FSDP2, another parameter list, a step not recorded) torch computes it, as without sdcwatch.
        """
        params = list(self._params if parameters is None else _as_list(parameters))
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        if not self._grads_seen and self._buckets:  # DDP: every bucket was all-reduced in the backward
            self._reduce_buckets()
        elif not self._grads_seen and self.enabled and self.recording and not self._ddp_like():
            self._local_gradients()  # the end-of-backward read did not run (compiled autograd, say)
        norm = self._scalars.get("grad_norm_global") if self._grads_seen else None
        same = parameters is None or {id(p) for p in params} == {id(p) for p in self._params}
        if norm is None or not same or getattr(self, "_sharded", None) is not None:
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, error_if_nonfinite=error_if_nonfinite, foreach=foreach
            )
        if error_if_nonfinite and bool(torch.logical_or(norm.isnan(), norm.isinf())):  # torch's check: a sync
            raise RuntimeError(
                "The total norm of gradients is non-finite, so it cannot be clipped "
                "(error_if_nonfinite=True, as torch.nn.utils.clip_grad_norm_ says)"
            )
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=foreach)
        return norm

    def _ddp_like(self) -> bool:
        return bool(getattr(self, "_ddp", False) or getattr(self, "_external", False))

    def _reduce_buckets(self) -> None:
        buckets = sorted(self._buckets, key=lambda b: b[0])
        local_sq = torch.stack([b[1] for b in buckets]).sum()
        dot = torch.stack([b[2] for b in buckets]).sum()
        global_sq = torch.stack([b[3] for b in buckets]).sum()
        parts = [b[4] for b in buckets if b[4] is not None]
        grad_fp = fp.combine_parts(parts) if parts and len(parts) == len(buckets) else None
        self.observe_gradients(local_sq=local_sq, global_sq=global_sq, dot=dot, grad_fp=grad_fp)


def _as_list(parameters: Any) -> list[Any]:
    """``parameters`` as torch's clipping takes them: one tensor or an iterable of tensors."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


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
