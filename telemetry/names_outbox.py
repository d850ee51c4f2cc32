"""The emitter's layer names: built once, sent ahead of the first record of every key window.

The probes hand the emitter their name lists (``Emitter.set_names``); :class:`NamesOutbox` packs
them once into a :class:`~sdcwatch.core.layer_names.LayerNames` message and, on the sender
thread, queues a copy stamped with the step of the first record of each key window
(``record_key``: run and 16-step window), so the names share that window's partition and reach
the service ahead of its records, and a service that starts mid-run learns them within a window.
They go in a send of their own, before the records: the emitter's record counters stay records.
A refused send is not retried; the names go again with the next batch. Nothing here raises into
the sender or the training loop.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from sdcwatch.core.layer_names import LayerNames, clean_names
from sdcwatch.core.record import KEY_WINDOW

__all__ = ["NamesOutbox"]

log = logging.getLogger("sdcwatch.telemetry")


class NamesOutbox:
    """One rank's layer names and the copies due on the bus."""

    def __init__(self, run: str, rank: int, world: int) -> None:
        self.run, self.rank, self.world = run, rank, world
        self.names: LayerNames | None = None
        self._window: int | None = None  # the key window the names last went out in
        self._due: list[LayerNames] = []
        self.sent = 0  # layer-names messages the transport took

    def set(self, names: Mapping[str, Sequence[str]]) -> None:
        """New lists (they grow as the probes discover modules); sent from the next record on."""
        try:
            self.names = LayerNames.build(self.run, self.rank, self.world, 0, clean_names(names))
            self._window = None
        except Exception as exc:  # a bound the lists break: the records still go, unnamed
            log.warning("sdcwatch emitter (rank %s): layer names not sent: %s", self.rank, exc)

    def note(self, step: int) -> None:
        """A record of ``step`` is about to go: the names go first if its window has not had them."""
        names = self.names
        if names is not None and step // KEY_WINDOW != self._window:
            self._window = step // KEY_WINDOW
            self._due.append(names.at(step))

    def send(self, transport: Any) -> None:
        """Send the copies due (call before the records they precede)."""
        if not self._due:
            return
        due, self._due = self._due, []
        try:
            transport.send(due)
            self.sent += len(due)
        except Exception:
            self._window = None
