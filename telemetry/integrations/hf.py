"""sdcwatch for the Hugging Face ``transformers.Trainer``: one callback,
``Trainer(..., callbacks=[SdcwatchCallback()])``; docs/integrations.md says what each record's loss,
gradient norm and learning rate are, and where the device mesh comes from.
"""

from __future__ import annotations

import contextlib
import functools
import os
import inspect
from typing import Any, Callable

from sdcwatch.telemetry.integrations import CallbackCore, FrameworkMesh, log
from transformers import TrainerCallback

__all__ = ["SdcwatchCallback", "ACCELERATE_DIMS", "framework_mesh"]


class SdcwatchCallback(TrainerCallback, CallbackCore):
    """Probes and emitter for a ``transformers.Trainer`` run; arguments as :class:`CallbackCore`'s
    (``emitter``, ``injector``, probe settings such as ``attention_every=8``).

    ``guard``: a :class:`~sdcwatch.telemetry.guard.config.GuardConfig` to guard each optimizer step
    (docs/guard.md): judged before the Trainer's ``optimizer.step()`` on the gradient norm before its
    clipping (what its ``accelerator.clip_grad_norm_`` returns); a rerun runs the step's micro-batches
    through ``training_step`` again and clips as the Trainer does; a step not applied leaves no
    gradient, so the Trainer's optimizer step changes nothing, and its scheduler is put back.
    ``control``: the guard's decision reader (:class:`CallbackCore`).
    """

    def __init__(
        self, emitter: Any = None, *, injector: Any = None, guard: Any = None, control: Any = None, **settings: Any
    ) -> None:
        CallbackCore.__init__(self, emitter, injector=injector, guard=guard, control=control, **settings)
        self._step_fn: Any = None  # the Trainer's training_step, unwrapped
        self._losses: list[Any] = []  # what training_step returned, one per micro-batch of the step
        self._trainer: Any = None  # whose training_step the callback wraps
        self._replaced: Any = None  # a training_step the user had set on that Trainer, put back at the end
        self._lr: float | None = None  # the rate of the optimizer step in progress
        self._norm: Any = None  # the step's gradient norm before the Trainer clipped it

    # -- the run ------------------------------------------------------------------------------

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        trainer = _calling_trainer(model)
        inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer in accelerate's: its hooks run
        wrapped = getattr(trainer, "model_wrapped", None)
        self.start(model, inner, wrapped, rank, world, framework_mesh(trainer, model))
        if trainer is None:
            log.warning("sdcwatch: the Trainer calling the callback was not found: records carry no loss")
        else:
            self._trainer, self._replaced = trainer, vars(trainer).get("training_step")
            trainer.training_step = self._keeping_loss(trainer.training_step)
            if self.guard is not None:
                trainer.accelerator.clip_grad_norm_ = self._keeping_norm(trainer.accelerator.clip_grad_norm_)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is None:
            return
        self._losses.clear()
        self._norm = None
        self.begin(state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is None or self.watch is None or self._trainer is None:
            return
        micro, trainer, step = list(self._micro), self._trainer, state.global_step

        def rerun() -> Any:  # the step's micro-batches again (the guard zeroed the gradients)
            if self.injector is not None:
                self.injector.begin_step(step)  # the injector's rerun: a transient fault stays away
            self._losses.clear()
            self._norm = None
            for i, (a, kw) in enumerate(micro):  # DDP all-reduces after the last one only, as the Trainer's
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else trainer.accelerator.no_sync(model=a[0]):
                    self._losses.append(self._step_fn(*a, **kw).detach())
            if args.max_grad_norm > 0:
                trainer.accelerator.clip_grad_norm_(self.watch.model.parameters(), args.max_grad_norm)
            return self._judged()

        self.guard_step(step, rerun, self._judged(), [trainer.lr_scheduler] if trainer.lr_scheduler else [])

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the Trainer steps its scheduler before on_step_end: the rate this step used is read here
        opt = self.watch.optimizer if self.watch is not None else None
        self._lr = float(opt.param_groups[0]["lr"]) if opt is not None and opt.param_groups else None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is None:
            return
        lr, self._lr = self._lr, None
        self.end(state.global_step - 1, self._step_loss(), **({} if lr is None else {"lr": lr}))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer saved ``checkpoint-<global_step>`` under ``output_dir``: it holds the updates of
        steps up to ``global_step - 1`` (the step of the last record), which the note names."""
        if self.watch is not None and state.global_step > 0:
            path = os.path.join(args.output_dir or "", f"checkpoint-{state.global_step}")
            self.watch.checkpoint(state.global_step - 1, path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Emit the last record, remove the hooks, and close the emitter if the callback made it."""
        trainer, self._trainer = self._trainer, None
        if trainer is not None and getattr(vars(trainer).get("training_step"), "sdcwatch_wrapped", False):
            if self._replaced is None:
                del trainer.training_step  # the Trainer's own method again
            else:
                trainer.training_step = self._replaced
        accelerator = getattr(trainer, "accelerator", None)
        if getattr(vars(accelerator).get("clip_grad_norm_") if accelerator else None, "sdcwatch_wrapped", False):
            del accelerator.clip_grad_norm_  # the accelerator's own method again
        CallbackCore.close(self)

    # -- the loss -----------------------------------------------------------------------------
    def _keeping_loss(self, training_step: Callable[..., Any]) -> Callable[..., Any]:
        """``training_step`` keeping what it returns: the micro-batch's loss as the Trainer adds it
        into the loss it logs (scaled by the world size under its token averaging, divided by the
        accumulation steps when not), detached, on the device."""

        self._step_fn = training_step

        @functools.wraps(training_step)
        def keeping_loss(*args: Any, **kwargs: Any) -> Any:
            loss = training_step(*args, **kwargs)
            if self.watch is not None and hasattr(loss, "detach"):
                self._losses.append(loss.detach())
                if self.guard is not None:
                    self._micro.append((args, kwargs))
            return loss

        keeping_loss.sdcwatch_wrapped = True  # type: ignore[attr-defined]
        return keeping_loss

    def _keeping_norm(self, clip_grad_norm_: Callable[..., Any]) -> Callable[..., Any]:
        """The accelerator's ``clip_grad_norm_`` keeping the norm it returns: the all-reduced gradient's
        before clipping, which the guard judges as in a loop of your own."""

        @functools.wraps(clip_grad_norm_)
        def keeping_norm(*args: Any, **kwargs: Any) -> Any:
            self._norm = clip_grad_norm_(*args, **kwargs)
            return self._norm

        keeping_norm.sdcwatch_wrapped = True  # type: ignore[attr-defined]
        return keeping_norm

    def _judged(self) -> Any:
        """What the guard judges: the step's loss, with its gradient norm before clipping when known."""
        return self._step_loss() if self._norm is None else (self._step_loss(), self._norm)

    def _step_loss(self) -> Any:
        """The step's loss as the Trainer sums it into ``tr_loss`` (None without a micro-batch)."""
        if not self._losses:
            return None
        return self._losses[0] if len(self._losses) == 1 else sum(self._losses[1:], self._losses[0])


def _calling_trainer(model: Any) -> Any:
    """The Trainer that is calling us about ``model`` (callbacks are given the bare model, not the
    Trainer): found on the call stack. None if there is none."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        owner = frame.f_locals.get("self")
        if getattr(owner, "model_wrapped", None) is not None and getattr(owner, "model", None) is model:
            return owner
        frame = frame.f_back
    return None


#: accelerate's ``sp`` (sequence parallel, DeepSpeed Ulysses) splits each sequence over ranks that
#: hold the same model, as context parallelism does; its other dims are sdcwatch's own names
ACCELERATE_DIMS = {"sp": "cp"}


def framework_mesh(trainer: Any, model: Any) -> FrameworkMesh | None:
    """The job's device mesh as the Trainer's stack built it: accelerate's (``ParallelismConfig``,
    ``accelerator.torch_device_mesh``: dims ``dp_replicate, dp_shard, cp, sp, tp``), else the one a
    model loaded with a ``distributed_config`` keeps (``model._device_mesh``: ``pp, fsdp, tp``)."""
    accelerator = getattr(trainer, "accelerator", None)
    try:
        mesh = getattr(accelerator, "torch_device_mesh", None)
    except Exception:  # an accelerator state without a mesh
        mesh = None
    if mesh is not None:
        return FrameworkMesh(mesh, ACCELERATE_DIMS, "trainer.accelerator.torch_device_mesh")
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None and hasattr(mesh, "get_coordinate"):
        return FrameworkMesh(mesh, None, "model._device_mesh (transformers distributed_config)")
    return None
