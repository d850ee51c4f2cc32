"""sdcwatch in the training frameworks people use: one callback each, a few lines for the user.

    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback          # transformers.Trainer
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback   # lightning.Trainer

Each module imports its framework when it is imported, never before: install the extras
``sdcwatch[hf]`` or ``sdcwatch[lightning]``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CallbackCore"]


class CallbackCore:
    """What every framework callback does, whatever calls it: open the emitter, attach the probes
    (and the fault injector), bracket each optimizer step, close. A framework's callback derives
    from its framework's callback class and this, and only maps the framework's events onto
    :meth:`start`, :meth:`begin`, :meth:`end` and :meth:`close`.

    ``emitter``: where records go (default: an :class:`~sdcwatch.telemetry.Emitter` from the
    environment, with the framework's rank and world size, closed at the end of training).
    ``injector``: a :class:`~sdcwatch.telemetry.faults.FaultInjector` to test your alerting
    (attached to the model and stepped with the run; its rank is set to the framework's).
    ``settings``: :class:`~sdcwatch.telemetry.probes.ProbeConfig` fields (``attention_every=...``),
    and ``mesh=`` / ``mesh_names=`` (the job's torch ``DeviceMesh``: every record carries the rank's
    coordinates, as with :func:`~sdcwatch.telemetry.probes.attach`).
    """

    def __init__(self, emitter: Any = None, *, injector: Any = None, **settings: Any) -> None:
        from sdcwatch.telemetry.probes import ProbeConfig

        self.mesh = settings.pop("mesh", None)
        self.mesh_names = settings.pop("mesh_names", None)
        ProbeConfig.from_settings(**settings)  # a bad setting fails here, not when training has begun
        self.settings = settings
        self.injector = injector
        self.emitter = emitter
        self.watch: Any = None
        self.data_parallel = False
        """Whether the probes see the DDP all-reduce (local and global gradient norms)."""
        self._owns_emitter = False

    def start(self, model: Any, optimizer: Any, ddp: Any, rank: int, world: int) -> None:
        """Training begins: the emitter (built here unless one was given), the probes, the injector."""
        from sdcwatch.telemetry.probes import attach

        if self.emitter is None:
            from sdcwatch.telemetry.emitter import Emitter

            self.emitter, self._owns_emitter = Emitter(rank=rank, world=world), True
        self.data_parallel = ddp is not None
        if self.injector is not None:
            self.injector.rank = rank
            self.injector.attach(model, optimizer)
        self.watch = attach(
            model,
            self.emitter,
            optimizer=optimizer,
            ddp=ddp,
            mesh=self.mesh,
            mesh_names=self.mesh_names,
            **self.settings,
        )

    def begin(self, step: int) -> None:
        """An optimizer step begins (before its first micro-batch's forward)."""
        self.watch.begin_step(step)
        if self.injector is not None:
            self.injector.begin_step(step)

    def end(self, step: int, loss: Any, **scalars: Any) -> None:
        """Optimizer step ``step`` is done: its record, with the step's loss (a tensor: read later)
        and any scalar the framework knows better than the probes (``lr=``: the rate the step used)."""
        self.watch.step(step, loss=loss, **scalars)
        if self.injector is not None:
            self.injector.end_step()

    def close(self) -> None:
        """Emit the last record, remove the hooks, and close the emitter if the callback made it."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.injector is not None:
            self.injector.detach()
        if self._owns_emitter and self.emitter is not None:
            self.emitter.close()
            self._owns_emitter = False
