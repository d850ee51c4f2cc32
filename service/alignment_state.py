"""What the step aligner keeps of each run: its open steps (records by rank, v2 blocks), its closed
steps and budget, and a run's records waiting for a place (:mod:`sdcwatch.service.aligner`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from sdcwatch.core.record_type import Record
from sdcwatch.service.ingest import RecordColumns

__all__ = ["OpenStep", "RunSteps", "WaitingRun", "size_of", "world_of"]


@dataclass
class OpenStep:
    first_seen: float
    world: int
    records: dict[int, Record] = field(default_factory=dict)
    scalar_names: set[str] = field(default_factory=set)  # union over its records (the frame's width)
    layer_names: set[str] = field(default_factory=set)
    layer_len: int = 0
    blocks: list[tuple[RecordColumns, np.ndarray]] = field(default_factory=list)  # v2 rows of this step
    present: np.ndarray = field(init=False)  # ranks that sent (v1 or v2)
    count: int = 0

    def __post_init__(self) -> None:
        self.present = np.zeros(self.world, bool)

    def all_records(self) -> list[Record]:
        """Every record of the step, column blocks expanded."""
        out = list(self.records.values())
        for cols, idx in self.blocks:
            out += cols.to_records(idx)
        return out


@dataclass
class RunSteps:
    """One run's alignment: its open steps, the last closed one, its budget."""

    world: int
    open: dict[int, OpenStep] = field(default_factory=dict)
    last_closed: int = -1
    stride: int = 1  # usual distance between consecutive closed steps (runs may log every N steps)
    generation: int = 0  # bumped by a world-size change
    steps_complete: int = 0  # steps closed with every rank of the world (on probation until probation_steps)
    complete_since: float | None = None  # clock of its first complete step (probation lasts probation_s)
    tokens: float = 0.0  # records the run may still send now (its budget's bucket)
    tokens_at: float = 0.0  # clock time the bucket was last refilled


@dataclass
class WaitingRun:
    """A run's records waiting for a place, with what they show of it."""

    world: int
    since: float  # clock of its first waiting record
    items: list = field(default_factory=list)  # records and v2 blocks, in order
    records: int = 0  # counted in ``items`` and ``ends``
    ends: list[Record] = field(default_factory=list)  # its end-of-run markers


def size_of(item: Record | RecordColumns) -> int:
    """The records a record (one) or a v2 block holds."""
    return len(item) if isinstance(item, RecordColumns) else 1


def world_of(item: Record | RecordColumns) -> int:
    """The world size a record (or a block's first row) names."""
    return item.world if isinstance(item, Record) else int(item.rows["world"][0])
