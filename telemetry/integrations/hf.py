"""sdcwatch for the Hugging Face ``transformers.Trainer``: one callback.

    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[SdcwatchCallback()])

The callback attaches the probes when training begins (to the Trainer's DDP wrapper too, so each
rank reports its local and the all-reduced gradient norm), reports one record per optimizer step
(``state.global_step``, from 0) and closes at the end. When the Trainer's accelerator built a
device mesh (``TrainingArguments(parallelism_config=...)``) every record carries the rank's
coordinates in it (unless the callback was given ``mesh=``). The loss of a step is the model output's
``loss``, over every micro-batch of the step: their mean, or their sum when the Trainer passes
``num_items_in_batch`` (then each micro-batch's loss is already a share of the step's). The
learning rate is the one the step used, read before the Trainer steps its scheduler.
"""

from __future__ import annotations

import sys
from typing import Any

from sdcwatch.telemetry.integrations import CallbackCore, FrameworkMesh
from transformers import TrainerCallback

__all__ = ["SdcwatchCallback", "ACCELERATE_DIMS", "framework_mesh"]


class SdcwatchCallback(TrainerCallback, CallbackCore):
    """Probes and emitter for a ``transformers.Trainer`` run; arguments as :class:`CallbackCore`'s
    (``emitter``, ``injector``, probe settings such as ``attention_every=8``).
    """

    def __init__(self, emitter: Any = None, *, injector: Any = None, **settings: Any) -> None:
        CallbackCore.__init__(self, emitter, injector=injector, **settings)
        self._losses: list[Any] = []
        self._summed = False
        self._loss_hook = None
        self._lr: float | None = None  # the rate of the optimizer step in progress

    # -- the run ------------------------------------------------------------------------------

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        trainer = _calling_trainer(model)
        self.start(
            model, _inner_optimizer(optimizer), _ddp_wrapper(trainer), rank, world, framework_mesh(trainer, model)
        )
        self._loss_hook = model.register_forward_hook(self._keep_loss, with_kwargs=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is None:
            return
        self._losses.clear()
        self.begin(state.global_step)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the Trainer steps its scheduler before on_step_end: the rate this step used is read here
        opt = self.watch.optimizer if self.watch is not None else None
        self._lr = float(opt.param_groups[0]["lr"]) if opt is not None and opt.param_groups else None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watch is None:
            return
        lr, self._lr = self._lr, None
        self.end(state.global_step - 1, self._step_loss(), **({} if lr is None else {"lr": lr}))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Emit the last record, remove the hooks, and close the emitter if the callback made it."""
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        CallbackCore.close(self)

    # -- the loss -----------------------------------------------------------------------------
    def _keep_loss(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is not None and module.training:
            self._losses.append(loss.detach())
            self._summed = kwargs.get("num_items_in_batch") is not None

    def _step_loss(self) -> Any:
        if not self._losses:
            return None
        total = self._losses[0] if len(self._losses) == 1 else sum(self._losses[1:], self._losses[0])
        return total if self._summed or len(self._losses) == 1 else total / len(self._losses)


def _calling_trainer(model: Any) -> Any:
    """The Trainer that is calling us about ``model`` (callbacks are given the bare model, not the
    Trainer): found on the call stack. None if there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if getattr(owner, "model_wrapped", None) is not None and getattr(owner, "model", None) is model:
            return owner
        frame = frame.f_back
    return None


def _ddp_wrapper(trainer: Any) -> Any:
    """The Trainer's DDP wrapper of its model; None when the run is not data-parallel."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = getattr(trainer, "model_wrapped", None)
    return wrapped if isinstance(wrapped, DistributedDataParallel) else None


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


def _inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's wrapper (its step hooks are the ones that run)."""
    return getattr(optimizer, "optimizer", optimizer)
