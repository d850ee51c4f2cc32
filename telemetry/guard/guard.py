"""The guard: acts on a detection at the step boundary, on every rank alike, without stopping the job
(skip, rerun, roll back, evict; docs/guard.md). The processes agree with one MAX all-reduce of a few
integers, rank 0's pending control decision included. Importing this module does not import torch.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import replace
from typing import Any, Callable, Iterable

import numpy as np
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import check_type
from sdcwatch.telemetry.guard.acting import GuardActions
from sdcwatch.telemetry.guard.checks import (
    DistGroup,
    LocalGroup,
    StepJudge,
    StepValues,
    ballot,
    rng_state,
    same,
    set_rng_state,
    suspects_from,
    to_numpy,
)
from sdcwatch.telemetry.guard.config import GuardConfig, GuardOutcome, GuardPlace
from sdcwatch.telemetry.guard.state import GuardState
from sdcwatch.telemetry.wire.environment import RankEnvironment

__all__ = ["Guard"]

log = logging.getLogger("sdcwatch.guard")

#: A local verdict's flag -> (its reason, whose action is the setting ``on_<reason>``; what was seen).
_LOCAL_VERDICTS = {
    3: ("checksum", "a matrix product's checksum above its rounding bound"),
    2: ("nonfinite", "a non-finite loss or gradient"),
    1: ("spike", "a loss or gradient spike"),
}


class Guard:
    """Guards the updates of one training process (one rank, or all the ranks it simulates).

    Use ``outcome = guard.step(step, compute)`` in place of ``optimizer.step()`` (docs/guard.md shows a
    loop). ``compute()`` runs the step's forward and backward and returns the loss, or ``(loss,
    grad_norm)``, or ``(losses, grad_norm, local_grad_norms)``; it must use the same micro-batches on a
    rerun (:class:`~sdcwatch.telemetry.guard.micro_batches.MicroBatches` keeps a step's). Its parts
    ``judge`` (deciding) and ``acting`` share ``state``.

    Args:
        model: the module whose ``state_dict`` is snapshotted: the model itself, not its DDP wrapper
            (a ``DistributedDataParallel`` given here is unwrapped); ``compute`` calls the wrapper.
        optimizer: stepped by the guard (or ``update`` passed to :meth:`step`).
        place: :class:`GuardPlace`, where the guard runs.
        control: a decision reader (``poll() -> [Decision]``), read on the process holding rank 0 only.
        watch: the :class:`~sdcwatch.telemetry.probes.watch.Watch`, whose record is closed before an
            eviction exits; its matrix checksums are a trigger too.
        elastic: a :class:`~sdcwatch.telemetry.guard.elastic.ReplicaMembership` (``on_evict="leave"``).
        peer: ``peer(suspect, on_rank) -> loss`` recomputes ``suspect``'s micro-batch on ``on_rank``
            (None where ``on_rank`` is not held): enables the persistent / data verdict.
        resync: ``resync(suspects)`` makes the replicas equal after a rollback (default: a broadcast
            from the lowest rank not suspected).
        checksums: ``checksums() -> local ranks`` whose products passed their bound (default: the watch's).
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        config: GuardConfig | None = None,
        *,
        place: GuardPlace | None = None,
        control: Any = None,
        watch: Any = None,
        elastic: Any = None,
        peer: Callable[[int, int], Any] | None = None,
        resync: Callable[[set[int]], None] | None = None,
        checksums: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        self.config = check_type("guard.config", config or GuardConfig(), GuardConfig)
        if self.config.on_evict == "leave" and elastic is None:
            raise ConfigError("guard.on_evict", "'leave' needs the job's replica membership: Guard(elastic=...)")
        self.model, self.optimizer = _unwrapped(model), optimizer
        group, self.place = _agreement(place or GuardPlace())  # every field resolved
        agreement = elastic.agreement() if elastic is not None else None  # across the quorum's groups
        self.group = group if agreement is None else agreement
        self.control, self.peer = control, peer
        if checksums is None and getattr(watch, "checksums", None) is not None:
            checksums = lambda: {self.place.rank} if watch.checksums.violated() else set()  # noqa: E731
        self.checksums = checksums
        self.state = GuardState.new(self.config, len(self.place.local_ranks))
        self.judge = StepJudge(self.config, self.place.local_ranks, self.state)
        self.actions: list[GuardOutcome] = []  # every step it acted at (or, in report mode, would have)
        self.acting = GuardActions(
            self.config,
            self.state,
            self.place,
            self.model,
            optimizer,
            self.group,
            self.actions,
            resync=resync,
            elastic=elastic,
            watch=watch,
        )
        self.reruns = 0  # extra forward/backward passes (a peer recomputation counts as one)
        self._pending: collections.deque[Any] = collections.deque(maxlen=64)

    @property
    def steps_rolled_back(self) -> int:
        return self.acting.steps_rolled_back

    @property
    def snapshots(self) -> Any:
        return self.acting.snapshots

    # -- the step ---------------------------------------------------------------------------------

    def step(
        self,
        step: int,
        compute: Callable[[], Any],
        *,
        update: Callable[[], Any] | None = None,
        data_pos: Any = None,
        first: Any = None,
    ) -> GuardOutcome:
        """Run ``compute`` for ``step``, decide with the other ranks, and update (or not).

        ``update`` replaces ``optimizer.step()``; ``data_pos`` labels the snapshot taken before this
        step (default ``step``): after a rollback, ``outcome.resume_from`` is the label to replay from.
        ``first``: what ``compute`` returned for a first pass a framework already ran (its gradients in
        place); ``compute`` then runs only for a rerun.
        Raises :class:`GuardEviction` (a ``SystemExit``) when a rank is evicted.
        """
        c = self.config
        act = c.mode == "act"
        if act:
            self.acting.snapshot_before(step, data_pos)
        rng = rng_state() if act and "rerun" in (c.on_nonfinite, c.on_spike, c.on_checksum) else None
        if first is None:
            self.optimizer.zero_grad(set_to_none=True)
            first = compute()
        values = self.judge.values(first, self.optimizer)
        flag, suspects = self.judge.judge(values)
        if flag < 2 and self.checksums is not None:
            wrong = set(self.checksums())  # a product off by more than rounding: a fault, finite or not
            if wrong:
                flag, suspects = 3, wrong
        control = self._next_control() if 0 in self.place.local_ranks else None
        agreed = self.group.max(ballot(flag, suspects, control))
        flag = agreed[0]
        out = GuardOutcome(step)
        learnt = values
        if agreed[3]:
            out = self.acting.on_control(step, agreed, control.reason if control is not None else "", out)
        elif flag:
            out, rerun = self._on_local(step, flag, suspects_from(agreed[1], agreed[2]), values, rng, compute, out)
            if out.action == "rerun" and rerun is not None:
                learnt = rerun
            if flag == 1 and act and c.spike_mitigation != "none":
                out = self.acting.mitigate(step, out)
        if out.applied:
            self.judge.learn(learnt)
            self.acting.update(step, update)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if out.action != "none" or out.would:
            self.actions.append(out)
            level = logging.INFO if out.would else logging.WARNING
            log.log(level, "sdcwatch guard (rank %s): %s", self.place.rank, out.message)
        return out

    def _next_control(self) -> Any:
        if self.control is None:
            return None
        try:
            self._pending.extend(self.control.poll())
        except Exception as exc:  # a reader must not break training
            log.warning("sdcwatch guard: reading control decisions failed: %s", exc)
            self.control = None
            return None
        return self._pending.popleft() if self._pending else None

    # -- acting on local checks -------------------------------------------------------------------

    def _on_local(
        self,
        step: int,
        flag: int,
        suspects: list[int],
        values: StepValues,
        rng: Any,
        compute: Callable[[], Any],
        out: GuardOutcome,
    ) -> tuple[GuardOutcome, StepValues | None]:
        """The action on a local verdict, and the rerun's values when there was one."""
        c = self.config
        out.reason, seen = _LOCAL_VERDICTS.get(flag, _LOCAL_VERDICTS[1])
        out.ranks, action = tuple(suspects), getattr(c, f"on_{out.reason}")
        where = f" on rank(s) {', '.join(map(str, suspects))}" if suspects else " in the all-reduced gradient"
        what = seen + where
        if action == "none":
            return out, None
        if c.mode != "act":
            out.would = action
            out.message = f"step {step}: {what}; would {action} (report mode: nothing done)"
            return out, None
        if action == "skip":
            return self.acting.skip(step, out, f"step {step}: {what}"), None
        if not self.state.room("reruns", step, c.budget_window, c.max_reruns):  # its escape: skip, then evict
            spent = f"rerun budget spent ({c.max_reruns} in {c.budget_window} steps)"
            return self.acting.escalate(step, out, f"step {step}: {what}; {spent}"), None
        set_rng_state(rng)
        self.optimizer.zero_grad(set_to_none=True)
        self.reruns += 1
        self.state.reruns.append(step)
        again = self.judge.values(compute(), self.optimizer)
        return self._after_rerun(step, flag, suspects, values, again, out, what), again

    def _after_rerun(
        self,
        step: int,
        flag: int,
        suspects: list[int],
        values: StepValues,
        again: StepValues,
        out: GuardOutcome,
        what: str,
    ) -> GuardOutcome:
        """The verdict of a rerun in place; then a recomputation on a peer, once."""
        differs = 0 if again.same_as(values, self.config.rerun_tolerance) else 1
        still = 1 if flag == 3 and self.checksums is not None and set(self.checksums()) else 0
        differs, still = self.group.max([differs, still])
        out.action = "rerun"
        if flag == 3:  # a product's checksum does not depend on the data: it judges on its own
            if still:
                out.verdict = "persistent"
                return self.acting.on_persistent(
                    step, out, f"step {step}: {what}; the rerun's products pass their bound again: persistent fault"
                )
            differs = 1  # the products are right this time: a flip that came and went
        if differs:
            out.verdict = "transient"
            flag2, _ = self.judge.judge(again)
            if not self.group.max([flag2])[0]:
                out.applied = True
                out.message = (
                    f"step {step}: {what}; the rerun gave a clean, different result: transient fault, "
                    f"update taken from the rerun"
                )
                return out
            return self.acting.skip(
                step, out, f"step {step}: {what}; the rerun differs but is not clean either (transient)"
            )
        if len(suspects) == 1 and self.peer is not None and self.place.world > 1:
            s = suspects[0]
            on = (s + 1) % self.place.world
            self.reruns += 1
            persistent = self._peer_differs(s, on, values)
            out.verdict = "persistent" if persistent else "data"
            if persistent:
                return self.acting.on_persistent(
                    step,
                    out,
                    f"step {step}: {what}; it repeats on rank {s} but rank {on} "
                    f"computes rank {s}'s micro-batch differently: persistent fault",
                )
            return self.acting.skip(
                step, out, f"step {step}: {what}; it repeats on rank {on} too: the data, not the hardware"
            )
        out.verdict = "data" if len(suspects) != 1 else "reproducible"
        because = (
            "every rank alike: the data or the optimisation, not one rank's hardware"
            if len(suspects) != 1
            else "no other rank can recompute it here"
        )
        return self.acting.skip(step, out, f"step {step}: {what}; the rerun repeats it ({because})")

    def _peer_differs(self, suspect: int, on: int, values: StepValues) -> bool:
        local = self.place.local_ranks
        original = float(values.losses[local.index(suspect)]) if suspect in local else 0.0
        recomputed = self.peer(suspect, on) if on in local else None
        mine = [original, float(to_numpy(recomputed)[0]) if recomputed is not None else 0.0]
        a, b = self.group.sum(mine)
        return not same(np.array([a]), np.array([b]), self.config.rerun_tolerance)

    # -- checkpoints and the end -------------------------------------------------------------------

    def restore(self, before: int | None = None, suspects: Iterable[int] = ()) -> Any:
        """Load the newest snapshot taken before step ``before`` (None: the newest) and make the
        replicas equal again (a restarted job after an eviction); returns its data position or None."""
        snap = self.acting.restore(before, set(suspects))
        return None if snap is None else snap.data_pos

    def state_dict(self) -> dict[str, Any]:
        """The guard's state between steps, to save with a checkpoint (:meth:`GuardState.state_dict`)."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any], resume_step: int | None = None) -> None:
        """Restore :meth:`state_dict`'s output (:meth:`GuardState.load_state_dict`)."""
        self.state.load_state_dict(state, resume_step)

    def close(self) -> None:
        """Stop the control reader."""
        if self.control is not None and hasattr(self.control, "close"):
            self.control.close()


def _unwrapped(model: Any) -> Any:
    """The module inside a ``DistributedDataParallel`` wrapper (its snapshots then hold the module's
    own keys, as a checkpoint of the model does); any other model as it is."""
    if hasattr(model, "module") and hasattr(model, "no_sync"):
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            return model.module
    return model


def _agreement(place: GuardPlace) -> tuple[Any, GuardPlace]:
    """How the processes agree, and ``place`` filled in from torch.distributed, then the environment."""
    distributed = place.distributed
    if distributed is None:
        try:
            import torch.distributed as dist

            distributed = dist.is_available() and dist.is_initialized()
        except Exception:
            distributed = False
    rank, world, group = place.rank, place.world, LocalGroup()
    if distributed:
        import torch.distributed as dist

        # a group of one has nobody to agree with: no collective then
        group = DistGroup(place.group) if dist.get_world_size(place.group) > 1 else LocalGroup()
        rank = dist.get_rank(place.group) if rank is None else rank
        world = dist.get_world_size(place.group) if world is None else world
    env = (place.environment or RankEnvironment.read()).identity()
    rank = env["rank"] if rank is None else int(rank)
    return group, replace(
        place,
        rank=rank,
        world=env["world"] if world is None else int(world),
        host=env["host"] if place.host is None else place.host,
        local_ranks=tuple(place.local_ranks) if place.local_ranks is not None else (rank,),
        distributed=bool(distributed),
    )
