"""The guard's heavier actions: decisions from the control topic, rollback to a snapshot, eviction
(by exiting, or by the rank's replica group leaving the quorum: :mod:`~sdcwatch.telemetry.guard.elastic`),
the mitigation of an optimisation spike (a learning-rate cut and a tighter clip for a few steps).

A mixin of :class:`~sdcwatch.telemetry.guard.guard.Guard` (its state lives there); every method here is
called on every process at the same step, so the collectives inside (broadcasts, the host gather)
line up.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

from sdcwatch.core.control import ACTIONS
from sdcwatch.core.errors import ConfigError
import numpy as np
from sdcwatch.telemetry.guard.checks import DistGroup, LocalGroup, drop_through
from sdcwatch.telemetry.guard.config import GuardEviction, GuardOutcome
from sdcwatch.telemetry.guard.elastic import leave_quorum
from sdcwatch.telemetry.guard.snapshots import clone_state

__all__ = ["GuardActing"]

log = logging.getLogger("sdcwatch.guard")


class GuardActing:
    """Control decisions, rollbacks and evictions (see :class:`~sdcwatch.telemetry.guard.guard.Guard`)."""

    # -- acting on control decisions -------------------------------------------------------------------

    def _next_control(self) -> Any:
        if self.control is None:
            return None
        try:
            self._pending.extend(self.control.poll())
        except Exception as exc:  # a reader must not break training
            self.control_rejected += 1
            log.warning("sdcwatch guard: reading control decisions failed: %s", exc)
            self.control = None
            return None
        return self._pending.popleft() if self._pending else None

    def _on_control(self, step: int, agreed: list[int], control: Any, out: GuardOutcome) -> GuardOutcome:
        action = ACTIONS[agreed[3]]
        rank = agreed[4] - 1 if agreed[4] else None
        since = agreed[5] - 1 if agreed[5] else None
        lr = agreed[6] / 1e6 or 1.0
        reason = control.reason if control is not None else ""
        if self.world > 1 and not isinstance(self._group, LocalGroup):
            reason = self._group.broadcast_text(reason)
        ranks = (rank,) if rank is not None else ()  # what every process agreed on
        out.reason, out.ranks = "control", ranks
        what = (
            f"step {step}: the detector service asks to {action}"
            + (f" rank(s) {', '.join(map(str, ranks))}" if ranks else "")
            + (f" ({reason})" if reason else "")
        )
        if self.config.mode != "act":
            out.would = action
            out.message = what + "; report mode: nothing done"
            return out
        if action == "skip":
            return self._skip(step, out, what)
        if action == "rollback":
            return self._rollback(step, since, lr, set(ranks), out, what)
        return self._evict(step, ranks, what, out, since)

    def _rollback(
        self, step: int, since: int | None, lr: float, suspects: set[int], out: GuardOutcome, what: str
    ) -> GuardOutcome:
        c = self.config
        while self._rollbacks and self._rollbacks[0] <= step - c.budget_window:
            self._rollbacks.popleft()
        if len(self._rollbacks) >= c.max_rollbacks:
            if suspects:
                return self._evict(
                    step,
                    tuple(sorted(suspects)),
                    what + f"; rollback budget spent ({c.max_rollbacks} in {c.budget_window} steps)",
                    out,
                    since,
                )
            out.would = "rollback"
            out.message = (
                what + f"; rollback budget spent ({c.max_rollbacks} in {c.budget_window} steps): reported only"
            )
            return out
        snap = self._restore(since if since is not None else step + 1, suspects)
        if snap is None:
            out.would = "rollback"
            out.message = what + "; no snapshot old enough to roll back to: reported only"
            return out
        self._rollbacks.append(step)
        self.steps_rolled_back += step + 1 - snap.step
        self._lr_scale, self._lr_until = lr, step + c.lr_cut_steps
        out.action, out.applied, out.resume_from, out.lr_factor = "rollback", False, snap.data_pos, lr
        out.message = f"{what}; rolled back to the snapshot before step {snap.step}" + (
            f", learning rate x{lr:g} for {c.lr_cut_steps} steps" if lr != 1.0 else ""
        )
        return out

    def _restore(self, before: int | None, suspects: set[int]) -> Any:
        snap = self.snapshots.before(before)
        if snap is None:
            return None
        self.model.load_state_dict(snap.model)
        self.optimizer.load_state_dict(clone_state(snap.optimizer))
        self.snapshots.drop_after(snap.step)
        self._resync(suspects)
        return snap

    def restore(self, before: int | None = None, suspects: Iterable[int] = ()) -> Any:
        """Load the newest snapshot taken before step ``before`` (the newest of all: None) and make the
        replicas equal again; returns its data position, or None when there is no such snapshot.
        What a restarted job does after an eviction; a rollback does the same at a step boundary."""
        snap = self._restore(before, set(suspects))
        return None if snap is None else snap.data_pos

    def _resync(self, suspects: set[int]) -> None:
        if self.resync is not None:
            self.resync(suspects)
            return
        if isinstance(self._group, DistGroup):
            import torch

            src = next((r for r in range(self.world) if r not in suspects), 0)
            with torch.no_grad():
                for p in self.model.parameters():
                    self._group.dist.broadcast(p.data, src=src, group=self._group.group)

    def _mitigate(self, step: int, out: GuardOutcome) -> GuardOutcome:
        """After a spike that is not transient: the learning-rate cut and / or tighter clip of
        ``spike_mitigation`` for ``mitigation_steps`` steps from this one, within its budget."""
        c = self.config
        if out.verdict == "transient" or not (out.action != "none" or out.would):
            return out  # the rerun's clean result was used, or nothing was seen to act on
        kind, _, until = self._mitigation
        if step <= until:
            out.message += f"; the spike mitigation ({kind}) is in force until step {until}"
            return out
        drop_through(self._mitigations, step - c.budget_window)
        if len(self._mitigations) >= c.max_mitigations:
            out.message += f"; mitigation budget spent ({c.max_mitigations} in {c.budget_window} steps)"
            return out
        self._mitigations.append(step)
        kind = c.spike_mitigation
        factor = c.mitigation_lr_factor if "lr" in kind else 1.0
        self._mitigation = (kind, factor, step + c.mitigation_steps - 1)
        out.mitigation, out.lr_factor = kind, factor
        parts = ([f"learning rate x{factor:g}"] if "lr" in kind else []) + (
            [f"gradient clipped to {c.mitigation_clip:g}x the median norm"] if "clip" in kind else []
        )
        out.message += f"; mitigated: {' and '.join(parts)} for steps {step}-{step + c.mitigation_steps - 1}"
        return out

    def _clip(self) -> None:
        """Clip the gradient to ``mitigation_clip`` times the median norm of recent clean steps."""
        values = [v for v in self._grad_base.values if v > 0]
        if not values:
            return
        import torch

        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, self.config.mitigation_clip * float(np.median(values)))

    def _elastic_agreement(self, elastic: Any) -> Any:
        """``elastic``'s agreement across the quorum's groups (None: the guard's own); ``on_evict =
        "leave"`` without a membership is refused."""
        if self.config.on_evict == "leave" and elastic is None:
            raise ConfigError("guard.on_evict", "'leave' needs the job's replica membership: Guard(elastic=...)")
        return None if elastic is None else elastic.agreement()

    def _hosts(self, ranks: Sequence[int]) -> list[str]:
        if self.host_of is not None:
            return [self.host_of(r) for r in ranks]
        table = self._group.gather_hosts(self.host)
        if len(table) > 1:
            return [table[r] if 0 <= r < len(table) else "" for r in ranks]
        return [self.host if r == self.rank else "" for r in ranks]

    def _evict(
        self, step: int, ranks: Sequence[int], what: str, out: GuardOutcome, since: int | None = None
    ) -> GuardOutcome:
        """Evict ``ranks``: with ``on_evict="leave"`` (and room in the quorum) their replica groups
        leave and the outcome is returned; otherwise :class:`GuardEviction` is raised on every process."""
        ranks = tuple(sorted(ranks))
        hosts = self._hosts(ranks)
        if self.config.on_evict == "leave" and self.elastic is not None:
            left = leave_quorum(self.elastic, step, ranks, hosts, what.removeprefix(f"step {step}: "), out)
            if left is not None:
                return left
        out.action, out.applied, out.ranks = "evict", False, ranks
        reason = what.removeprefix(f"step {step}: ")
        exc = GuardEviction(step, ranks, hosts, reason, since if since is not None else step)
        out.message = exc.message
        self.actions.append(out)
        log.error("%s", exc.message)
        if self.watch is not None:
            try:
                self.watch.step(step, **out.telemetry())
                self.watch.flush()
            except Exception:
                pass
        raise exc
