"""The end-of-run marker: how a rank tells the detector service that it finished normally.

:meth:`Emitter.close` sends one marker per rank after everything the rank emitted has been
confirmed by the bus. The marker is an ordinary version-1 record (nothing in the wire format
changes) at the last step the rank emitted, carrying one reserved scalar, :data:`RUN_END`
(``sdcwatch.run_end = 1``), plus the usual ``emitter_dropped`` count. Compatibility both ways:

- an older service reads the marker as a second record of the rank's last step, which its
  aligner drops as a duplicate (or as late, once the step has closed): it changes nothing there;
- this service reads older emitters' records as before; a run whose ranks never send a marker
  simply never finishes, and ages out as an idle run.

A run is finished once every rank of its world has sent its marker (see
:mod:`sdcwatch.service.run_lifecycle`).
"""

from __future__ import annotations

import time as _time

from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import RUN_END

__all__ = ["end_marker", "is_end_marker"]


def end_marker(
    run: str,
    step: int,
    rank: int,
    world: int,
    *,
    host: str = "",
    local_rank: int = 0,
    time: float | None = None,
    dropped: float = 0.0,
) -> Record:
    """The marker rank ``rank`` sends after its last record (``step`` = the last step it emitted)."""
    return Record.make(
        run=run,
        step=step,
        rank=rank,
        world=world,
        host=host,
        local_rank=local_rank,
        time=_time.time() if time is None else time,
        scalars={RUN_END: 1.0, "emitter_dropped": float(dropped)},
    )


def is_end_marker(rec: Record) -> bool:
    """Whether ``rec`` is an end-of-run marker rather than a step's telemetry."""
    return RUN_END in rec.scalars
