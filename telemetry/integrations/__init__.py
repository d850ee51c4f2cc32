"""What the training frameworks' callbacks share (``integrations.hf``: transformers.Trainer,
``integrations.lightning``: lightning.Trainer); each imports its framework when it is imported."""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.mesh import format_coords
from sdcwatch.core.validate import check_type
from sdcwatch.telemetry.guard.config import GuardConfig
from sdcwatch.telemetry.guard.guard import Guard

__all__ = ["CallbackCore", "FrameworkMesh"]

log = logging.getLogger("sdcwatch.telemetry")


class FrameworkMesh(NamedTuple):
    """A device mesh a framework built for the job, found by its callback when the user passed none."""

    mesh: Any
    """The torch ``DeviceMesh``."""
    names: Mapping[str, str] | None
    """What the framework's dim names mean, where they are not sdcwatch's (``{"tensor_parallel": "tp"}``)."""
    where: str
    """Where it was found, for the log line (``trainer.strategy.device_mesh``)."""


class CallbackCore:
    """What every framework callback does, whatever calls it: open the emitter, attach the probes
    (and the fault injector), bracket each optimizer step, close. A framework's callback derives
    from its framework's callback class and this, and only maps the framework's events onto
    :meth:`start`, :meth:`begin`, :meth:`end` and :meth:`close`.

    ``emitter``: where records go (default: an :class:`~sdcwatch.telemetry.Emitter` from the
    environment, with the framework's rank and world size, closed at the end of training).
    ``injector``: a :class:`~sdcwatch.testbed.faults.FaultInjector` to test your alerting
    (attached to the model and stepped with the run; its rank is set to the framework's).
    ``settings``: :class:`~sdcwatch.telemetry.probes.watch.ProbeConfig` fields (``attention_every=...``),
    and ``mesh=`` / ``mesh_names=`` (the job's torch ``DeviceMesh``: every record carries the rank's
    coordinates, as with :func:`~sdcwatch.telemetry.probes.watch.attach`). Without ``mesh=`` the callback
    uses the mesh its framework built, if any (Lightning's ``ModelParallelStrategy``, accelerate's
    ``ParallelismConfig``), and logs which dims it found; ``mesh=False`` turns that off.
    ``guard``: a :class:`~sdcwatch.telemetry.guard.config.GuardConfig`: the framework's optimizer steps
    guarded (``self.guard``, built when training begins; each framework's callback reruns its step).
    ``control``: the guard's decision reader (a :class:`~sdcwatch.telemetry.guard.control_topic.KafkaControl`
    on rank 0): the service's decisions (skip, rollback, evict) acted on as in a loop of your own.
    """

    def __init__(
        self, emitter: Any = None, *, injector: Any = None, guard: Any = None, control: Any = None, **settings: Any
    ) -> None:
        from sdcwatch.telemetry.probes.config import ProbeConfig

        self.mesh = settings.pop("mesh", None)
        self.mesh_names = settings.pop("mesh_names", None)
        ProbeConfig.from_settings(**settings)  # a bad setting fails here, not when training has begun
        self.settings = settings
        self.guard_config = None if guard is None else check_type("callback.guard", guard, GuardConfig)
        if control is not None and guard is None:  # the decisions are the guard's to act on
            raise ConfigError("callback.control", "needs guard= (a GuardConfig): the guard acts on the decisions")
        self.guard: Any = None
        self.control = control
        self.outcome: Any = None  # the guard's outcome of the step in progress
        self._held: Any = None  # (schedulers, their states, the optimizer's hyperparameters) before a step not applied
        self._scaled: list[float] = []  # the rates the guard's update set (a cut in force), for the framework's step
        self._uncut: list[float] = []  # the scheduler's rates, put back after the framework's optimizer step
        self._hooks: list[Any] = []  # the one-step optimizer hook that puts them back
        self._micro: list[Any] = []  # what the step's micro-batches were called with, for the guard's rerun
        self.injector = injector
        self.emitter = emitter
        self.watch: Any = None
        self.mesh_found: FrameworkMesh | None = None
        """The framework's mesh the probes use (None: the user's ``mesh=``, or none was found)."""
        self.data_parallel = False
        """Whether the probes see the DDP all-reduce (local and global gradient norms)."""
        self._owns_emitter = False

    def start(
        self, model: Any, optimizer: Any, wrapped: Any, rank: int, world: int, found: FrameworkMesh | None = None
    ) -> None:
        """Training begins: the emitter (built here unless one was given), the probes, the injector.
        ``wrapped``: the framework's wrapper of the model (a DDP one: the probes measure its all-reduce);
        ``found``: the framework's device mesh, used when the user passed no ``mesh=``."""
        from sdcwatch.telemetry.probes.watch import attach
        from torch.nn.parallel import DistributedDataParallel

        ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        if self.emitter is None:
            from sdcwatch.telemetry.wire.emitter import Emitter

            self.emitter, self._owns_emitter = Emitter(rank=rank, world=world), True
        self.data_parallel = ddp is not None
        if self.injector is not None:
            self.injector.rank = rank
            self.injector.attach(model, optimizer)
        mesh, names = (None, None) if self.mesh is False else (self.mesh, self.mesh_names)
        if self.mesh is None and found is not None:
            mesh, names = self._framework_mesh(model, found)
        self.watch = attach(
            model, self.emitter, optimizer=optimizer, ddp=ddp, mesh=mesh, mesh_names=names, **self.settings
        )
        if self.guard_config is not None:
            self.guard = Guard(model, optimizer, self.guard_config, control=self.control, watch=self.watch)

    def _framework_mesh(self, model: Any, found: FrameworkMesh) -> tuple[Any, Any]:
        """(mesh, names) for the probes from the framework's mesh, and one log line saying which dims
        were found and what this rank's coordinates are; a mesh whose dims cannot be read is logged
        as a warning and not used (training goes on without coordinates)."""
        from sdcwatch.telemetry.probes.fsdp import is_sharded
        from sdcwatch.telemetry.probes.mesh_torch import coords_from_mesh

        names = {**(found.names or {}), **(self.mesh_names or {})}  # the user's names win
        mesh_dims = getattr(found.mesh, "mesh_dim_names", None)
        names = {k: v for k, v in names.items() if mesh_dims and k in mesh_dims}
        dims = ", ".join(f"{n}={s}" for n, s in zip(mesh_dims or (), getattr(found.mesh, "shape", ())))
        try:
            coords = coords_from_mesh(found.mesh, names or None, sharded=is_sharded(model))
        except ConfigError as exc:
            log.warning(
                "sdcwatch: found a device mesh at %s (%s) but cannot read it: %s; records carry no "
                "coordinates (pass mesh= and mesh_names= to the callback)",
                found.where,
                dims,
                exc,
            )
            return None, None
        self.mesh_found = found
        log.info(
            "sdcwatch: using the device mesh at %s: dims (%s); this rank is at %s",
            found.where,
            dims,
            format_coords(coords),
        )
        return found.mesh, names or None

    def begin(self, step: int) -> None:
        """An optimizer step begins (before its first micro-batch's forward)."""
        self._micro.clear()
        self.outcome = None
        self.watch.begin_step(step)
        if self.injector is not None:
            self.injector.begin_step(step)

    def guard_step(self, step: int, rerun: Callable[[], Any], first: Any, schedulers: Iterable[Any]) -> None:
        """Judge ``step`` just before the framework's optimizer step: ``first`` is what its pass gave,
        ``rerun()`` runs the step again. Not applied: the gradients are cleared (the framework's step
        changes nothing) and the learning-rate ``schedulers`` and the optimizer's hyperparameters are
        put back after the framework stepped them (:meth:`end`). Applied with a learning-rate cut in
        force: the cut is in force during the framework's optimizer step only (set now: Lightning calls
        this from within the step, after its pre-step hooks and before the update)."""
        schedulers = list(schedulers)
        states = [copy.deepcopy(s.state_dict()) for s in schedulers]
        groups = self.guard.optimizer.param_groups
        before = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self._scaled = []
        self.outcome = self.guard.step(step, rerun, update=self._framework_update, first=first)
        if not self.outcome.applied:
            self._held = (schedulers, states, before)
        elif self._scaled != [g["lr"] for g in self.guard.optimizer.param_groups]:
            self._uncut = self._set_rates(self._scaled)
            self._hooks = [self.guard.optimizer.register_step_post_hook(lambda *_: self._set_rates(self._uncut))]

    def _framework_update(self) -> None:
        """The guard's update: the framework's optimizer step, which follows; the rates in force now
        (a rollback's cut, a spike mitigation's) are kept for it."""
        self._scaled = [g["lr"] for g in self.guard.optimizer.param_groups]

    def _set_rates(self, rates: list[float]) -> list[float]:
        """Set the optimizer's learning rates (none when empty); returns the ones they replace."""
        groups = self.guard.optimizer.param_groups
        before = [g["lr"] for g in groups]
        for g, lr in zip(groups, rates):
            g["lr"] = lr
        self._uncut = []
        return before

    def _after_framework_step(self) -> None:
        """The framework's optimizer and scheduler steps are done: its schedule put back if the guard did
        not apply the step (it stays where it was, as the weights and the optimizer state do)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._set_rates(self._uncut)  # the framework skipped its step (a gradient scaler's overflow)
        if self._held is not None:
            schedulers, states, before = self._held
            self._held = None
            for scheduler, state in zip(schedulers, states):
                scheduler.load_state_dict(state)
            for group, saved in zip(self.guard.optimizer.param_groups, before):
                group.update(saved)

    def end(self, step: int, loss: Any, **scalars: Any) -> None:
        """Optimizer step ``step`` is done: its record, with the step's loss (a tensor: read later)
        and any scalar the framework knows better than the probes (``lr=``: the rate the step used)."""
        if self.guard is not None:
            self._after_framework_step()
        self.watch.step(step, loss=loss, **scalars, **(self.outcome.telemetry() if self.outcome is not None else {}))
        if self.injector is not None:
            self.injector.end_step()

    def close(self) -> None:
        """Emit the last record, remove the hooks, and close the emitter if the callback made it."""
        if self.guard is not None:
            self.guard.close()  # its actions stay readable
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.injector is not None:
            self.injector.detach()
        if self._owns_emitter and self.emitter is not None:
            self.emitter.close()
            self._owns_emitter = False
