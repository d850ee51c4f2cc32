"""The demo's simulated training job: its ranks stream telemetry to the broker through one emitter
each, print their progress (and the guard's actions) as they go, keep pace with the detector
service when the guard is on, and restart without an evicted node as a launcher would."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

from sdcwatch.demo.plan import DemoPlan
from sdcwatch.demo.service import DemoService

__all__ = ["PACE_LAG_STEPS", "PACE_TIMEOUT_S", "DemoTraining"]

log = logging.getLogger("sdcwatch.demo")

#: With the guard on, how many steps the demo's training may run ahead of the detector service,
#: and how long it waits at most for it to catch up (see :meth:`DemoTraining.keep_pace`).
PACE_LAG_STEPS = 3
PACE_TIMEOUT_S = 20.0
PROGRESS_EVERY = 10  # steps between two progress lines


class DemoTraining:
    """The simulated job of ``plan`` on the broker at ``bootstrap``, watched by ``service``; ``control``:
    the guard's reader of the control topic (None without the guard); ``say`` prints progress."""

    def __init__(
        self,
        plan: DemoPlan,
        bootstrap: str,
        service: DemoService,
        control: Any,
        say: Callable[[str], None],
    ) -> None:
        self.plan = plan
        self.bootstrap = bootstrap
        self.service = service
        self.control = control
        self.say = say
        self.emitters: list[Any] = []
        self.fault_wall: list[float] = []
        """The wall time the first faulted step began (for the detection latency)."""
        self.t_train = time.monotonic()
        self._told = 0  # guard actions printed so far
        self._pace_gave_up: list[int] = []
        self.records_sent = 0
        """Records the ranks sent so far (a rank whose replica left the quorum sends no more)."""
        self._deciders = service.deciders

    def emitter(self, rank: int, host: str = "", coords: dict[str, int] | None = None) -> Any:
        """A rank's emitter on the broker (the simulated run's emitter factory)."""
        from sdcwatch.telemetry import Emitter, KafkaTransport

        em = Emitter(
            KafkaTransport(self.bootstrap),
            run=self.plan.run_id,
            rank=rank,
            world=self.plan.ranks,
            host=host or f"node{rank // 4}",
            coords=coords,
        )
        self.emitters.append(em)
        return em

    def keep_pace(self, step: int) -> None:
        """Wait (a bounded while) for the service to read the records up to a few steps back and the
        guard's reader every decision published: the demo's steps take milliseconds, a real job's
        seconds, and the loop should behave as at a real step time."""
        if self._pace_gave_up:
            return
        deadline = time.monotonic() + PACE_TIMEOUT_S
        want = self.records_sent - PACE_LAG_STEPS * self.plan.ranks
        source = self.service.source
        while source.seen < want or self.control.received < sum(s.published for s in self._deciders):
            if time.monotonic() > deadline:  # a stalled service must not stall the demo too
                self._pace_gave_up.append(step)
                log.warning("the detector service fell %.0f s behind at step %d", PACE_TIMEOUT_S, step)
                return
            time.sleep(0.005)

    def on_step(self, step: int, run: Any) -> None:
        """After each step: note the fault's wall time, keep pace, print guard actions and progress."""
        plan = self.plan
        left = getattr(run, "left", {})
        self.records_sent += sum(1 for r in range(plan.ranks) if left.get(r, step) >= step)
        if plan.injected_step is not None and step == plan.injected_step:
            self.fault_wall.append(time.time())
        if self.control is not None:
            self.keep_pace(step)
        if run.guard is not None:
            for act in run.guard.actions[self._told :]:
                if act.action != "none":
                    self.say(f"  GUARD  [{act.action}] {act.message}")
            self._told = len(run.guard.actions)
        if step % PROGRESS_EVERY == 0 or step == plan.steps - 1:
            n_open = len(self.service.events.open)
            loss = run.history[-1] if run.history else math.nan
            rate = (step + 1) / max(1e-9, time.monotonic() - self.t_train)
            self.say(f"  step {step:4d}/{plan.steps}  loss {loss:6.3f}  open incidents {n_open}  ({rate:.1f} steps/s)")

    def build_run(self) -> Any:
        """The simulated run: ``ranks`` data-parallel replicas (guarded or not) or the 3D layout."""
        plan = self.plan
        if plan.layout is not None:
            from sdcwatch.testbed.parallel3d import ParallelSimulatedRun

            return ParallelSimulatedRun(plan.layout, seed=plan.seed, faults=plan.faults, emitter_factory=self.emitter)
        from sdcwatch.testbed.simulated import SimulatedRun

        return SimulatedRun(
            world=plan.ranks,
            seed=plan.seed,
            faults=plan.faults,
            emitter_factory=self.emitter,
            guard=plan.guard_config,
            control=self.control,
        )

    def train(self, run: Any) -> float | None:
        """Train ``run`` to the plan's last step, restarting it without the ranks the guard evicts;
        then close it and the emitters. Returns the last step's loss."""
        from sdcwatch.telemetry.guard.config import GuardEviction

        steps = self.plan.steps
        try:
            while run.step < steps:
                try:
                    run.train(steps - run.step, on_step=self.on_step)
                except GuardEviction as ev:  # what a launcher does: restart without that node
                    self._restart_without(run, ev)
            return run.history[-1] if run.history else None
        finally:
            if self.control is not None:
                self.control.close()
            run.close()  # emits the last step's telemetry (probes are read one step late)
            for em in self.emitters:
                em.close(timeout=30)

    def _restart_without(self, run: Any, ev: Any) -> None:
        """Replace the evicted ranks with healthy hardware and resume from the guard's snapshot."""
        self.say(f"  GUARD  [evict] {ev.message}")
        run.replace_ranks(ev.ranks)
        pos = run.guard.restore(ev.since_step, ev.ranks)
        if pos is not None:
            run.data_pos = pos
        self.say(
            f"  (restarted with healthy hardware for rank(s) {', '.join(map(str, ev.ranks))}, from the "
            f"snapshot before step {ev.since_step}; data position {run.data_pos})"
        )
        self._told = len(run.guard.actions)
