"""Matrix-product checksum violations: a rank's product off by more than rounding can explain.

Every rank reports, per checked product (layer), the largest checksum residual relative to its
rounding bound (``gemm_fwd``, ``gemm_bwd``, ``gemm_weight``; see
:mod:`sdcwatch.telemetry.probes.checksum_bounds`). The bound is a worst case, so a ratio above 1 is a wrong
product, not noise: a critical finding at that step naming the rank, the check and the layer. And
as AEGIS does across data-parallel ranks, a ratio that stands ``outlier_factor`` (10^6) times above
the 90th percentile of the other ranks' ratios for the same product is a warning, even under the
bound. With mesh coordinates "the other ranks" are the rank's peer group (the same model piece
on the other data-parallel ranks): tensor or pipeline shards multiply different matrices. No
warm-up and no history: a ratio is judged on its own step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.model_place import message_at
from sdcwatch.core.vocabulary import RATIO_METRICS
from sdcwatch.detectors.base import SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.peers import Groups, known_coords, rank_label
from sdcwatch.detectors.registry import register
from sdcwatch.detectors.settings import DetectorSettings

__all__ = ["ChecksumDetector", "ChecksumConfig"]

_WHAT = {
    "gemm_fwd": "forward product",
    "gemm_bwd": "weight gradient",
    "gemm_weight": "weights changed in memory since the optimizer step",
}


@dataclass(frozen=True)
class ChecksumConfig(DetectorSettings, section="checksum", positive="bound outlier_factor outlier_floor max_listed"):
    """Settings of the checksum detector ``[detectors.checksum]``."""

    bound: float = 1.0
    """Ratio above which a product is wrong (1: the rounding bound itself)."""
    outlier_factor: float = 1e6
    """How far above the other ranks' 90th percentile a ratio must stand to be a warning (AEGIS)."""
    outlier_floor: float = 1e-2
    """A cross-rank outlier must also exceed this ratio (the others' ratios may be exactly 0)."""
    max_listed: int = 16
    """Most cells a finding lists in its evidence."""


