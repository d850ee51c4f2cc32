"""sdcwatch for PyTorch Lightning: one callback, ``L.Trainer(..., callbacks=[SdcwatchCallback()])``;
docs/integrations.md says what each record's loss and gradient norm are, and how the device mesh of
``ModelParallelStrategy`` is read.
"""

from __future__ import annotations

import contextlib
import os
import inspect
from typing import Any

import lightning.pytorch as pl
from sdcwatch.telemetry.integrations import CallbackCore, FrameworkMesh

__all__ = ["SdcwatchCallback", "LIGHTNING_DIMS", "strategy_mesh"]


class SdcwatchCallback(pl.Callback, CallbackCore):
    """Probes and emitter for a ``lightning.Trainer`` run; arguments as :class:`CallbackCore`'s
    (``emitter``, ``injector``, probe settings).

    ``guard``: a :class:`~sdcwatch.telemetry.guard.config.GuardConfig` to guard each optimizer step
    (automatic optimization; docs/guard.md): judged at ``on_before_optimizer_step``, before Lightning
    clips; a rerun runs the step's micro-batches through the strategy's ``training_step`` and
    ``backward`` again; a step not applied leaves no gradient, so the optimizer step changes nothing,
    and the learning-rate schedulers are put back after Lightning stepped them.
    ``control``: the guard's decision reader (:class:`CallbackCore`).
    """

    def __init__(
        self, emitter: Any = None, *, injector: Any = None, guard: Any = None, control: Any = None, **settings: Any
    ) -> None:
        CallbackCore.__init__(self, emitter, injector=injector, guard=guard, control=control, **settings)
        self._loss: Any = None
        self._closing: int | None = None  # the step whose optimizer step just ran
        self._in_forward = False

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        wrapped = getattr(trainer.strategy, "model", None)
        self.start(pl_module, optimizer, wrapped, trainer.global_rank, trainer.world_size, strategy_mesh(trainer))

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self.watch is None:
            return
        if self._loss is None:  # the first micro-batch of an optimizer step
            self.begin(trainer.global_step)
        if self.guard is not None:
            self._micro.append((batch, batch_idx))
        self.watch.begin_forward()
        self._in_forward = True

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Any) -> None:
        if self.watch is None:
            return
        self._end_forward()
        loss = loss.detach()
        self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        self._closing = trainer.global_step
        if self.guard is None or self.watch is None:
            return
        micro, step, strategy = list(self._micro), trainer.global_step, trainer.strategy

        def rerun() -> Any:  # the step's micro-batches again (the guard zeroed the gradients)
            if self.injector is not None:
                self.injector.begin_step(step)  # the injector's rerun: a transient fault stays away
            self._loss = None  # on_before_backward sums the rerun's losses
            for i, (batch, batch_idx) in enumerate(micro):  # DDP all-reduces after the last one only
                blocks = i < len(micro) - 1 and hasattr(strategy, "block_backward_sync")
                with strategy.block_backward_sync() if blocks else contextlib.nullcontext():
                    out = strategy.training_step(batch, batch_idx)
                    loss = out["loss"] if isinstance(out, dict) else out
                    strategy.backward(loss / trainer.accumulate_grad_batches, optimizer)
            return self._loss

        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self.guard_step(step, rerun, self._loss, schedulers)

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.watch is None:
            return
        self._end_forward()  # a step without backward (training_step returned None)
        if self._closing is None:
            return
        self.end(self._closing, self._loss)
        self._closing, self._loss = None, None

    def on_save_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]
    ) -> None:
        """Lightning is saving a checkpoint after ``trainer.global_step`` optimizer steps: it holds the
        updates up to step ``global_step - 1`` (the last record's), which the note names, with the
        file ``Trainer.save_checkpoint`` writes when it is on the call stack ("" otherwise)."""
        if self.watch is not None and trainer.global_step > 0:
            self.watch.checkpoint(trainer.global_step - 1, _saving_to())

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.close()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Emit the last record, remove the hooks, and close the emitter if the callback made it."""
        self._end_forward()
        CallbackCore.close(self)

    def _end_forward(self) -> None:
        if self._in_forward and self.watch is not None:
            self.watch.end_forward()
        self._in_forward = False


def _saving_to() -> str:
    """The ``filepath`` of the ``Trainer.save_checkpoint`` call that is saving now (Lightning does not
    hand it to the callbacks), found on the call stack; "" if there is none."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        path = frame.f_locals.get("filepath") if frame.f_code.co_name == "save_checkpoint" else None
        if isinstance(path, (str, os.PathLike)):
            return os.fspath(path)
        frame = frame.f_back
    return ""


#: What the dims of ``ModelParallelStrategy``'s mesh are: ``data_parallel`` holds FSDP2 shards when
#: ``configure_model`` applies ``fully_shard`` (as the strategy expects), replicas otherwise.
LIGHTNING_DIMS = {"data_parallel": "dp", "tensor_parallel": "tp"}


def strategy_mesh(trainer: "pl.Trainer") -> FrameworkMesh | None:
    """The strategy's device mesh (``ModelParallelStrategy.device_mesh``, set up before training
    starts), or None for a strategy without one."""
    try:
        mesh = getattr(trainer.strategy, "device_mesh", None)
    except RuntimeError:  # accessed before the processes were initialised
        return None
    if mesh is None or not hasattr(mesh, "get_coordinate"):
        return None
    return FrameworkMesh(mesh, LIGHTNING_DIMS, f"trainer.strategy.device_mesh ({type(trainer.strategy).__name__})")
