"""Rank outliers: each rank against its peers, per metric and layer, with evidence over steps.

Data parallelism makes every rank run the same model piece on different data, so compute-derived
statistics agree in distribution across the ranks of a peer group (the same tensor, pipeline,
context and expert coordinates; every rank when records carry no coordinates); a faulty rank
stands out. Each step, every (rank, feature) value gets a robust z against its peer group's
median and MAD; a peer group with fewer than ``min_world`` ranks is not judged (and the detector
says so once, as an info finding). The z is clipped and
fed to a two-sided CUSUM per (rank, feature): a single noisy step cannot name a rank, a persistent
deviation of a couple of scales does within a few tens of steps. All of it is whole-matrix numpy.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdcwatch.core.jsonsafe import decode_array, encode_array
from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.base import SplitDetector, StepContext
from sdcwatch.detectors.registry import register
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.names import CHECK_METRICS, RANK_SCALARS
from sdcwatch.core.mesh import format_coords
from sdcwatch.detectors.peers import Groups, coords_of, grouped_robust, known_coords, rank_label

__all__ = ["RankOutlierDetector", "RankOutlierConfig"]


@dataclass(frozen=True)
class RankOutlierConfig:
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
        check_positive(
            "rank_outlier",
            threshold=self.threshold,
            drift=self.drift,
            clip=self.clip,
            instant_z=self.instant_z,
            min_world=self.min_world,
            max_fraction=self.max_fraction,
            max_named=self.max_named,
            rel_floor=self.rel_floor,
        )
        if self.clip <= self.drift:
            raise ConfigError("rank_outlier.clip", f"must exceed drift ({self.drift}), got {self.clip}")
        check_positive("rank_outlier", reference_ranks=self.reference_ranks, report_z=self.report_z)
        object.__setattr__(self, "scalars", tuple(self.scalars))


@register(default=True)
class RankOutlierDetector(SplitDetector):
    """Names a rank whose statistics persistently deviate from the other ranks'.

    Emits ``rank_outlier`` (warning) for each rank whose CUSUM evidence crosses ``threshold``,
    with the metric and layer that deviate most and a confidence; and ``rank_deviation`` (info,
    used by attribution, never an incident on its own) when a rank is extreme at a single step.
    """

    name = "rank_outlier"
    fault = "rank_shift"
    Config = RankOutlierConfig
    threshold: float
    drift: float
    clip: float
    instant_z: float
    min_world: int
    max_fraction: float
    max_named: int
    rel_floor: float
    warmup: int
    reference_ranks: int
    report_z: float
    scalars: tuple[str, ...]

    def __init__(self, config: RankOutlierConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        # With ``sparse`` (scale-out summaries) an observation carries only the cells with
        # |z| >= report_z; the others count as z = 0, so their evidence decays by ``drift`` a step.
        self._obs_sig: str | None = None  # layout the typical spread belongs to
        # sparse observations: this instance's own short CUSUM over the consecutive steps it holds
        self._local_sig: str | None = None
        self._local_step: int | None = None
        self._local_gap: int | None = None
        self._local_pos = self._local_neg = np.zeros((0, 0))
        # The median and MAD of a feature are estimated on at most reference_ranks ranks (a fixed,
        # seeded sample): at 2048 ranks the median's standard error is ~3% of the noise scale,
        # and the sort costs a fraction of what all 16k ranks would. Every rank is still scored.
        self._sample: np.ndarray | None = None
        self.spread_alpha = 0.05
        self._spread: np.ndarray | None = None  # (k,) typical cross-rank spread per feature
        self._sig: str | None = None  # layout of the evidence arrays: world, metrics and layers
        self._pos: np.ndarray | None = None
        self._neg: np.ndarray | None = None
        self._steps = 0
        self._layout: dict[tuple, tuple] = {}
        self._updated: np.ndarray | None = None
        self._hot = np.zeros(0, np.int64)
        self._scores: np.ndarray | None = np.zeros(0)
        self._too_few: tuple[int, int] = (0, 0)  # (peer groups, ranks) last said to be too small to judge

    @property
    def warmup_steps(self) -> int:
        return self.warmup

    # -- features -------------------------------------------------------------------------------

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

    def _reset(self, sig: str, k: int, world: int) -> None:
        self._sig = sig
        self._pos = np.zeros((k, world))  # CUSUM of positive deviations per (feature, rank)
        self._neg = np.zeros((k, world))
        self._steps = 0
        self._updated: np.ndarray | None = None  # sparse path: step each cell was last brought up to date
        self._hot = np.zeros(0, np.int64)  # sparse path: cells with evidence >= threshold
        self._scores = np.zeros(world)

    # -- detection --------------------------------------------------------------------------------

    def robust_z(self, X: np.ndarray) -> np.ndarray:
        """(world, k) robust z of every value against its column's cross-rank median and MAD.

        Stateless (the typical spread is this step's own); non-finite cells (missing ranks, NaN)
        get z = 0: they are the non-finite detector's.
        """
        return self._robust_zt(np.ascontiguousarray(X.T), track=False).T

    def _robust_zt(self, Xt: np.ndarray, track: bool = True) -> np.ndarray:
        """Same on the transposed (k, world) layout, where each feature's ranks are contiguous;
        ``track`` updates and uses the detector's typical spread per feature."""
        finite = np.isfinite(Xt)
        all_finite = finite.all()
        n = Xt.shape[1]
        ref = Xt
        if n > self.reference_ranks:
            if self._sample is None or self._sample.size != self.reference_ranks or self._sample.max() >= n:
                self._sample = np.sort(np.random.default_rng(n).choice(n, self.reference_ranks, replace=False))
            ref = Xt[:, self._sample]
        if all_finite:
            # one partition per statistic (the upper middle for an even count): np.median
            # would partition twice and average, and the robust scale does not need it
            mid = ref.shape[1] // 2
            med = np.partition(ref, mid, axis=1)[:, mid]
            absdev = np.abs(ref - med[:, None])
            mad = np.partition(absdev, mid, axis=1)[:, mid]
            meandev = absdev.mean(axis=1)
        else:
            Rn = np.where(np.isfinite(ref), ref, np.nan)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                med = np.nanmedian(Rn, axis=1)
                med = np.where(np.isfinite(med), med, 0.0)
                absdev = np.abs(Rn - med[:, None])
                mad = np.nanmedian(absdev, axis=1)
                meandev = np.nanmean(absdev, axis=1)
            mad = np.where(np.isfinite(mad), mad, 0.0)
            meandev = np.where(np.isfinite(meandev), meandev, 0.0)
        dev = Xt - med[:, None]
        # Ties: a max-type statistic often has most ranks at the very same value (the same token
        # wins everywhere), so this step's MAD is 0 while the ranks do spread over time. The
        # feature's typical spread (a slow average of the mean absolute deviation, scaled to a
        # Gaussian sigma) is the lower bound of its scale; one extreme step barely moves it. The
        # floor keeps a feature on which all ranks agree to many digits from exploding.
        spread = 1.2533 * meandev
        if not track:
            typical = spread
        elif self._spread is None or self._spread.shape != spread.shape:
            typical = self._spread = spread.copy()
        else:
            self._spread += self.spread_alpha * (spread - self._spread)
            typical = self._spread
        scale = np.maximum(1.4826 * mad, typical) + self.rel_floor * np.abs(med) + 1e-12
        with np.errstate(invalid="ignore"):
            z = dev / scale[:, None]
        if not all_finite:
            z[~finite] = 0.0
        return z

    def _robust_zt_grouped(self, Xt: np.ndarray, peers: Groups, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(k, world) robust z of every value against its peer group's median and MAD, and the peer
        groups with fewer than ``min_world`` present ranks (their ranks get z = 0: not judged).

        As :meth:`_robust_zt`, per (feature, peer group): the statistics come from one sort of a
        (features, groups, members) array, the typical spread is kept per (feature, group).
        """
        finite = np.isfinite(Xt)
        all_finite = finite.all()
        G = peers.gather(Xt if all_finite else np.where(finite, Xt, np.nan))  # (k, n, largest group)
        if G.shape[-1] > self.reference_ranks:  # a fixed, seeded sample of each group's members
            if self._sample is None or self._sample.size != self.reference_ranks or self._sample.max() >= G.shape[-1]:
                rng = np.random.default_rng(G.shape[-1])
                self._sample = np.sort(rng.choice(G.shape[-1], self.reference_ranks, replace=False))
            G = G[..., self._sample]
        med, mad, meandev, _ = grouped_robust(G)
        med, mad, meandev = (np.where(np.isfinite(a), a, 0.0) for a in (med, mad, meandev))
        spread = 1.2533 * meandev
        if self._spread is None or self._spread.shape != spread.shape:
            typical = self._spread = spread.copy()
        else:
            self._spread += self.spread_alpha * (spread - self._spread)
            typical = self._spread
        scale = np.maximum(1.4826 * mad, typical) + self.rel_floor * np.abs(med) + 1e-12
        ids = peers.ids
        with np.errstate(invalid="ignore"):
            z = (Xt - med[:, ids]) / scale[:, ids]
        if not all_finite:
            z[~finite] = 0.0
        n_present = peers.counts(present)
        small = np.flatnonzero((n_present > 0) & (n_present < self.min_world))
        if small.size:
            z[:, np.isin(ids, small)] = 0.0
        return z, small

    def observe(self, frame: StepFrame) -> dict[str, Any] | None:
        """This step's robust z of every (feature, rank), and the ranks extreme at this step alone."""
        if frame.world < self.min_world:
            return None
        X, metrics, layers, sig = self._features(frame)
        if X.shape[0] == 0:
            return None
        if sig != self._obs_sig:
            self._obs_sig, self._spread = sig, None
        peers = frame.peers
        too_few = None
        if peers.trivial:
            z = self._robust_zt(X)  # (k, world)
        else:
            z, small = self._robust_zt_grouped(X, peers, frame.present)
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
        """(k, world) bool: the cells a sparse observation carries.

        A cell travels when this step's |z| reaches ``report_z``, or when its evidence is building
        up over the consecutive steps this instance holds (its own short CUSUM, reset at every gap
        in the steps it sees, reaches ``report_z``): a rank shifted by less than ``report_z``
        scales, whose single steps rarely stand out, is then sent with its exact z from a few
        steps into each window of steps on.
        """
        gap = None if self._local_step is None else step - self._local_step
        if gap is not None and gap > 0:
            self._local_gap = gap if self._local_gap is None else min(self._local_gap, gap)
        if sig != self._local_sig or gap is None or gap <= 0 or gap > (self._local_gap or 1):
            self._local_sig = sig
            self._local_pos = np.zeros(z.shape)
            self._local_neg = np.zeros(z.shape)
        self._local_step = step
        lp, ln = self._local_pos, self._local_neg
        _cusum_step(lp, ln, np.clip(z, -self.clip, self.clip), self.drift)
        return (absz >= self.report_z) | (lp >= self.report_z) | (ln >= self.report_z)

    def _limit(self, world: int) -> int:
        return max(1, math.floor(self.max_fraction * world))

    def judge(self, frame: StepContext, seen: dict[str, Any] | None) -> list[Finding]:
        """Add a step's z to the per-(feature, rank) CUSUM evidence; name ranks that cross the threshold."""
        if seen is None:
            return []
        metrics, layers = seen["metrics"], seen["layers"]
        if seen["sig"] != self._sig:
            self._reset(seen["sig"], len(metrics), frame.world)
        self._steps += 1
        if seen.get("z") is not None:
            flagged, evidence, z_at = self._accumulate_dense(seen["z"])
        else:
            flagged, evidence, z_at = self._accumulate_sparse(seen["cells"], seen["cell_z"], frame.world)
        findings: list[Finding] = self._say_too_few(frame, seen.get("too_few"))
        if self._steps <= self.warmup:
            return findings
        if 0 < flagged.size <= self._limit(frame.world):
            order = flagged[np.argsort(-evidence)][: self.max_named]
            for r in order:
                r = int(r)
                col = self._column(r)
                c = int(col.argmax())
                findings.append(self._outlier(frame, r, c, float(col[c]), z_at(c, r), metrics, layers))
        for hit in seen["instant"]:
            r, c = int(hit["rank"]), int(hit["feature"])
            findings.append(
                Finding(
                    detector=self.name,
                    kind=IncidentKind.RANK_DEVIATION.value,
                    severity=Severity.INFO,
                    run=frame.run,
                    step=frame.step,
                    score=float(hit["peak"]),
                    message=f"{rank_label(frame, r, host=False)} extreme at step {frame.step}: {_where(metrics[c], layers[c])} z={hit['z']:.1f}",
                    ranks=(r,),
                    hosts=_hosts(frame, r),
                    metric=metrics[c],
                    layer=layers[c],
                    evidence={"z": hit["z"], "loss_z": hit["loss_z"], "value": hit["value"]},
                )
            )
        return findings

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
            Finding(
                detector=self.name,
                kind=IncidentKind.PEERS_TOO_FEW.value,
                severity=Severity.INFO,
                run=frame.run,
                step=frame.step,
                score=float(now[1]),
                message=(
                    f"{now[1]} rank(s) in {now[0]} peer group(s) of fewer than {self.min_world} ranks are "
                    f"not compared with their peers (e.g. rank {r}{' at ' + where if where else ''})"
                ),
                evidence={"groups": now[0], "ranks": now[1], "min_world": self.min_world},
            )
        ]

    def _accumulate_dense(self, z: np.ndarray):
        """CUSUM step on every cell; (flagged ranks, their evidence, z lookup)."""
        self._materialize(self._steps - 1)  # cells a sparse step left behind catch up first
        pos, neg = self._pos, self._neg
        _cusum_step(pos, neg, np.clip(z, -self.clip, self.clip), self.drift)
        evidence = np.maximum(pos, neg).max(axis=0)  # a reduction along rows is fast
        self._scores = evidence / self.threshold
        self._updated = None  # every cell is current
        flagged = np.flatnonzero(evidence >= self.threshold)
        return flagged, evidence[flagged], lambda c, r: float(z[c, r])

    def _accumulate_sparse(self, cells: np.ndarray, cell_z: np.ndarray, world: int):
        """The same CUSUM step touching only the cells sent (|z| >= report_z) and the few with
        evidence above the threshold. A cell not sent has z = 0 and loses ``drift`` a step, so it
        is brought up to date only when next touched: each cell keeps the step of its last update."""
        t = self._steps
        P, N = self._pos.reshape(-1), self._neg.reshape(-1)
        if self._updated is None:  # after a dense step or a restore every cell is current as of t - 1
            self._updated = np.full(P.size, t - 1, np.int64)
            self._hot = np.flatnonzero(np.maximum(P, N) >= self.threshold)
        cells = np.asarray(cells, dtype=np.int64).reshape(2, -1)
        sent = cells[0] * world + cells[1]
        zc = np.clip(np.asarray(cell_z, dtype=float), -self.clip, self.clip)
        idle = (t - 1 - self._updated[sent]) * self.drift  # the decay of the steps nobody sent
        p = np.maximum(P[sent] - idle, 0.0)
        n = np.maximum(N[sent] - idle, 0.0)
        _cusum_step(p, n, zc, self.drift)
        P[sent], N[sent] = p, n
        self._updated[sent] = t
        hot = np.union1d(self._hot, sent[np.maximum(p, n) >= self.threshold])
        now = self._current(hot)
        self._hot = hot[now >= self.threshold]
        self._scores = None  # per-rank scores on demand (rank_scores)
        flagged = np.unique(self._hot % world)
        evidence = np.array([self._column(int(r)).max() for r in flagged]) if flagged.size else np.zeros(0)
        sent_z = dict(zip(sent.tolist(), np.asarray(cell_z, dtype=float).tolist())) if flagged.size else {}
        return flagged, evidence, lambda c, r: sent_z.get(c * world + r, 0.0)

    def _current(self, flat: np.ndarray) -> np.ndarray:
        """Evidence max(pos, neg) of the given cells as of now."""
        P, N = self._pos.reshape(-1), self._neg.reshape(-1)
        if self._updated is None:
            return np.maximum(P[flat], N[flat])
        idle = (self._steps - self._updated[flat]) * self.drift
        return np.maximum(np.maximum(P[flat] - idle, 0.0), np.maximum(N[flat] - idle, 0.0))

    def _column(self, r: int, which: str = "both") -> np.ndarray:
        """(k,) current evidence of rank ``r`` per feature (``pos``, ``neg`` or their max)."""
        k, world = self._pos.shape
        flat = np.arange(k) * world + r
        if which == "both":
            return self._current(flat)
        a = (self._pos if which == "pos" else self._neg).reshape(-1)[flat]
        if self._updated is None:
            return a
        return np.maximum(a - (self._steps - self._updated[flat]) * self.drift, 0.0)

    @property
    def rank_scores(self) -> np.ndarray:
        """(world,) evidence / threshold per rank, for the exporter."""
        if self._scores is None:
            if self._pos is None or not self._pos.size:
                return np.zeros(0 if self._pos is None else self._pos.shape[1])
            k, world = self._pos.shape
            self._scores = self._current(np.arange(k * world)).reshape(k, world).max(axis=0) / self.threshold
        return self._scores

    def _outlier(
        self, frame: StepContext, r: int, c: int, ev: float, z_cr: float, metrics: list[str], layers: list[int | None]
    ) -> Finding:
        conf = min(0.999, 1.0 - 0.5 * math.exp(-3.0 * (ev / self.threshold - 1.0)))
        where = _where(metrics[c], layers[c])
        others = "its peers" if known_coords(frame) is not None else "the other ranks"
        msg = f"{rank_label(frame, r)} deviates from {others} in {where} (evidence {ev:.1f}, confidence {conf:.2f})"
        col, pos, neg = self._column(r), self._column(r, "pos"), self._column(r, "neg")
        top = np.argsort(-col)[:3]
        return Finding(
            detector=self.name,
            kind=IncidentKind.RANK_OUTLIER.value,
            severity=Severity.WARNING,
            run=frame.run,
            step=frame.step,
            score=ev,
            message=msg,
            ranks=(r,),
            hosts=_hosts(frame, r),
            metric=metrics[c],
            layer=layers[c],
            evidence={
                "confidence": conf,
                "z": z_cr,
                "direction": "high" if pos[c] >= neg[c] else "low",
                "top": [{"metric": metrics[i], "layer": layers[i], "evidence": float(col[i])} for i in top],
            },
        )

    def _materialize(self, upto: int | None = None) -> None:
        """Bring every cell up to step ``upto`` (default: the last judged step); the sparse path
        leaves idle cells behind."""
        if self._updated is None:
            return
        upto = self._steps if upto is None else upto
        idle = ((upto - self._updated) * self.drift).reshape(self._pos.shape)
        np.maximum(self._pos - idle, 0.0, out=self._pos)
        np.maximum(self._neg - idle, 0.0, out=self._neg)
        self._updated = None

    def metrics_view(self) -> dict[str, Any]:
        """Each rank's accumulated evidence over the threshold."""
        return {"rank_scores": self.rank_scores}

    def snapshot(self) -> dict[str, Any]:
        self._materialize()
        if self._sig is None:
            return {
                "sig": None,
                "obs_sig": self._obs_sig,
                "spread": None if self._spread is None else encode_array(self._spread),
            }
        return {
            "sig": self._sig,
            "pos": encode_array(self._pos),
            "neg": encode_array(self._neg),
            "steps": self._steps,
            "spread": None if self._spread is None else encode_array(self._spread),
            "obs_sig": self._obs_sig,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self._obs_sig = state.get("obs_sig")
        self._spread = None if state.get("spread") is None else decode_array(state["spread"])
        if state.get("sig") is None:
            self._sig = None
            return
        self._sig = state["sig"]
        self._pos = decode_array(state["pos"])
        self._neg = decode_array(state["neg"])
        self._steps = int(state["steps"])
        self._updated, self._scores = None, None


def _cusum_step(pos: np.ndarray, neg: np.ndarray, zc: np.ndarray, drift: float) -> None:
    """One step of the two-sided CUSUM, in place: ``pos = max(0, pos + zc - drift)``, ``neg`` likewise for -zc."""
    pos += zc
    pos -= drift
    np.maximum(pos, 0.0, out=pos)
    neg -= zc
    neg -= drift
    np.maximum(neg, 0.0, out=neg)


def _where(metric: str, layer: int | None) -> str:
    return metric if layer is None else f"{metric} layer {layer}"


def _hosts(frame: StepContext, r: int) -> tuple[str, ...]:
    return (frame.hosts[r],) if frame.hosts[r] else ()
