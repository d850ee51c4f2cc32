"""The guard: acts on a detection at the step boundary, on every rank alike, without stopping the job.

Detection tells you something went wrong; the guard keeps it from doing damage. It wraps the
update of each step (``guard.step(step, compute)``) and, before the optimizer step, can

* **skip** the update when the all-reduced gradient is not finite or a loss / gradient value is a
  spike against a robust baseline (median and MAD of recent clean steps, both thresholds tunable);
* **rerun** the step with the same micro-batches and RNG state: a different result means a
  *transient* fault (the rerun's clean result is used, nothing is lost); the same result, checked
  once more by recomputing the suspect rank's micro-batch on another rank, means *persistent*
  (hardware: the other rank disagrees) or *data* (it agrees);
* **roll back** to the last good in-memory snapshot (optionally also kept on disk), resynchronise
  the replicas from a healthy rank and continue with a lower learning rate, a bounded number of
  times per window;
* **evict** a rank: every process raises :class:`GuardEviction`, a ``SystemExit`` with the
  documented code :data:`EXIT_CODE_EVICT` and a message naming the rank and its host, so a launcher
  (torchrun elastic, a scheduler) restarts the job without that node.

Every retry is bounded (``max_reruns``, ``max_skips``, ``max_rollbacks``, ``max_mitigations`` per
window), each with a documented escape (docs/guard.md); a spike that is not transient may also be
mitigated (a learning-rate cut and / or a tighter clip for a few steps, ``spike_mitigation``).

All ranks take the same action at the same step: each process's local verdict and rank 0's pending
control decision (from the detector service, read off the bus by a background thread) are combined
with one small all-reduce (MAX of a few integers) at the step boundary; no rank acts on the bus
alone. Decisions follow Megatron-LM's RerunStateMachine (rerun in place, then elsewhere, to tell
transient from persistent from data) and ByteRobust's evict / rollback, without leaving the process.

The default :class:`GuardConfig` only reports (``mode="report"``): it logs what it would do and
changes nothing until ``mode="act"``. Importing this module does not import torch.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any, Callable, Iterable

import numpy as np
from sdcwatch.core.errors import ConfigError
from sdcwatch.telemetry.guard.acting import GuardActing
from sdcwatch.telemetry.guard.checks import (
    Baseline,
    DistGroup,
    LocalGroup,
    StepValues,
    ballot,
    drop_through,
    grad_norm,
    rng_state,
    same,
    set_rng_state,
    suspects_from,
    to_numpy,
)
from sdcwatch.telemetry.guard.config import GuardConfig, GuardOutcome
from sdcwatch.telemetry.guard.resume import GuardResume
from sdcwatch.telemetry.guard.snapshots import SnapshotStore

__all__ = ["Guard"]

log = logging.getLogger("sdcwatch.guard")


class Guard(GuardActing, GuardResume):
    """Guards the updates of one training process (one rank, or all the ranks it simulates).

    Use ``outcome = guard.step(step, compute)`` in place of ``optimizer.step()`` (docs/guard.md shows a
    loop). ``compute()`` runs the step's forward and backward and returns the loss, or ``(loss,
    grad_norm)``, or ``(losses, grad_norm, local_grad_norms)`` with one loss per rank of ``local_ranks``;
    the guard restores the RNG state before a rerun, the closure must use the same micro-batches.

    Args:
        model: the module whose ``state_dict`` is snapshotted (the inner module under DDP).
        optimizer: stepped by the guard (or ``update`` passed to :meth:`step`).
        config: :class:`GuardConfig`.
        rank, world, host: identity (torch.distributed, then the launcher's environment).
        local_ranks: ranks this process computes (default ``(rank,)``; a simulated run: all).
        control: a decision reader (``poll() -> [Decision]``: :class:`~sdcwatch.telemetry.guard.control_topic.KafkaControl`);
            read on the process holding rank 0 only.
        peer: ``peer(suspect, on_rank) -> loss`` recomputes ``suspect``'s micro-batch on ``on_rank``
            (returns None on processes that do not hold ``on_rank``); enables the persistent / data verdict.
        resync: ``resync(suspects)`` after a rollback makes every replica equal again (default under
            torch.distributed: broadcast the parameters from the lowest rank not suspected).
        host_of: ``host_of(rank) -> str`` for the eviction message (default: gathered from the ranks).
        watch: a :class:`~sdcwatch.telemetry.probes.watch.Watch` whose record of the step is closed, with the
            guard's scalars, before an eviction exits; its matrix checksums are a trigger too.
        checksums: ``checksums() -> set of local ranks`` whose matrix checksums passed their
            rounding bound in the forward and backward just computed (default: the ``watch``'s);
            such a step is acted on like a non-finite one (``on_checksum``).
        distributed: agree through torch.distributed (default: when it is initialised).
        elastic: a :class:`~sdcwatch.telemetry.guard.elastic.ReplicaMembership`: with ``on_evict="leave"``
            an eviction makes the rank's replica group leave the quorum (the others go on) instead of
            exiting; its ``agreement()``, when not None, is what the processes agree through.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        config: GuardConfig | None = None,
        *,
        rank: int | None = None,
        world: int | None = None,
        host: str | None = None,
        local_ranks: Iterable[int] | None = None,
        control: Any = None,
        peer: Callable[[int, int], Any] | None = None,
        resync: Callable[[set[int]], None] | None = None,
        host_of: Callable[[int], str] | None = None,
        watch: Any = None,
        checksums: Callable[[], Iterable[int]] | None = None,
        group: Any = None,
        distributed: bool | None = None,
        elastic: Any = None,
    ) -> None:
        from sdcwatch.telemetry.wire.identity import identity_from_env

        self.config = config or GuardConfig()
        if not isinstance(self.config, GuardConfig):
            raise ConfigError("guard.config", f"must be a GuardConfig, got {type(self.config).__name__}")
        self.model, self.optimizer = model, optimizer
        if distributed is None:
            try:
                import torch.distributed as dist

                distributed = dist.is_available() and dist.is_initialized()
            except Exception:
                distributed = False
        ident = identity_from_env()
        if distributed:
            import torch.distributed as dist

            # a group of one has nobody to agree with: no collective then
            self._group: Any = DistGroup(group) if dist.get_world_size(group) > 1 else LocalGroup()
            rank = dist.get_rank(group) if rank is None else rank
            world = dist.get_world_size(group) if world is None else world
        else:
            self._group = LocalGroup()
        self.elastic = elastic
        self._group = self._elastic_agreement(elastic) or self._group
        self.rank = ident["rank"] if rank is None else int(rank)
        self.world = ident["world"] if world is None else int(world)
        self.host = ident["host"] if host is None else host
        self.local_ranks = tuple(local_ranks) if local_ranks is not None else (self.rank,)
        self.control = control
        self.peer = peer
        self.resync = resync
        self.host_of = host_of
        self.watch = watch
        if checksums is None and getattr(watch, "checksums", None) is not None:
            checksums = lambda: {self.rank} if watch.checksums.violated() else set()  # noqa: E731
        self.checksums = checksums
        c = self.config
        self.snapshots = SnapshotStore(int(c.snapshot_memory_mb * 2**20), c.snapshot_dir, self.rank)
        self._loss_base = [Baseline(c.window) for _ in self.local_ranks]
        self._local_grad_base = [Baseline(c.window) for _ in self.local_ranks]
        self._grad_base = Baseline(c.window)
        self._skips: collections.deque[int] = collections.deque()
        self._rollbacks: collections.deque[int] = collections.deque()
        self._lr_scale = 1.0
        self._lr_until = -1
        self._rerun_steps: collections.deque[int] = collections.deque()
        self._mitigations: collections.deque[int] = collections.deque()
        self._mitigation: tuple[str, float, int] = ("none", 1.0, -1)  # kind, lr factor, last step
        self._pending: collections.deque[Any] = collections.deque(maxlen=64)
        self._warned_budget = -1
        self.actions: list[GuardOutcome] = []
        """Every step at which the guard acted (or, in report mode, would have)."""
        self.reruns = 0
        """Extra forward/backward passes spent on reruns (and peer recomputations count as one)."""
        self.steps_rolled_back = 0
        """Steps of progress undone by rollbacks."""
        self.control_rejected = 0

    # -- the step ---------------------------------------------------------------------------------

    def step(
        self, step: int, compute: Callable[[], Any], *, update: Callable[[], Any] | None = None, data_pos: Any = None
    ) -> GuardOutcome:
        """Run ``compute`` for ``step``, decide with the other ranks, and update (or not).

        ``update`` replaces ``optimizer.step()``; ``data_pos`` labels the snapshot taken before this
        step (default ``step``): after a rollback, ``outcome.resume_from`` is the label to replay from.
        Raises :class:`GuardEviction` (a ``SystemExit``) when a rank is evicted.
        """
        c = self.config
        act = c.mode == "act"
        if act and (step % c.snapshot_every == 0 or not len(self.snapshots)):  # the first step: one to go back to
            self.snapshots.take(step, step if data_pos is None else data_pos, self.model, self.optimizer)
        rng = rng_state() if act and "rerun" in (c.on_nonfinite, c.on_spike, c.on_checksum) else None
        self.optimizer.zero_grad(set_to_none=True)
        values = self._values(compute())
        flag, suspects = self._judge(values)
        if flag < 2 and self.checksums is not None:
            wrong = set(self.checksums())  # a product off by more than rounding: a fault, finite or not
            if wrong:
                flag, suspects = 3, wrong
        control = self._next_control() if 0 in self.local_ranks else None
        agreed = self._group.max(ballot(flag, suspects, control))
        flag = agreed[0]
        suspects = suspects_from(agreed[1], agreed[2])
        out = GuardOutcome(step)
        self._rerun_values = None
        if agreed[3]:
            out = self._on_control(step, agreed, control, out)
        elif flag:
            out = self._on_local(step, flag, suspects, values, rng, compute, out)
            if flag == 1 and act and c.spike_mitigation != "none":
                out = self._mitigate(step, out)
        if out.applied:
            self._learn(self._rerun_values if out.action == "rerun" and self._rerun_values is not None else values)
            self._update(step, update)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if out.action != "none" or out.would:
            self.actions.append(out)
            level = logging.INFO if out.would else logging.WARNING
            log.log(level, "sdcwatch guard (rank %s): %s", self.rank, out.message)
        return out

    # -- judging ----------------------------------------------------------------------------------

    def _values(self, result: Any) -> StepValues:
        if isinstance(result, tuple):
            loss, gn, local = (list(result) + [None, None])[:3]
        else:
            loss, gn, local = result, None, None
        losses = to_numpy(loss)
        if losses.size == 1 and len(self.local_ranks) > 1:
            losses = np.repeat(losses, len(self.local_ranks))
        if losses.size != len(self.local_ranks):
            raise ConfigError("guard.compute", f"returned {losses.size} losses for {len(self.local_ranks)} local ranks")
        if gn is None:
            gn = grad_norm(self.optimizer)
        grad = float(to_numpy(gn)[0])
        local_grad = None if local is None else to_numpy(local)
        return StepValues(losses, grad, local_grad)

    def _judge(self, v: StepValues) -> tuple[int, set[int]]:
        """(flag, suspect ranks): 2 non-finite, 1 spike, 0 clean (3, a checksum, is judged in step())."""
        c = self.config
        bad = [r for r, x in zip(self.local_ranks, v.losses) if not math.isfinite(x)]
        if v.local_grad is not None:
            bad += [r for r, x in zip(self.local_ranks, v.local_grad) if not math.isfinite(x) and r not in bad]
        if bad or not math.isfinite(v.grad_norm):
            return 2, set(bad)
        spiked = {
            r
            for r, x, b in zip(self.local_ranks, v.losses, self._loss_base)
            if b.spike(x, c.spike_z, c.spike_rel, c.warmup)
        }
        if v.local_grad is not None:
            spiked |= {
                r
                for r, x, b in zip(self.local_ranks, v.local_grad, self._local_grad_base)
                if b.spike(x, c.spike_z, c.grad_spike_rel, c.warmup)
            }
        global_spike = self._grad_base.spike(v.grad_norm, c.spike_z, c.grad_spike_rel, c.warmup)
        return (1 if spiked or global_spike else 0), spiked

    def _learn(self, v: StepValues) -> None:
        for b, x in zip(self._loss_base, v.losses):
            b.add(float(x))
        if v.local_grad is not None:
            for b, x in zip(self._local_grad_base, v.local_grad):
                b.add(float(x))
        if math.isfinite(v.grad_norm):
            self._grad_base.add(v.grad_norm)

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
    ) -> GuardOutcome:
        c = self.config
        reason = {3: "checksum", 2: "nonfinite"}.get(flag, "spike")
        action = {3: c.on_checksum, 2: c.on_nonfinite}.get(flag, c.on_spike)
        out.reason, out.ranks = reason, tuple(suspects)
        what = {
            3: "a matrix product's checksum above its rounding bound",
            2: "a non-finite loss or gradient",
        }.get(flag, "a loss or gradient spike") + (
            f" on rank(s) {', '.join(map(str, suspects))}" if suspects else " in the all-reduced gradient"
        )
        if action == "none":
            return out
        if c.mode != "act":
            out.would = action
            out.message = f"step {step}: {what}; would {action} (report mode: nothing done)"
            return out
        if action == "skip":
            return self._skip(step, out, f"step {step}: {what}")
        drop_through(self._rerun_steps, step - c.budget_window)
        if len(self._rerun_steps) >= c.max_reruns:  # the bound on reruns; its escape: skip, then evict
            return self._escalate(
                step, out, f"step {step}: {what}; rerun budget spent ({c.max_reruns} in {c.budget_window} steps)"
            )
        return self._rerun(step, flag, suspects, values, rng, compute, out, what)

    def _rerun(
        self,
        step: int,
        flag: int,
        suspects: list[int],
        values: StepValues,
        rng: Any,
        compute: Callable[[], Any],
        out: GuardOutcome,
        what: str,
    ) -> GuardOutcome:
        """Rerun in place (same micro-batches, same RNG state), once; then recompute on a peer, once."""
        c = self.config
        set_rng_state(rng)
        self.optimizer.zero_grad(set_to_none=True)
        self.reruns += 1
        self._rerun_steps.append(step)
        again = self._rerun_values = self._values(compute())
        differs = 0 if again.same_as(values, c.rerun_tolerance) else 1
        still = 1 if flag == 3 and self.checksums is not None and set(self.checksums()) else 0
        differs, still = self._group.max([differs, still])
        out.action = "rerun"
        if flag == 3:  # a product's checksum does not depend on the data: it judges on its own
            if still:
                out.verdict = "persistent"
                return self._on_persistent(
                    step, out, f"step {step}: {what}; the rerun's products pass their bound again: persistent fault"
                )
            differs = 1  # the products are right this time: a flip that came and went
        if differs:
            out.verdict = "transient"
            flag2, _ = self._judge(again)
            if not self._group.max([flag2])[0]:
                out.applied = True
                out.message = (
                    f"step {step}: {what}; the rerun gave a clean, different result: transient fault, "
                    f"update taken from the rerun"
                )
                return out
            return self._skip(step, out, f"step {step}: {what}; the rerun differs but is not clean either (transient)")
        if len(suspects) == 1 and self.peer is not None and self.world > 1:
            s = suspects[0]
            on = (s + 1) % self.world
            self.reruns += 1
            persistent = self._peer_differs(s, on, values)
            out.verdict = "persistent" if persistent else "data"
            if persistent:
                return self._on_persistent(
                    step,
                    out,
                    f"step {step}: {what}; it repeats on rank {s} but rank {on} "
                    f"computes rank {s}'s micro-batch differently: persistent fault",
                )
            return self._skip(
                step, out, f"step {step}: {what}; it repeats on rank {on} too: the data, not the hardware"
            )
        out.verdict = "data" if len(suspects) != 1 else "reproducible"
        because = (
            "every rank alike: the data or the optimisation, not one rank's hardware"
            if len(suspects) != 1
            else "no other rank can recompute it here"
        )
        return self._skip(step, out, f"step {step}: {what}; the rerun repeats it ({because})")

    def _peer_differs(self, suspect: int, on: int, values: StepValues) -> bool:
        c = self.config
        original = float(values.losses[self.local_ranks.index(suspect)]) if suspect in self.local_ranks else 0.0
        recomputed = self.peer(suspect, on) if on in self.local_ranks else None
        mine = [original, float(to_numpy(recomputed)[0]) if recomputed is not None else 0.0]
        a, b = self._group.sum(mine)
        return not same(np.array([a]), np.array([b]), max(c.rerun_tolerance, 0.0))

    def _skip(self, step: int, out: GuardOutcome, what: str) -> GuardOutcome:
        """Skip the update, within the budget; a rerun before it shows in ``verdict``."""
        c = self.config
        if not self._skips_left(step):
            out.applied = True
            out.action = "rerun" if out.verdict else "none"
            out.would = "skip"
            out.message = (
                f"{what}; skip budget spent ({c.max_skips} in {c.budget_window} steps): update applied, reported only"
            )
            return out
        self._skips.append(step)
        out.action = "skip"
        out.applied = False
        out.message = f"{what}; update skipped on every rank"
        return out

    def _skips_left(self, step: int) -> bool:
        drop_through(self._skips, step - self.config.budget_window)
        return len(self._skips) < self.config.max_skips

    def _escalate(self, step: int, out: GuardOutcome, what: str) -> GuardOutcome:
        """No rerun left: skip while the skip budget lasts; then a hardware-like fault (non-finite or a
        checksum) naming a rank gets ``on_persistent``; anything else goes through, reported."""
        if self._skips_left(step) or not out.ranks or out.reason == "spike":
            return self._skip(step, out, what)
        c = self.config
        return self._on_persistent(
            step, out, f"{what}; skip budget spent too ({c.max_skips} in {c.budget_window} steps)"
        )

    def _on_persistent(self, step: int, out: GuardOutcome, what: str) -> GuardOutcome:
        act = self.config.on_persistent
        if act == "evict":
            return self._evict(step, out.ranks, what, out)  # returns only when the group left (on_evict)
        if act == "rollback":
            return self._rollback(step, None, self.config.lr_factor, set(out.ranks), out, what)
        if act == "skip":
            return self._skip(step, out, what)
        out.message = what + "; reported only (on_persistent = none)"
        return out

    # -- the update ------------------------------------------------------------------------------------

    def _update(self, step: int, update: Callable[[], Any] | None) -> None:
        scale = self._lr_scale if step <= self._lr_until else 1.0
        kind, factor, until = self._mitigation
        if step <= until:
            scale *= factor if "lr" in kind else 1.0
            if "clip" in kind:
                self._clip()
        elif until >= 0 and step == until + 1:
            self._mitigation = ("none", 1.0, -1)
            log.info(
                "sdcwatch guard (rank %s): step %s: the spike mitigation ended, learning rate restored", self.rank, step
            )
        if scale != 1.0:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * scale
        try:
            (update or self.optimizer.step)()
        finally:
            if scale != 1.0:
                for g, lr in zip(self.optimizer.param_groups, saved):
                    g["lr"] = lr

    _rerun_values: StepValues | None = None

    def close(self) -> None:
        """Stop the control reader."""
        if self.control is not None and hasattr(self.control, "close"):
            self.control.close()
