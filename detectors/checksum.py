"""Matrix-product checksum violations: each product's residual over its worst-case rounding bound
(``gemm_fwd``, ``gemm_bwd``, ``gemm_weight``), critical above 1; and, as AEGIS does, a warning for a
rank's ratio ``outlier_factor`` x above its peers' 90th percentile. No history: each step on its own.
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
from sdcwatch.detectors.base import DetectorSettings, SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.peers import Groups, known_coords, rank_label
from sdcwatch.detectors.registry import register

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
            if frame.world >= 4:  # all ranks as one group need no count of values; a peer group 4
                peers = frame.peers
                hits += self._outliers(block, over, name, peers, 0 if peers.trivial else 4)
        if not hits:
            return None
        hits.sort(key=lambda h: -h[3])
        return {"hits": hits[: 4 * self.max_listed], "n": len(hits)}

    def _outliers(
        self, block: np.ndarray, over: np.ndarray, name: str, peers: Groups, least: int
    ) -> list[tuple[int, str, int, float, str]]:
        """Per (product, peer group) at once, under the bound: each group's top rank against the 90th
        percentile of the rest of its group (a group with fewer than ``least`` values is skipped)."""
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
        enough = np.isfinite(G).sum(axis=2) >= least
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
