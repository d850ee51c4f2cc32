"""RunState: what the pipeline keeps of one run between steps, and how it is saved.

A run's detection state is its detectors and attribution, plus what the latest steps said of the
ranks: world size, hosts, mesh coordinates, the emitters' dropped-record counters, the latest
step summary (read by the exporter's view). A step summary may leave the host and coordinate
tables out when they did not change; :meth:`RunState.remember` keeps the last ones it carried.
The pipeline owns the runs; this module owns one run and its part of the state file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sdcwatch.core.incident import RunView
from sdcwatch.detectors.attribution import Attribution
from sdcwatch.service.held_layers import HeldLayers
from sdcwatch.service.summary import StepSummary

__all__ = ["RunState"]


@dataclass
class RunState:
    """One run's detection state (detectors, attribution) and what its latest steps said."""

    detectors: list
    attribution: Attribution
    world: int = 0
    steps_total: int = 0
    last_step: int = -1
    last_step_wall: float = 0.0
    hosts: list[str] = field(default_factory=list)
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0))
    summary: StepSummary | None = None  # latest step (read by view())
    stats: dict[str, Any] | None = None  # latest cross-rank quantiles a spatial stage sent
    sent_hosts: tuple[str, ...] | None = None  # spatial: host table last put in a summary
    coords: np.ndarray | None = None  # (world, mesh dims) last known coordinates of each rank
    sent_coords: np.ndarray | None = None  # spatial: coordinate table last put in a summary
    view: RunView | None = None  # the exporter's view of the latest step, built once per step
    held: HeldLayers = field(default_factory=HeldLayers)  # last statistics of sampled layer metrics

    def remember(self, summary: StepSummary, wall: float) -> None:
        """Take what a judged step says of the run (a new world size starts the rank tables over)."""
        if self.world != summary.world:
            self.world = summary.world
            self.hosts = [""] * summary.world
            self.coords = None
            self.dropped = np.zeros(summary.world)
        if summary.hosts is not None:
            self.hosts = list(summary.hosts)
        if summary.coords is not None:
            self.coords = summary.coords
        for r, n in summary.dropped.items():
            if 0 <= r < summary.world:
                self.dropped[r] = n
        if summary.stats is not None:
            self.stats = summary.stats
            self.held.hold(summary.stats, summary.step)
        self.steps_total += 1
        self.last_step = summary.step
        self.last_step_wall = wall
        self.summary = summary
        self.view = None

    def snapshot(self) -> dict[str, Any]:
        """The run's part of the state file."""
        return {
            "detectors": {d.name: d.snapshot() for d in self.detectors},
            "attribution": self.attribution.snapshot(),
            "world": self.world,
            "steps_total": self.steps_total,
            "last_step": self.last_step,
            "hosts": self.hosts,
            "dropped": self.dropped.tolist(),
            **({} if self.coords is None else {"coords": self.coords.tolist()}),
        }

    def restore(self, d: dict[str, Any], wall: float) -> None:
        """Take back a :meth:`snapshot` (detectors missing from it start fresh); ``wall`` restarts
        the stale clock with the service."""
        for det in self.detectors:
            if det.name in d["detectors"]:
                det.restore(d["detectors"][det.name])
        self.attribution.restore(d["attribution"])
        self.world, self.steps_total, self.last_step = int(d["world"]), int(d["steps_total"]), int(d["last_step"])
        self.hosts, self.dropped = list(d["hosts"]), np.array(d["dropped"], dtype=float)
        if d.get("coords") is not None:
            self.coords = np.array(d["coords"], dtype=np.int64).reshape(self.world, -1)
        self.last_step_wall = wall
