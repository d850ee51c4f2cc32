"""The micro-batches of a guarded step, read once from the data and kept for the step: the guard's
rerun of a gradient-accumulation step reads the same ones, and nothing is fetched twice or skipped.
"""

from __future__ import annotations

from typing import Any, Callable

from sdcwatch.core.validate import check_int

__all__ = ["MicroBatches"]


class MicroBatches:
    """``of(step)``: step ``step``'s ``per_step`` micro-batches, each read from ``fetch()`` the first
    time, the same list again for the same step (the guard's rerun). Call it before ``guard.step``:
    the step's batches are then all on their way before its first forward (a ``fetch`` that copies
    with ``non_blocking=True`` overlaps the copies with the compute, as a prefetch does), and a
    ``fetch`` drawing from torch's random generator draws before the guard saves its state for a rerun.

    >>> batches = MicroBatches(iter(range(100)).__next__, per_step=3)
    >>> batches.of(0), batches.of(0), batches.of(1)
    ([0, 1, 2], [0, 1, 2], [3, 4, 5])
    """

    def __init__(self, fetch: Callable[[], Any], per_step: int = 1) -> None:
        self.fetch = fetch
        self.per_step = check_int("guard.micro_batches.per_step", per_step, lo=1)
        self.step: int | None = None
        """The step whose micro-batches are kept."""
        self._kept: list[Any] = []

    def of(self, step: int) -> list[Any]:
        """Step ``step``'s micro-batches, in order: fetched when ``step`` is new, kept when it is not."""
        if step != self.step:
            self._kept = []  # the previous step's let go before the next ones are read
            self._kept = [self.fetch() for _ in range(self.per_step)]
            self.step = step
        return self._kept
