"""One metric family sdcwatch exposes on ``/metrics``: :class:`MetricSpec` (name, type, labels, help).

The exporter's catalogue lists its own; a detector declares the ones it owns in its own file, with
``read`` saying how to take the value from its state, and the collector, the catalogue, the
dashboard and its README pick them up from the detector registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import check_choice

__all__ = ["MetricSpec", "KINDS", "PER_RANK"]

#: The Prometheus types a family may have.
KINDS = ("gauge", "counter", "info")
#: The labels of a per-rank metric: the exporter shows its top-K ranks and those of open incidents.
PER_RANK = ("run", "rank", "host")


@dataclass(frozen=True)
class MetricSpec:
    """One exposed metric family.

    ``name`` is the full sample name (counters include ``_total``, info metrics ``_info``);
    ``kind`` is the Prometheus type (``gauge``, ``counter`` or ``info``). A detector's metric (a
    gauge or a counter) has ``read(detector)``, called on the view of each judged step, whose
    answer its labels fix: a number for ``("run",)``, a mapping of label value to number for
    ``("run", <label>)``, a (world,) array for :data:`PER_RANK`. ``panel`` titles the dashboard
    panel the generator draws of it ("" for none).
    """

    name: str
    kind: str
    labels: tuple[str, ...]
    help: str
    read: Callable[[Any], Any] | None = None
    panel: str = ""

    def __post_init__(self) -> None:
        check_choice(f"metric.{self.name}.kind", self.kind, KINDS if self.read is None else KINDS[:2])
        if self.read is not None and not (self.labels[:1] == ("run",) and len(self.labels) <= 2 or self.per_rank):
            raise ConfigError(f"metric.{self.name}.labels", f"a detector's metric is per run, got {self.labels}")

    @property
    def family(self) -> str:
        """The family name prometheus-client wants (without ``_total`` / ``_info``)."""
        suffix = {"counter": "_total", "info": "_info"}.get(self.kind, "")
        return self.name[: -len(suffix)] if suffix else self.name

    @property
    def per_rank(self) -> bool:
        """Whether the metric has a series per rank (bounded by the exporter's top-K)."""
        return self.labels == PER_RANK