@register(default=True, order=20)
class ChecksumDetector(SplitDetector):
    """Critical ``checksum_mismatch`` for a ratio above the bound; ``checksum_outlier`` (warning)
    for one rank's ratio ``outlier_factor`` x above the other ranks' 90th percentile."""

    name = "checksum"
    fault = "checksum"
    Config = ChecksumConfig

    def __init__(self, config: ChecksumConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self._steps = 0  # steps with a finding

    def observe(self, frame: StepFrame) -> dict[str, Any] | None:
        """The (rank, metric, layer, ratio, kind) cells over the bound or far above the other ranks."""
        if not frame.layers.size:
            return None
        hits: list[tuple[int, str, int, float, str]] = []
        sent = None
        for m, name in enumerate(frame.layer_names):
            if name not in RATIO_METRICS:
                continue
            if sent is None:
                sent = frame.sent_layers()
            block = np.where(sent[:, m, :], frame.layers[:, m, :], np.nan)  # (world, layers)
            with np.errstate(invalid="ignore"):
                over = block > self.bound
            r, c = np.nonzero(over)
            hits += [(int(a), name, int(b), float(block[a, b]), "mismatch") for a, b in zip(r, c)]
            if frame.world >= 4:
                peers = frame.peers
                if peers.trivial:
                    hits += self._outliers(block, over, name)
                else:
                    hits += self._group_outliers(block, over, name, peers)
        if not hits:
            return None
        hits.sort(key=lambda h: -h[3])
        return {"hits": hits[: 4 * self.max_listed], "n": len(hits)}

    def _outliers(self, block: np.ndarray, over: np.ndarray, name: str) -> list[tuple[int, str, int, float, str]]:
        """Per product: the top rank against the 90th percentile of the others (under the bound)."""
        finite = np.where(np.isfinite(block), block, np.nan)
        if np.all(np.isnan(finite)):
            return []
        filled = np.where(np.isnan(finite), -np.inf, finite)
        top = filled.argmax(axis=0)  # (layers,)
        cols = np.arange(block.shape[1])
        top_val = filled[top, cols]
        rest = finite.copy()
        rest[top, cols] = np.nan
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a column with one finite value
            p90 = np.nanquantile(rest, 0.9, axis=0)
        with np.errstate(invalid="ignore"):
            hot = (top_val > self.outlier_factor * p90) & (top_val > self.outlier_floor) & np.isfinite(p90)
        return [
            (int(top[c]), name, int(c), float(top_val[c]), "outlier")
            for c in np.flatnonzero(hot)
            if not over[top[c], c]
        ]

    def _group_outliers(
        self, block: np.ndarray, over: np.ndarray, name: str, peers: Groups
    ) -> list[tuple[int, str, int, float, str]]:
        """As :meth:`_outliers`, per (product, peer group) at once: each group's top rank against the
        90th percentile of the rest of its group (groups of fewer than 4 ranks with a value are skipped)."""
        G = peers.gather(np.where(np.isfinite(block), block, np.nan).T)  # (layers, groups, members)
        if np.all(np.isnan(G)):
            return []
        filled = np.where(np.isnan(G), -np.inf, G)
        top = filled.argmax(axis=2)  # (layers, groups)
        top_val = np.take_along_axis(filled, top[..., None], axis=2)[..., 0]
        rest = G.copy()
        np.put_along_axis(rest, top[..., None], np.nan, axis=2)
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            p90 = np.nanquantile(rest, 0.9, axis=2)
        enough = np.isfinite(G).sum(axis=2) >= 4
        with np.errstate(invalid="ignore"):
            hot = enough & (top_val > self.outlier_factor * p90) & (top_val > self.outlier_floor) & np.isfinite(p90)
        out = []
        for layer, g in zip(*np.nonzero(hot)):
            r = int(peers.table[g, top[layer, g]])
            if not over[r, layer]:
                out.append((r, name, int(layer), float(top_val[layer, g]), "outlier"))
        return out

    def judge(self, frame: StepContext, seen: dict[str, Any] | None) -> list[Finding]:
        """One finding per kind: the ranks whose products failed their checksum at this step."""
        if seen is None:
            return []
        hits = [(int(r), str(m), int(layer), float(v), str(k)) for r, m, layer, v, k in seen["hits"]]
        self._steps += 1
        out = []
        for kind, severity, incident in (
            ("mismatch", Severity.CRITICAL, IncidentKind.CHECKSUM_MISMATCH),
            ("outlier", Severity.WARNING, IncidentKind.CHECKSUM_OUTLIER),
        ):
            mine = [h for h in hits if h[4] == kind]
            if not mine:
                continue
            ranks = tuple(sorted({h[0] for h in mine}))
            rank, metric, layer, value, _ = mine[0]  # the largest ratio
            on = rank_label(frame, rank)
            more = f" and {len(ranks) - 1} more rank(s)" if len(ranks) > 1 else ""
            what = _WHAT.get(metric, metric)
            others = "other ranks" if known_coords(frame) is None else "rank's peers"
            if kind == "mismatch":
                head = f"checksum mismatch at step {frame.step} on {on}{more}: "
                tail = f" is off by {value:.3g} x its rounding bound ({what})"
            else:
                head = f"checksum outlier at step {frame.step} on {on}: "
                tail = f" residual {value:.3g} x bound, over {self.outlier_factor:.0e} x the {others}' P90 ({what})"
            msg, around = message_at(head, metric, layer, tail)
            out.append(
                Finding.at(
                    frame,
                    self.name,
                    incident,
                    severity,
                    value,
                    msg,
                    around=around,
                    ranks=ranks,
                    metric=metric,
                    layer=layer,
                    evidence={
                        "attribution": "sdc",
                        "cells": int(seen.get("n", len(hits))),
                        "hits": [
                            {"rank": h[0], "metric": h[1], "layer": h[2], "ratio": h[3]}
                            for h in mine[: self.max_listed]
                        ],
                    },
                )
            )
        return out

    def snapshot(self) -> dict[str, Any]:
        return {"steps": self._steps}

    def restore(self, state: dict[str, Any]) -> None:
        self._steps = int(state.get("steps", 0))
