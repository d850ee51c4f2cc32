"""The last cross-rank statistics of each layer metric, for the steps that do not measure it.

The probes measure some layer metrics on sampled steps only: the attention statistics and
``act_max`` every 16th step by default. The exporter's view is the latest step's, so between two
sampled steps ``sdcwatch_layer_metric`` had no attention series at all: a scrape every 15 s of a
job stepping every second found them one time in 16, and the dashboard's attention panels stayed
mostly empty. :class:`HeldLayers` keeps the statistics a metric had when it was last measured
and the view shows them until it is measured again, for at most :data:`HOLD_STEPS` steps.

Which steps are measured: a metric that comes and goes (seen, then missing from a step) is
*sampled*; a step that carries a sampled metric, or one never seen before, has its statistics
taken when it is judged (``frame_stats``, once per sampling period), not when it is scraped. A
split service's spatial stage sends them on such steps' summaries too. Transient: not in the
state file; bounded by the metric names a record may carry.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["HeldLayers", "HOLD_STEPS"]

#: Steps a layer metric's last statistics stay on view without being measured again.
HOLD_STEPS = 256
#: Distinct layer metric names remembered before the memory starts over (the record limits bound them far lower).
MAX_NAMES = 1024


class HeldLayers:
    """Per layer metric: the statistics (run-wide and per model piece) of the last step that measured it."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.sampled: set[str] = set()
        self._held: dict[str, tuple[int, Any, tuple[str, ...] | None, Any]] = {}

    def measures_sampled(self, names: Iterable[str]) -> bool:
        """Whether a step with these layer metrics carries a sampled one or a new one (its
        statistics are to be taken now); learns which metrics come and go."""
        current = set(names)
        if len(self.seen) > MAX_NAMES:
            self.seen.clear()
            self.sampled.clear()
        self.sampled |= self.seen - current
        new = current - self.seen
        self.seen |= current
        return bool(new or current & self.sampled)

    def hold(self, stats: dict[str, Any], step: int) -> None:
        """Keep the layer statistics of ``frame_stats``'s ``stats``, measured at ``step``."""
        pieces = stats.get("pieces")
        names = tuple(str(p) for p in pieces["names"]) if pieces else None
        for name, whole in stats.get("layers", {}).items():
            per_piece = pieces["layers"].get(name) if pieces else None
            self._held[name] = (step, whole, names, per_piece)

    def fill(self, layers: dict[str, Any], pieces: tuple[str, ...], step: int) -> dict[str, Any]:
        """``layers`` (this step's statistics; per piece when ``pieces`` names them) plus the held
        ones of every metric it lacks, measured at most :data:`HOLD_STEPS` steps before ``step``
        (per piece: only while the run's pieces are the same)."""
        out = dict(layers)
        for name, (at, whole, names, per_piece) in list(self._held.items()):
            if name in out:
                continue
            if not 0 <= step - at <= HOLD_STEPS:
                del self._held[name]
                continue
            value = (per_piece if names == pieces else None) if pieces else whole
            if value is not None:
                out[name] = value
        return out
