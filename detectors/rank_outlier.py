"""Rank outliers: each rank against its peer group (ranks running the same model piece), per metric
and layer, on evidence over steps: the cross-rank z (:mod:`~sdcwatch.detectors.cross_rank_z`) fed to
a CUSUM (:mod:`~sdcwatch.detectors.rank_evidence`). Too few ranks to vote may still plainly disagree
(:mod:`~sdcwatch.detectors.rank_disagreement`): an info finding for attribution, naming no rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.jsonsafe import decode_array, encode_array
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.mesh import format_coords
from sdcwatch.core.metric_spec import PER_RANK, MetricSpec
from sdcwatch.core.model_place import message_at, where
from sdcwatch.core.validate import check_positive
from sdcwatch.core.vocabulary import CHECK_METRICS, RANK_SCALARS
from sdcwatch.detectors.base import DetectorSettings, SplitDetector, StepContext
from sdcwatch.detectors.cross_rank_z import CrossRankZ
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.peers import coords_of, known_coords, rank_label
from sdcwatch.detectors.rank_disagreement import RankDisagreement
from sdcwatch.detectors.rank_evidence import RankEvidence, cusum_step
from sdcwatch.detectors.registry import register

__all__ = ["RankOutlierDetector", "RankOutlierConfig", "RANK_OUTLIER_SCORE", "disagreement_text"]

#: Each rank's accumulated evidence over the threshold (``rank_scores``), on ``/metrics``.
RANK_OUTLIER_SCORE = MetricSpec(
    "sdcwatch_rank_outlier_score",
    "gauge",
    PER_RANK,
    "Accumulated rank-outlier evidence of a rank; exported for the top-K ranks and every "
    "rank in an open incident only.",
    read=lambda d: d.rank_scores,
    panel="Rank-outlier score (top-K ranks)",
)


@dataclass(frozen=True)
class RankOutlierConfig(
    DetectorSettings,
    section="rank_outlier",
    positive="threshold drift clip instant_z min_world disagree_ratio max_fraction max_named rel_floor",
):
    """Settings of the rank-outlier detector ``[detectors.rank_outlier]``."""

    threshold: float = 24.0
    """CUSUM evidence (in noise scales) at which a rank is named."""
    drift: float = 1.0
    """Noise scales subtracted from the evidence each step: a deviation smaller than this never builds up."""
    clip: float = 4.0
    """Largest |z| one step adds to the evidence (one wild step cannot name a rank)."""
    instant_z: float = 50.0
    """|z| at which a rank is extreme at a single step (read by attribution, never an incident alone)."""
    min_world: int = 4
    """Fewest ranks for a cross-rank comparison (in the world, and in each peer group)."""
    disagree_ratio: float = 2.0
    """With too few ranks to vote (fewer than ``min_world``): ranks disagree on a feature when its
    values differ by this factor or more, and their gap is ``instant_z`` typical gaps or more."""
    max_fraction: float = 0.25
    """A step where more than this fraction of ranks crosses the threshold names none (a job-wide change)."""
    max_named: int = 8
    """Most ranks named at one step."""
    rel_floor: float = 1e-3
    """Smallest noise scale, relative to the feature's median (ranks agreeing to many digits)."""
    warmup: int = 10
    """Steps during which the detector only learns."""
    reference_ranks: int = 2048
    """Ranks (a fixed, seeded sample) on which each feature's median and MAD are estimated."""
    report_z: float = 2.0
    """Scale-out: a step summary carries a cell whose |z| (or building evidence) reaches this."""
    scalars: tuple[str, ...] = RANK_SCALARS
    """Per-rank scalars compared rank against rank (every layer metric is, too)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.disagree_ratio <= 1.0:
            raise ConfigError("rank_outlier.disagree_ratio", f"must exceed 1.0, got {self.disagree_ratio}")
        if self.clip <= self.drift:
            raise ConfigError("rank_outlier.clip", f"must exceed drift ({self.drift}), got {self.clip}")
        check_positive("rank_outlier", reference_ranks=self.reference_ranks, report_z=self.report_z)
        object.__setattr__(self, "scalars", tuple(self.scalars))


@register(default=True, order=50)
class RankOutlierDetector(SplitDetector):
    """``rank_outlier`` (warning) for a rank whose evidence crosses ``threshold``, naming the metric and
    layer that deviate most; ``rank_deviation`` (info, for attribution) for a rank extreme at one step."""

    name = "rank_outlier"
    fault = "rank_shift"
    Config = RankOutlierConfig
    metrics = (RANK_OUTLIER_SCORE,)

    def __init__(self, config: RankOutlierConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        self.warmup_steps = self.warmup
        self._obs_sig: str | None = None  # layout the typical spread belongs to
        # sparse observations: this instance's own short CUSUM over the consecutive steps it holds
        self._local_sig: str | None = None
        self._local_step: int | None = None
        self._local_gap: int | None = None
        self._local_pos = self._local_neg = np.zeros((0, 0))
        # cross-rank z (its reference sample and typical spread) and the evidence over steps
        self._z = CrossRankZ(self.reference_ranks, self.rel_floor, self.min_world)
        self._evidence = RankEvidence(self.threshold, self.drift, self.clip)
        self._layout: dict[tuple, tuple] = {}
        self._too_few: tuple[int, int] = (0, 0)  # (peer groups, ranks) last said to be too small to judge
        # a job of too few ranks to vote: the features its ranks plainly disagree on
        self._few = RankDisagreement(self.instant_z, self.disagree_ratio, self.warmup, self.rel_floor)

    def _features(self, frame: StepFrame) -> tuple[np.ndarray, list[str], list[int | None], str]:
        """(k, world) feature matrix (each feature's ranks contiguous), its metric and layer names
        and a signature of that layout."""
        key = (frame.scalar_names, frame.layer_names, frame.n_layers)
        cached = self._layout.get(key)
        if cached is None:
            idx = [frame.scalar_names.index(n) for n in self.scalars if n in frame.scalar_names]
            metrics = [frame.scalar_names[i] for i in idx]
            layers: list[int | None] = [None] * len(idx)
            stats = [m for m, n in enumerate(frame.layer_names) if n not in CHECK_METRICS]
            if frame.layers.size:
                for m in stats:
                    metrics += [frame.layer_names[m]] * frame.n_layers
                    layers += list(range(frame.n_layers))
            sig = "|".join(metrics) + "#" + ",".join("-" if v is None else str(v) for v in layers)
            cached = self._layout[key] = (idx, metrics, layers, sig, stats)
        idx, metrics, layers, sig, stats = cached
        k_s = len(idx)
        X = np.empty((len(metrics), frame.world))
        X[:k_s] = frame.scalars[:, idx].T
        if frame.layers.size and stats:
            block = frame.layers if len(stats) == len(frame.layer_names) else frame.layers[:, stats, :]
            X[k_s:] = block.reshape(frame.world, -1).T
        peers = frame.peers
        shape = f"{frame.world}" if peers.trivial else f"{frame.world}/{peers.n}"
        return X, metrics, layers, f"{shape}:{sig}"

    def observe(self, frame: StepFrame) -> dict[str, Any] | None:
        """This step's robust z of every (feature, rank), and the ranks extreme at this step alone
        (with too few ranks to vote: their values, to tell whether they disagree)."""
        if frame.world < self.min_world:
            if frame.world < 2 or not frame.peers.trivial:
                return None
            X, metrics, layers, sig = self._features(frame)
            return {"sig": sig, "metrics": metrics, "layers": layers, "few": X} if X.shape[0] else None
        X, metrics, layers, sig = self._features(frame)
        if X.shape[0] == 0:
            return None
        if sig != self._obs_sig:
            self._obs_sig = sig
            self._z.spread = None
        peers = frame.peers
        too_few = None
        if peers.trivial:
            z = self._z.zt(X)  # (k, world)
        else:
            z, small = self._z.zt_grouped(X, peers, frame.present)
            if small.size:
                ranks = np.flatnonzero(np.isin(peers.ids, small) & frame.present)
                too_few = {"groups": int(small.size), "ranks": int(ranks.size), "example": int(ranks[0])}
        absz = np.abs(z)
        peak = absz.max(axis=0)
        spiky = np.flatnonzero(peak >= self.instant_z)
        instant = []
        if 0 < spiky.size <= self._limit(frame.world):
            li = metrics.index("loss") if "loss" in metrics else None
            for r in spiky[np.argsort(-peak[spiky])][: self.max_named]:
                r = int(r)
                c = int(absz[:, r].argmax())
                instant.append(
                    {
                        "rank": r,
                        "feature": c,
                        "peak": float(peak[r]),
                        "z": float(z[c, r]),
                        "loss_z": float(z[li, r]) if li is not None else None,
                        "value": float(X[c, r]),
                    }
                )
        seen: dict[str, Any] = {"sig": sig, "metrics": metrics, "layers": layers, "instant": instant}
        if too_few is not None:
            seen["too_few"] = too_few
        if self.sparse:
            c, r = np.nonzero(self._worth_sending(frame.step, sig, z, absz))
            seen["cells"] = np.stack([c, r]).astype(np.int32)
            seen["cell_z"] = z[c, r].astype(np.float32)
        else:
            seen["z"] = z
        return seen

    def _worth_sending(self, step: int, sig: str, z: np.ndarray, absz: np.ndarray) -> np.ndarray:
        """(k, world) bool: the cells a sparse observation carries (the others count as z = 0): this
        step's |z| or this instance's own short CUSUM (reset at every gap in its steps) reaches
        ``report_z``, so a small persistent shift is sent too."""
        gap = None if self._local_step is None else step - self._local_step
        if gap is not None and gap > 0:
            self._local_gap = gap if self._local_gap is None else min(self._local_gap, gap)
        if sig != self._local_sig or gap is None or gap <= 0 or gap > (self._local_gap or 1):
            self._local_sig = sig
            self._local_pos = np.zeros(z.shape)
            self._local_neg = np.zeros(z.shape)
        self._local_step = step
        lp, ln = self._local_pos, self._local_neg
        cusum_step(lp, ln, np.clip(z, -self.clip, self.clip), self.drift)
        return (absz >= self.report_z) | (lp >= self.report_z) | (ln >= self.report_z)

    def _limit(self, world: int) -> int:
        return max(1, math.floor(self.max_fraction * world))

    def judge(self, frame: StepContext, seen: dict[str, Any] | None) -> list[Finding]:
        """Add a step's z to the per-(feature, rank) CUSUM evidence; name ranks that cross the threshold."""
        if seen is None:
            return []
        if seen.get("few") is not None:
            return self._disagreement(frame, seen)
        metrics, layers = seen["metrics"], seen["layers"]
        ev = self._evidence
        if seen["sig"] != ev.sig:
            ev.reset(seen["sig"], len(metrics), frame.world)
        ev.steps += 1
        if seen.get("z") is not None:
            flagged, evidence, z_at = ev.add_dense(seen["z"])
        else:
            flagged, evidence, z_at = ev.add_sparse(seen["cells"], seen["cell_z"], frame.world)
        findings: list[Finding] = self._say_too_few(frame, seen.get("too_few"))
        if ev.steps <= self.warmup:
            return findings
        if 0 < flagged.size <= self._limit(frame.world):
            order = flagged[np.argsort(-evidence)][: self.max_named]
            for r in order:
                r = int(r)
                col = ev.column(r)
                c = int(col.argmax())
                findings.append(self._outlier(frame, r, c, float(col[c]), z_at(c, r), metrics, layers))
        for hit in seen["instant"]:
            r, c = int(hit["rank"]), int(hit["feature"])
            head = f"{rank_label(frame, r, host=False)} extreme at step {frame.step}: "
            msg, around = message_at(head, metrics[c], layers[c], f" z={hit['z']:.1f}")
            evidence = {"z": hit["z"], "loss_z": hit["loss_z"], "value": hit["value"]}
            kind, score = IncidentKind.RANK_DEVIATION, float(hit["peak"])
            place = {"metric": metrics[c], "layer": layers[c], "around": around, "ranks": (r,), "evidence": evidence}
            findings.append(Finding.at(frame, self.name, kind, Severity.INFO, score, msg, **place))
        return findings

    def _disagreement(self, frame: StepContext, seen: dict[str, Any]) -> list[Finding]:
        """An info finding when two or three ranks plainly disagree at this step (no rank named)."""
        X, metrics, layers = np.asarray(seen["few"], dtype=float), seen["metrics"], seen["layers"]
        hits = self._few.step(seen["sig"], X)
        if not hits:
            return []
        features = [
            {
                "metric": metrics[c],
                "layer": layers[c],
                "values": [float(v) if math.isfinite(v) else None for v in X[c]],
                "typical_gaps": round(times, 1),
            }
            for c, times in hits[:3]
        ]
        first = features[0]
        return [
            Finding.at(
                frame,
                self.name,
                IncidentKind.RANKS_DISAGREE,
                Severity.INFO,
                hits[0][1],
                f"the {frame.world} ranks disagree at step {frame.step}: {disagreement_text(features)}",
                metric=first["metric"],
                layer=first["layer"],
                evidence={"world": frame.world, "step": frame.step, "features": features},
            )
        ]

    def _say_too_few(self, frame: StepContext, too_few: dict[str, Any] | None) -> list[Finding]:
        """An info finding when the peer groups too small to judge change (not every step)."""
        now = (0, 0) if too_few is None else (int(too_few["groups"]), int(too_few["ranks"]))
        if now == self._too_few:
            return []
        self._too_few = now
        if too_few is None:
            return []
        r = int(too_few["example"])
        where = format_coords(coords_of(known_coords(frame), r))
        return [
            Finding.at(
                frame,
                self.name,
                IncidentKind.PEERS_TOO_FEW,
                Severity.INFO,
                float(now[1]),
                f"{now[1]} rank(s) in {now[0]} peer group(s) of fewer than {self.min_world} ranks are "
                f"not compared with their peers (e.g. rank {r}{' at ' + where if where else ''})",
                evidence={"groups": now[0], "ranks": now[1], "min_world": self.min_world},
            )
        ]

    @property
    def rank_scores(self) -> np.ndarray:
        """(world,) evidence / threshold per rank, for the exporter."""
        return self._evidence.rank_scores

    def _outlier(
        self, frame: StepContext, r: int, c: int, ev: float, z_cr: float, metrics: list[str], layers: list[int | None]
    ) -> Finding:
        conf = min(0.999, 1.0 - 0.5 * math.exp(-3.0 * (ev / self.threshold - 1.0)))
        others = "its peers" if known_coords(frame) is not None else "the other ranks"
        head = f"{rank_label(frame, r)} deviates from {others} in "
        msg, around = message_at(head, metrics[c], layers[c], f" (evidence {ev:.1f}, confidence {conf:.2f})")
        evidence = self._evidence
        col, pos, neg = evidence.column(r), evidence.column(r, "pos"), evidence.column(r, "neg")
        top = np.argsort(-col)[:3]
        said = {
            "confidence": conf,
            "z": z_cr,
            "direction": "high" if pos[c] >= neg[c] else "low",
            "top": [{"metric": metrics[i], "layer": layers[i], "evidence": float(col[i])} for i in top],
        }
        place = {"metric": metrics[c], "layer": layers[c], "around": around, "ranks": (r,), "evidence": said}
        return Finding.at(frame, self.name, IncidentKind.RANK_OUTLIER, Severity.WARNING, ev, msg, **place)

    def snapshot(self) -> dict[str, Any]:
        evidence = self._evidence.snapshot()  # {"sig": None} before a layout
        spread = None if self._z.spread is None else encode_array(self._z.spread)
        few = {} if self._few.sig is None else {"few": self._few.snapshot()}
        return {**evidence, "spread": spread, "obs_sig": self._obs_sig, **few}

    def restore(self, state: dict[str, Any]) -> None:
        self._obs_sig = state.get("obs_sig")
        self._z.spread = None if state.get("spread") is None else decode_array(state["spread"])
        self._evidence.restore(state)
        self._few.restore(state.get("few"))


def disagreement_text(features: list[dict[str, Any]], most: int = 2) -> str:
    """``grad_norm_local 65.7 vs 1.1; grad_cosine 0.019 vs 1``: what the ranks disagree on, in rank order.

    >>> disagreement_text([{"metric": "grad_norm_local", "layer": None, "values": [1.1, 65.7]}])
    'grad_norm_local 1.1 vs 65.7'
    """
    parts = []
    for f in features[:most]:
        values = " vs ".join("-" if v is None else f"{v:.3g}" for v in f["values"])
        parts.append(f"{where(f['metric'], f['layer'])} {values}")
    return "; ".join(parts)
