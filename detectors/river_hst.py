"""river's HalfSpaceTrees on per-rank feature vectors (each rank's squashed cross-rank robust z): an
opt-in detector and the campaign's throughput baseline (river takes one rank a call). A rank is
reported when its score's averaged excess over the median rank's stays above ``margin``.
"""

from __future__ import annotations

import base64
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.vocabulary import CHECK_METRICS, RANK_SCALARS
from sdcwatch.detectors.base import Detector, DetectorSettings
from sdcwatch.detectors.cross_rank_z import CrossRankZ
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.rank_outlier import RANK_OUTLIER_SCORE
from sdcwatch.detectors.registry import register

__all__ = ["RiverHalfSpaceTrees", "RiverConfig", "rank_features"]

_Z = CrossRankZ(reference_ranks=2048, rel_floor=1e-3, min_world=1)


def _robust_z(X: np.ndarray) -> np.ndarray:
    """(world, k) robust z of every value against its column's cross-rank median and MAD (this step's)."""
    return _Z.zt(np.ascontiguousarray(X.T), track=False).T


def rank_features(frame: StepFrame, clip: float = 4.0) -> tuple[np.ndarray, list[str]]:
    """(world, n) features in [0, 1]: squashed cross-rank robust z per scalar and per layer metric."""
    idx = [frame.scalar_names.index(n) for n in RANK_SCALARS if n in frame.scalar_names]
    names = [frame.scalar_names[i] for i in idx]
    cols = [_robust_z(frame.scalars[:, idx])] if idx else []
    for m, name in enumerate(frame.layer_names):
        if name in CHECK_METRICS:  # checks, not statistics: the checksum detector reads them
            continue
        z = _robust_z(frame.layers[:, m, :])
        worst = np.abs(z).argmax(axis=1)
        cols.append(z[np.arange(frame.world), worst][:, None])
        names.append(name)
    if not cols:
        return np.zeros((frame.world, 0)), []
    z = np.concatenate(cols, axis=1)
    return (np.clip(z, -clip, clip) + clip) / (2 * clip), names


@dataclass(frozen=True)
class RiverConfig(DetectorSettings, section="river_hst", positive="n_trees height window_size margin alpha min_world"):
    """Settings of the river HalfSpaceTrees detector ``[detectors.river_hst]`` (opt-in)."""

    n_trees: int = 10
    """Trees in the forest."""
    height: int = 3
    """Height of each tree."""
    window_size: int = 250
    """Rank records in the reference window the forest's mass profile is taken from."""
    margin: float = 0.08
    """A rank is reported when its averaged score excess over the median rank's reaches this."""
    alpha: float = 0.1
    """Weight of each step in the averaged score excess (an exponentially weighted mean)."""
    seed: int = 42
    """Seed of the forest."""
    min_world: int = 4
    """Fewest ranks for a comparison with the median rank."""


@register(baseline=True, order=140)
class RiverHalfSpaceTrees(Detector):
    """``rank_outlier`` from river ``anomaly.HalfSpaceTrees`` for a grossly broken rank (subtle shifts
    are below what the forest separates)."""

    name = "river_hst"
    fault = "rank_gross"
    Config = RiverConfig
    metrics = (RANK_OUTLIER_SCORE,)  # each rank's averaged score excess over the margin

    def __init__(self, config: RiverConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        from river.anomaly import HalfSpaceTrees  # optional and heavy

        self._model = HalfSpaceTrees(
            n_trees=self.n_trees, height=self.height, window_size=self.window_size, seed=self.seed
        )
        self._learned = 0
        self._steps = 0
        self._excess = np.zeros(0)
        self.rank_scores = np.zeros(0)
        # silent while the first window fills (at the smallest world) and the average settles
        self.warmup_steps = -(-self.window_size // self.min_world) + int(round(2 / self.alpha))

    def update(self, frame: StepFrame) -> list[Finding]:
        if frame.world < self.min_world:
            return []
        X, names = rank_features(frame)
        if X.shape[1] == 0:
            return []
        if self._excess.shape[0] != frame.world:
            self._excess = np.zeros(frame.world)
        scores = np.zeros(frame.world)
        warm = self._learned >= self.window_size
        for r in np.flatnonzero(frame.present):
            x = dict(zip(names, X[r].tolist()))
            if warm:
                scores[r] = self._model.score_one(x)
            self._model.learn_one(x)
            self._learned += 1
        self._steps += 1
        if not warm:
            return []
        live = frame.present
        self._excess[live] += self.alpha * (scores[live] - np.median(scores[live]) - self._excess[live])
        self.rank_scores = self._excess / self.margin
        if self._steps <= self.warmup_steps:
            return []
        out = []
        flagged = np.flatnonzero(self._excess >= self.margin)
        if 0 < flagged.size <= max(1, frame.world // 4):
            for r in flagged[np.argsort(-scores[flagged])][:8]:
                r = int(r)
                c = int(np.abs(X[r] - 0.5).argmax())
                host = frame.hosts[r]
                msg = (
                    f"rank {r}{f' (host {host})' if host else ''} persistently anomalous to HalfSpaceTrees "
                    f"(score {scores[r]:.2f}, {self._excess[r]:.2f} above the median rank; most off in {names[c]})"
                )
                out.append(
                    Finding.at(
                        frame,
                        self.name,
                        IncidentKind.RANK_OUTLIER,
                        Severity.WARNING,
                        float(self._excess[r] / self.margin),
                        msg,
                        ranks=(r,),
                        metric=names[c],
                        evidence={"score": float(scores[r]), "excess": float(self._excess[r])},
                    )
                )
        return out

    def snapshot(self) -> dict[str, Any]:
        # river models are plain Python objects; pickle is river's own persistence story
        return {
            "model": base64.b64encode(pickle.dumps(self._model)).decode("ascii"),
            "learned": self._learned,
            "steps": self._steps,
            "excess": self._excess.tolist(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self._model = pickle.loads(base64.b64decode(state["model"]))
        self._learned = int(state["learned"])
        self._steps = int(state["steps"])
        self._excess = np.array(state["excess"], float)
