"""The guard's heavier actions: decisions from the control topic, rollback to a snapshot, eviction.

A mixin of :class:`~sdcwatch.telemetry.guard.guard.Guard` (its state lives there); every method here is
called on every process at the same step, so the collectives inside (broadcasts, the host gather)
line up.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

from sdcwatch.core.control import ACTIONS
from sdcwatch.telemetry.guard.checks import DistGroup, LocalGroup
from sdcwatch.telemetry.guard.config import GuardEviction, GuardOutcome
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
        self._evict(step, ranks, what, out, since)
        return out  # not reached

    def _rollback(
        self, step: int, since: int | None, lr: float, suspects: set[int], out: GuardOutcome, what: str
    ) -> GuardOutcome:
        c = self.config
        while self._rollbacks and self._rollbacks[0] <= step - c.budget_window:
            self._rollbacks.popleft()
        if len(self._rollbacks) >= c.max_rollbacks:
            if suspects:
                self._evict(
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

    def _evict(self, step: int, ranks: Sequence[int], what: str, out: GuardOutcome, since: int | None = None) -> None:
        ranks = tuple(sorted(ranks))
        if self.host_of is not None:
            hosts = [self.host_of(r) for r in ranks]
        else:
            table = self._group.gather_hosts(self.host)
            hosts = (
                [table[r] if 0 <= r < len(table) else "" for r in ranks]
                if len(table) > 1
                else [self.host if r == self.rank else "" for r in ranks]
            )
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
