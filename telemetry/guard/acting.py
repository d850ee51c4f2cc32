"""The acting part of the guard: skips within their budget, rollbacks to a snapshot, evictions, spike
mitigations and the update itself, on the guard's shared :class:`~sdcwatch.telemetry.guard.state.GuardState`."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

from sdcwatch.core.control import ACTIONS
from sdcwatch.telemetry.guard.checks import DistGroup, LocalGroup
from sdcwatch.telemetry.guard.config import GuardConfig, GuardEviction, GuardOutcome, GuardPlace
from sdcwatch.telemetry.guard.elastic import leave_quorum
from sdcwatch.telemetry.guard.snapshots import SnapshotStore, clone_state
from sdcwatch.telemetry.guard.state import GuardState

__all__ = ["GuardActions"]

log = logging.getLogger("sdcwatch.guard")


class GuardActions:
    """Carries out what the guard decided, every process alike (``actions``: where an eviction is
    recorded before it raises; the rest as :class:`~sdcwatch.telemetry.guard.guard.Guard` takes them)."""

    def __init__(
        self,
        config: GuardConfig,
        state: GuardState,
        place: GuardPlace,
        model: Any,
        optimizer: Any,
        group: Any,
        actions: list[GuardOutcome],
        *,
        resync: Callable[[set[int]], None] | None = None,
        elastic: Any = None,
        watch: Any = None,
    ) -> None:
        self.config, self.state, self.place = config, state, place
        self.model, self.optimizer, self.group, self.actions = model, optimizer, group, actions
        self.resync, self.elastic, self.watch = resync, elastic, watch
        self.snapshots = SnapshotStore(int(config.snapshot_memory_mb * 2**20), config.snapshot_dir, place.rank)
        self.steps_rolled_back = 0  # steps of progress undone by rollbacks

    def snapshot_before(self, step: int, data_pos: Any) -> None:
        """Take the snapshot due before ``step`` (the first step's too: one to go back to)."""
        if step % self.config.snapshot_every == 0 or not len(self.snapshots):
            self.snapshots.take(step, step if data_pos is None else data_pos, self.model, self.optimizer)

    # -- control decisions ------------------------------------------------------------------------

    def on_control(self, step: int, agreed: list[int], reason: str, out: GuardOutcome) -> GuardOutcome:
        """Act on the control decision ``agreed`` (the ballots' MAX); ``reason``: rank 0's text of it."""
        action = ACTIONS[agreed[3]]
        since = agreed[5] - 1 if agreed[5] else None
        lr = agreed[6] / 1e6 or 1.0
        if self.place.world > 1 and not isinstance(self.group, LocalGroup):
            reason = self.group.broadcast_text(reason)
        ranks = (agreed[4] - 1,) if agreed[4] else ()  # what every process agreed on
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
            return self.skip(step, out, what)
        if action == "rollback":
            return self.rollback(step, since, lr, set(ranks), out, what)
        return self.evict(step, ranks, what, out, since)

    # -- skips and escalation -----------------------------------------------------------------------

    def skip(self, step: int, out: GuardOutcome, what: str) -> GuardOutcome:
        """Skip the update, within the budget; a rerun before it shows in ``verdict``."""
        c = self.config
        if not self.skips_left(step):
            out.applied = True
            out.action = "rerun" if out.verdict else "none"
            out.would = "skip"
            out.message = (
                f"{what}; skip budget spent ({c.max_skips} in {c.budget_window} steps): update applied, reported only"
            )
            return out
        self.state.skips.append(step)
        out.action, out.applied = "skip", False
        out.message = f"{what}; update skipped on every rank"
        return out

    def skips_left(self, step: int) -> bool:
        return self.state.room("skips", step, self.config.budget_window, self.config.max_skips)

    def escalate(self, step: int, out: GuardOutcome, what: str) -> GuardOutcome:
        """No rerun left: skip while the budget lasts, then a fault naming a rank (not a spike) gets
        ``on_persistent``."""
        if self.skips_left(step) or not out.ranks or out.reason == "spike":
            return self.skip(step, out, what)
        c = self.config
        return self.on_persistent(
            step, out, f"{what}; skip budget spent too ({c.max_skips} in {c.budget_window} steps)"
        )

    def on_persistent(self, step: int, out: GuardOutcome, what: str) -> GuardOutcome:
        act = self.config.on_persistent
        if act == "evict":
            return self.evict(step, out.ranks, what, out)  # returns only when the group left (on_evict)
        if act == "rollback":
            return self.rollback(step, None, self.config.lr_factor, set(out.ranks), out, what)
        if act == "skip":
            return self.skip(step, out, what)
        out.message = what + "; reported only (on_persistent = none)"
        return out

    # -- rollbacks ---------------------------------------------------------------------------------

    def rollback(
        self, step: int, since: int | None, lr: float, suspects: set[int], out: GuardOutcome, what: str
    ) -> GuardOutcome:
        c = self.config
        if not self.state.room("rollbacks", step, c.budget_window, c.max_rollbacks):
            spent = f"rollback budget spent ({c.max_rollbacks} in {c.budget_window} steps)"
            if suspects:
                return self.evict(step, tuple(sorted(suspects)), f"{what}; {spent}", out, since)
            out.would = "rollback"
            out.message = f"{what}; {spent}: reported only"
            return out
        snap = self.restore(since if since is not None else step + 1, suspects)
        if snap is None:
            out.would = "rollback"
            out.message = what + "; no snapshot old enough to roll back to: reported only"
            return out
        self.state.rollbacks.append(step)
        self.steps_rolled_back += step + 1 - snap.step
        self.state.lr_scale, self.state.lr_until = lr, step + c.lr_cut_steps
        out.action, out.applied, out.resume_from, out.lr_factor = "rollback", False, snap.data_pos, lr
        out.message = f"{what}; rolled back to the snapshot before step {snap.step}" + (
            f", learning rate x{lr:g} for {c.lr_cut_steps} steps" if lr != 1.0 else ""
        )
        return out

    def restore(self, before: int | None, suspects: set[int]) -> Any:
        """Load the newest snapshot before step ``before`` (None: the newest), make the replicas equal;
        returns it (None: none)."""
        snap = self.snapshots.before(before)
        if snap is None:
            return None
        self.model.load_state_dict(snap.model)
        self.optimizer.load_state_dict(clone_state(snap.optimizer))
        self.snapshots.drop_after(snap.step)
        if self.resync is not None:
            self.resync(suspects)
        elif isinstance(self.group, DistGroup):
            self.group.broadcast_parameters(
                self.model, next((r for r in range(self.place.world) if r not in suspects), 0)
            )
        return snap

    # -- spike mitigation and the update ---------------------------------------------------------------

    def mitigate(self, step: int, out: GuardOutcome) -> GuardOutcome:
        """After a spike that is not transient: start ``spike_mitigation``, within its budget."""
        c = self.config
        if out.verdict == "transient" or not (out.action != "none" or out.would):
            return out  # the rerun's clean result was used, or nothing was seen to act on
        kind, _, until = self.state.mitigation
        if step <= until:
            out.message += f"; the spike mitigation ({kind}) is in force until step {until}"
            return out
        if not self.state.room("mitigations", step, c.budget_window, c.max_mitigations):
            out.message += f"; mitigation budget spent ({c.max_mitigations} in {c.budget_window} steps)"
            return out
        self.state.mitigations.append(step)
        kind = c.spike_mitigation
        factor = c.mitigation_lr_factor if "lr" in kind else 1.0
        self.state.mitigation = (kind, factor, step + c.mitigation_steps - 1)
        out.mitigation, out.lr_factor = kind, factor
        parts = ([f"learning rate x{factor:g}"] if "lr" in kind else []) + (
            [f"gradient clipped to {c.mitigation_clip:g}x the median norm"] if "clip" in kind else []
        )
        out.message += f"; mitigated: {' and '.join(parts)} for steps {step}-{step + c.mitigation_steps - 1}"
        return out

    def update(self, step: int, update: Callable[[], Any] | None) -> None:
        """Step the optimizer (or ``update``) with the learning-rate cut and clip in force at ``step``."""
        st = self.state
        scale = st.lr_scale if step <= st.lr_until else 1.0
        kind, factor, until = st.mitigation
        if step <= until:
            scale *= factor if "lr" in kind else 1.0
            if "clip" in kind:
                self._clip()
        elif until >= 0 and step == until + 1:
            st.mitigation = ("none", 1.0, -1)
            log.info(
                "sdcwatch guard (rank %s): step %s: the spike mitigation ended, learning rate restored",
                self.place.rank,
                step,
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

    def _clip(self) -> None:
        """Clip the gradient to ``mitigation_clip`` times the baseline of recent clean norms."""
        base = self.state.grad.baseline
        if not base > 0:
            return
        import torch

        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, self.config.mitigation_clip * base)

    # -- eviction ------------------------------------------------------------------------------------

    def _hosts(self, ranks: Sequence[int]) -> list[str]:
        if self.place.host_of is not None:
            return [self.place.host_of(r) for r in ranks]
        table = self.group.gather_hosts(self.place.host)
        if len(table) > 1:
            return [table[r] if 0 <= r < len(table) else "" for r in ranks]
        return [self.place.host if r == self.place.rank else "" for r in ranks]

    def evict(
        self, step: int, ranks: Sequence[int], what: str, out: GuardOutcome, since: int | None = None
    ) -> GuardOutcome:
        """Evict ``ranks``: their replica groups leave (``on_evict="leave"``, room in the quorum), or
        :class:`GuardEviction` is raised on every process."""
        ranks = tuple(sorted(ranks))
        hosts = self._hosts(ranks)
        reason = what.removeprefix(f"step {step}: ")
        if self.config.on_evict == "leave" and self.elastic is not None:
            left = leave_quorum(self.elastic, step, ranks, hosts, reason, out)
            if left is not None:
                return left
        out.action, out.applied, out.ranks = "evict", False, ranks
        exc = GuardEviction(step, ranks, hosts, reason, since if since is not None else step)
        out.message = exc.message
        self.actions.append(out)
        log.error("%s", exc.message)
        if self.watch is not None:
            with contextlib.suppress(Exception):
                self.watch.step(step, **out.telemetry())
                self.watch.flush()
        raise exc
