"""One metric family sdcwatch exposes on ``/metrics`` (:class:`MetricSpec`): the exporter's
catalogue lists its own, a detector declares its own in its file (``read`` takes the value from its
state) and the collector, catalogue and dashboard pick them up from the detector registry.
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
    """One exposed metric family: ``name`` the full sample name (with ``_total``, ``_info``), ``kind``
    its Prometheus type. A detector's gauge or counter has ``read(detector)``, whose answer its
    labels fix: a number for ``("run",)``, {label value: number} for ``("run", <label>)``, a (world,)
    array for :data:`PER_RANK`. ``panel`` titles its dashboard panel ("" for none)."""

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
