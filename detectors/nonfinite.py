"""Non-finite values: NaN, Inf or |x| >= 1e10 (ATTNChecker's near-INF) anywhere in a step.

No warm-up and no history: a non-finite value is a critical finding at the very step it is seen,
naming the rank(s), the metric and the layer. A rank's own ``nonfinite`` counter (NaN/Inf the
probes saw in gradients or activations) counts too. The incident book keeps one incident per run
for it, so a run that stays NaN for 16,000 steps raises one alert, not 16,000.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sdcwatch.detectors.base import check_positive, register
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.types import Finding, Severity

__all__ = ["NonFiniteDetector"]

_COUNTERS = ("nonfinite",)  # scalars that count non-finite values seen inside the rank
_SKIP = ("emitter_dropped",)  # bookkeeping counters, not model values


@register
class NonFiniteDetector:
    """Critical finding for any NaN, Inf or near-INF value, localised to rank, metric and layer."""

    name = "nonfinite"
    fault = "nonfinite"

    def __init__(self, limit: float = 1e10, max_listed: int = 16) -> None:
        check_positive("nonfinite", limit=limit, max_listed=max_listed)
        self.limit = float(limit)
        self.max_listed = int(max_listed)
        self._seen = 0  # steps with a non-finite value so far
        self._masks: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}

    def _columns(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(value columns to check, counter columns) for a scalar layout (cached: layouts repeat)."""
        masks = self._masks.get(names)
        if masks is None:
            counters = np.array([n in _COUNTERS for n in names], bool)
            values = ~counters & np.array([n not in _SKIP for n in names], bool)
            masks = self._masks[names] = (values, counters)
        return masks

    warmup_steps = 0  # a NaN needs no baseline

    def update(self, frame: StepFrame) -> list[Finding]:
        hits: list[tuple[int, str, int | None, float]] = []  # (rank, metric, layer, value)
        n_bad = 0
        S = frame.scalars
        if S.size:
            values, counters = self._columns(frame.scalar_names)
            with np.errstate(invalid="ignore"):
                # the common case costs one reduction: every cell finite and small, no counter set
                calm = np.abs(S).max() < self.limit and not (counters.any() and (S[:, counters] > 0).any())
                if not calm:
                    bad = ~(np.abs(S) < self.limit) & frame.sent_scalars() & values[None, :]
                    if counters.any():
                        bad |= (S > 0) & counters[None, :]
                    r, c = np.nonzero(bad)
                    n_bad += r.size
                    hits += [(int(a), frame.scalar_names[b], None, float(S[a, b]))
                             for a, b in zip(r[: self.max_listed], c[: self.max_listed])]
        L = frame.layers
        if L.size and not np.abs(L).max() < self.limit:  # NaN fails the comparison: look closer
            with np.errstate(invalid="ignore"):
                bad = ~(np.abs(L) < self.limit) & frame.sent_layers()
            if bad.any():
                r, m, l = np.nonzero(bad)
                n_bad += r.size
                hits += [(int(a), frame.layer_names[b], int(c), float(L[a, b, c]))
                         for a, b, c in zip(r[: self.max_listed], m[: self.max_listed], l[: self.max_listed])]
        if not hits:
            return []
        self._seen += 1
        ranks = tuple(sorted({h[0] for h in hits}))
        # name the layer-level hit first: it localises better than a loss that is NaN everywhere
        first = min(hits, key=lambda h: (h[2] is None, h[0]))
        rank, metric, layer, value = first
        where = f"{metric}" + (f" layer {layer}" if layer is not None else "")
        host = frame.hosts[rank] if frame.world > 1 and frame.hosts[rank] else ""
        on = f"rank {rank}" + (f" (host {host})" if host else "") if frame.world > 1 else "the run"
        more = f" and {len(ranks) - 1} more rank(s)" if len(ranks) > 1 else ""
        msg = f"non-finite value at step {frame.step}: {where} = {value:.4g} on {on}{more}"
        return [Finding(
            detector=self.name, kind="nonfinite", severity=Severity.CRITICAL, run=frame.run,
            step=frame.step, score=float(n_bad), message=msg,
            ranks=ranks if frame.world > 1 else (), hosts=tuple(sorted({frame.hosts[r] for r in ranks} - {""})),
            metric=metric, layer=layer,
            evidence={"values_bad": n_bad, "hits": [
                {"rank": h[0], "metric": h[1], "layer": h[2], "value": h[3]} for h in hits[: self.max_listed]]},
        )]

    def snapshot(self) -> dict[str, Any]:
        return {"seen": self._seen}

    def restore(self, state: dict[str, Any]) -> None:
        self._seen = int(state["seen"])
