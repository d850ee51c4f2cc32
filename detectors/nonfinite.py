"""Non-finite values: NaN, Inf or |x| >= 1e10 (ATTNChecker's near-INF) anywhere in a step, a
critical finding at that very step naming the rank it began on (not those it spread to,
:mod:`~sdcwatch.detectors.spread`), the metric, the layer and an ``act_max``'s leaf module. A streak
keeps naming the rank(s) it began on while they stay bad: one incident per onset, not per step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.model_place import message_at
from sdcwatch.core.vocabulary import CANARY_PRODUCT, FIRST_BAD, RATIO_METRICS
from sdcwatch.detectors.base import DetectorSettings, SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.peers import known_coords, rank_label
from sdcwatch.detectors.registry import register
from sdcwatch.detectors.spread import (
    ALL_REDUCED_METRICS,
    BACKWARD_METRICS,
    all_reduce_followers,
    first_in_tensor_group,
    through_pipeline,
    through_tensor_parallel,
)

__all__ = ["NonFiniteDetector"]

_COUNTERS = ("nonfinite",)  # scalars that count non-finite values seen inside the rank
#: bookkeeping counters and positions, not model values
_SKIP = ("emitter_dropped", FIRST_BAD, CANARY_PRODUCT)


def _origin_order(hits: list[tuple[int, str, int | None, float]]):
    """Sort key that puts first the hit closest to where the bad value was made: the lowest layer's
    residual stream or attention logit, its other metrics (``act_max`` last); then, indexed by
    product, a product with a bad output from a good input, the first that received it; scalars last."""
    bad_inputs = {(h[0], h[2]) for h in hits if h[1] == "gemm_in"}
    order = {"stream_max": 0, "attn_logit_max": 0, "attn_logit_min": 0}
    products = {"gemm_in": 5, "gemm_bwd": 6, "gemm_weight": 6}

    def key(h: tuple[int, str, int | None, float]) -> tuple:
        rank, metric, layer, _ = h
        if layer is None:
            return (7, 0, False, rank)
        if metric in ("gemm_fwd", "gemm_out"):
            return (4 if (rank, layer) not in bad_inputs else 5, layer, False, rank)
        if metric in products:
            return (products[metric], layer, False, rank)
        return (order.get(metric, 1), layer, metric == "act_max", rank)

    return key


@functools.lru_cache(maxsize=256)
def _columns(names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(value columns, counter columns, all-reduced columns) of a scalar layout."""
    counters = np.array([n in _COUNTERS for n in names], bool)
    values = ~counters & np.array([n not in _SKIP for n in names], bool)
    return values, counters, np.array([n in ALL_REDUCED_METRICS for n in names], bool)


@functools.lru_cache(maxsize=256)
def _layer_limits(names: tuple[str, ...], limit: float) -> np.ndarray:
    """Per layer metric: ``limit``, or infinity for ratios to a bound (only NaN/Inf count there;
    a large ratio is the checksum detector's finding, not a near-INF value)."""
    return np.array([np.inf if n in RATIO_METRICS else limit for n in names])


@functools.lru_cache(maxsize=256)
def _backward(names: tuple[str, ...]) -> np.ndarray:
    """Which of ``names`` are values of the backward pass."""
    return np.array([n in BACKWARD_METRICS for n in names], bool)


_Hit = tuple[int, str, int | None, float]  # (rank, metric, layer or None for a scalar, value)


def _act_layer(frame: StepFrame, S: np.ndarray, rank: int, column: int) -> int | None:
    """The layer of an ``act_max`` hit, from the rank's ``act_max_layer`` (None for other scalars)."""
    names = frame.scalar_names
    if names[column] != "act_max" or "act_max_layer" not in names:
        return None
    layer = S[rank, names.index("act_max_layer")]
    return int(layer) if np.isfinite(layer) and layer >= 0 else None


def _listed_hit(h: _Hit, modules: dict[int, int]) -> dict[str, Any]:
    """A listed hit; an ``act_max`` hit carries the leaf module it came from, when the rank sent it."""
    listed: dict[str, Any] = {"rank": h[0], "metric": h[1], "layer": h[2], "value": h[3]}
    if h[1] == "act_max" and modules.get(h[0]) is not None:
        listed["module"] = modules[h[0]]
    return listed


@dataclass(frozen=True)
class _BadStep:
    """A non-finite step's observation, read back from its JSON-safe form."""

    hits: list[_Hit]
    n_bad: int
    local: set[int]  # ranks with a bad value of their own
    counted: set[int]  # ranks whose own non-finite counter is set
    all_reduced: set[int]  # ranks with bad all-reduced values
    absent: set[int]  # ranks absent from the step (an incomplete step)
    backward_only: set[int]  # ranks whose own bad values are all gradients
    ordinals: dict[int, float]  # rank -> where in its forward pass it first saw a bad value
    modules: dict[int, int]  # rank -> the leaf module its act_max came from

    @classmethod
    def read(cls, seen: dict[str, Any]) -> "_BadStep":
        return cls(
            hits=[(int(r), str(m), None if lay is None else int(lay), float(v)) for r, m, lay, v in seen["hits"]],
            n_bad=int(seen["n_bad"]),
            local=set(seen["local"]),
            counted=set(seen["counted"]),
            all_reduced=set(seen["global"]),
            absent=set(seen.get("absent", ())),
            backward_only=set(seen.get("backward_only", ())),
            ordinals={int(r): float(o) for r, o in seen.get("first_bad", ())},
            modules={int(r): int(m) for r, m in seen.get("act_max_module", ())},
        )

    @property
    def suspects(self) -> set[int]:
        """The ranks with a bad value of their own (all-reduced values go bad everywhere and blame
        none); else those whose non-finite counter is set (it counts the all-reduced gradient too)."""
        return self.local or self.counted


@dataclass(frozen=True)
class _Blame:
    """Whom a non-finite step blames, and the ranks the bad value reached from them."""

    culprits: set[int]
    pipeline: set[int] = field(default_factory=set)  # received it through the pipeline
    tensor_parallel: set[int] = field(default_factory=set)  # received it through a tensor-parallel all-reduce
    by_position: bool = False  # a tensor-parallel group was told apart by where its ranks first saw it


class _Where(NamedTuple):
    """The hit a finding names, and the leaf module of an ``act_max`` hit."""

    rank: int
    metric: str
    layer: int | None
    value: float
    module: int | None


def _spread_text(
    frame: StepContext, bad: _BadStep, blame: _Blame, coords: np.ndarray | None, rank: int
) -> tuple[str, str, str]:
    """(on, more, spread) of a finding's message: the rank named, how many more were blamed, and
    the ranks the bad value reached from them."""
    ranks = blame.culprits
    if frame.world > 1 and ranks:
        more = f" and {len(ranks) - 1} more rank(s)" if len(ranks) > 1 else ""
        followed = all_reduce_followers(ranks, bad.all_reduced - ranks, coords)
        spread = f"; the all-reduced values of {len(followed)} other rank(s) followed" if followed else ""
        if blame.pipeline:
            spread += f"; {len(blame.pipeline)} other rank(s) of its pipeline received it (activations, gradients)"
        if blame.tensor_parallel:
            at = bad.ordinals.get(rank) if blame.by_position else None
            if at is not None:
                spread += f"; first in its tensor-parallel group's forward pass (position {at:g})"
            spread += (
                f"; {len(blame.tensor_parallel)} other rank(s) of its tensor-parallel group received it (all-reduce)"
            )
        return rank_label(frame, rank), more, spread
    if frame.world > 1:
        return "the all-reduced values of every rank (not localised)", "", ""
    return rank_label(frame, rank), "", ""  # one process: nothing to localise, but say where it ran


@dataclass(frozen=True)
class NonFiniteConfig(DetectorSettings, section="nonfinite", positive="limit max_listed"):
    """Settings of the non-finite detector ``[detectors.nonfinite]``."""

    limit: float = 1e10
    """A value of at least this magnitude counts as non-finite (ATTNChecker's near-INF)."""
    max_listed: int = 16
    """Most bad values a finding lists in its evidence."""


@register(default=True, order=10)
class NonFiniteDetector(SplitDetector):
    """Critical finding for any NaN, Inf or near-INF value, localised to rank, metric and layer."""

    name = "nonfinite"
    fault = "nonfinite"
    Config = NonFiniteConfig
    snapshot_fields = {
        "origin": "_origin",
        "origin_step": "_origin_step",
        "last_bad": "_last_bad",
        "origin_where": "_origin_where",
    }

    def __init__(self, config: NonFiniteConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        # the ranks blamed when the current streak began: a step after a rank's NaN reaches the
        # all-reduce every rank reports its own NaN, and the streak keeps naming its origin
        self._origin: tuple[int, ...] | None = None
        self._origin_step: int | None = None
        self._last_bad: int | None = None
        self._origin_where: tuple[str, int | None, int | None] | None = None  # (metric, layer, act_max module)

    def observe(self, frame: StepFrame) -> dict[str, Any] | None:
        """Every bad cell of the step and which ranks it blames (None on a clean step)."""
        hits: list[tuple[int, str, int | None, float]] = []  # (rank, metric, layer, value)
        n_bad = 0
        local_ranks: set[int] = set()  # ranks with a bad value of their own
        forward_ranks: set[int] = set()  # ranks with a bad value of their own in the forward pass
        counted_ranks: set[int] = set()  # ranks whose own non-finite counter is set
        global_ranks: set[int] = set()  # ranks with bad all-reduced values
        S = frame.scalars
        if S.size:
            values, counters, is_global = _columns(frame.scalar_names)
            with np.errstate(invalid="ignore"):
                # the common case costs one reduction: every cell finite and small, no counter set
                calm = np.abs(S).max() < self.limit and not (counters.any() and (S[:, counters] > 0).any())
                if not calm:
                    bad = ~(np.abs(S) < self.limit) & frame.sent_scalars() & values[None, :]
                    own = bad & ~is_global[None, :]
                    local_ranks.update(np.nonzero(own.any(axis=1))[0].tolist())
                    backward = _backward(frame.scalar_names)
                    forward_ranks.update(np.nonzero((own & ~backward[None, :]).any(axis=1))[0].tolist())
                    if counters.any():
                        counted = (S > 0) & counters[None, :]
                        counted_ranks.update(np.nonzero(counted.any(axis=1))[0].tolist())
                        bad |= counted
                    global_ranks.update(np.nonzero((bad & is_global[None, :]).any(axis=1))[0].tolist())
                    r, c = np.nonzero(bad)
                    n_bad += r.size
                    hits += [
                        (int(a), frame.scalar_names[b], _act_layer(frame, S, a, b), float(S[a, b]))
                        for a, b in zip(r, c)
                    ]
        L = frame.layers
        if L.size and not np.abs(L).max() < self.limit:  # NaN fails the comparison: look closer
            limits = _layer_limits(frame.layer_names, self.limit)
            with np.errstate(invalid="ignore"):
                bad = ~(np.abs(L) < limits[None, :, None]) & frame.sent_layers()
            if bad.any():
                r, m, lay = np.nonzero(bad)
                n_bad += r.size
                local_ranks.update(np.unique(r).tolist())
                forward_ranks.update(np.unique(r[~_backward(frame.layer_names)[m]]).tolist())
                hits += [(int(a), frame.layer_names[b], int(c), float(L[a, b, c])) for a, b, c in zip(r, m, lay)]
        if not hits:
            return None
        if len(hits) > 4 * self.max_listed:  # keep the observation small: the hits a finding can name
            culprits = local_ranks or counted_ranks
            order = sorted(hits, key=lambda h: (h[0] not in culprits, h[2] is None, h[0]))
            # the culprits' layer hits stay whole (a few per product): the origin is read from them
            own = [h for h in order if h[0] in culprits and h[2] is not None][: 16 * self.max_listed]
            hits = own + [h for h in order if not (h[0] in culprits and h[2] is not None)][: 2 * self.max_listed]
        seen = {
            "hits": hits,
            "n_bad": n_bad,
            "local": sorted(local_ranks),
            "counted": sorted(counted_ranks),
            "global": sorted(global_ranks),
        }
        if not frame.complete:  # a streak's origin may be among them: it says nothing this step
            seen["absent"] = np.flatnonzero(~frame.present).tolist()
        if local_ranks - forward_ranks:  # ranks whose own bad values are all gradients
            seen["backward_only"] = sorted(local_ranks - forward_ranks)
        first = [[r, v] for r, v in frame.sent_positions(FIRST_BAD, forward_ranks)]
        if first:  # where in its forward pass each rank first saw a bad value
            seen["first_bad"] = first
        act_ranks = {h[0] for h in hits if h[1] == "act_max"}
        modules = [[r, int(v)] for r, v in frame.sent_positions("act_max_module", act_ranks, 1 << 31)]
        if modules:  # the leaf module (an index into the rank's module names) each rank's act_max came from
            seen["act_max_module"] = modules
        return seen

    def judge(self, frame: StepContext, seen: dict[str, Any] | None) -> list[Finding]:
        """Name the ranks of a non-finite step, keeping the rank a non-finite streak began on."""
        if seen is None:
            self._origin = None
            return []
        bad = _BadStep.read(seen)
        coords = known_coords(frame)
        streak = self._continues_streak(frame.step, bad)
        self._last_bad = frame.step
        blame = _Blame(set(self._origin)) if streak else self._blame_onset(frame.step, bad, coords)
        own = [h for h in bad.hits if h[0] in blame.culprits] or bad.hits
        where = self._where(bad, blame, own, streak)
        msg, around = self._message(frame, streak, where, _spread_text(frame, bad, blame, coords, where.rank))
        ranks = tuple(sorted(blame.culprits))
        return [
            Finding.at(
                frame,
                self.name,
                IncidentKind.NONFINITE,
                Severity.CRITICAL,
                float(bad.n_bad),
                msg,
                around=around,
                ranks=ranks,
                metric=where.metric,
                layer=where.layer,
                evidence=self._evidence(bad, blame, where, own[: self.max_listed]),
            )
        ]

    def _continues_streak(self, step: int, bad: _BadStep) -> bool:
        """Whether the step goes on with the current streak: the next step, its origin still bad (or
        silent). A new fault on other ranks while the origin is clean again is a new onset."""
        return (
            self._origin is not None
            and self._last_bad is not None
            and 0 < step - self._last_bad <= 1
            and (not self._origin or bool(set(self._origin) & (bad.suspects | bad.absent)))
        )

    def _blame_onset(self, step: int, bad: _BadStep, coords: np.ndarray | None) -> _Blame:
        """The culprits of a new onset: the suspects less the ranks it reached through the pipeline
        and the tensor-parallel all-reduce; they become the streak's origin."""
        culprits, downstream = through_pipeline(bad.suspects, coords, bad.backward_only)
        # where each rank saw it first in its forward pass decides; without positions (older
        # probes) or on a tie, where its first bad value lies in the layer metrics
        culprits, tensor_peers = first_in_tensor_group(culprits, coords, bad.ordinals)
        by_position = bool(tensor_peers)
        culprits, later = through_tensor_parallel(culprits, coords, bad.hits)
        self._origin, self._origin_step = tuple(sorted(culprits)), step
        return _Blame(culprits, downstream, tensor_peers | later, by_position)

    def _where(self, bad: _BadStep, blame: _Blame, own: list[_Hit], streak: bool) -> _Where:
        """The hit the finding names: the layer-level hit first (it localises better than a loss):
        the product that made a bad value first, else the lowest layer the forward pass reached, a
        layer metric before act_max. A streak names where it began, not where it has spread to since."""
        rank, metric, layer, value = min(own, key=_origin_order(own))
        if blame.culprits and rank not in blame.culprits:  # the streak's origin was cut from a long list of hits
            rank = min(blame.culprits)
        module = bad.modules.get(rank) if metric == "act_max" else None
        if streak and self._origin_where is not None:
            metric, layer, module = self._origin_where
        else:
            self._origin_where = (metric, layer, module)
        return _Where(rank, metric, layer, value, module)

    def _message(self, frame: StepContext, streak: bool, where: _Where, on: tuple[str, str, str]) -> tuple[str, Any]:
        """(message, around): the onset's bad value and where it spread to, or the streak it goes on with."""
        named, more, spread = on
        if streak:
            return (
                f"non-finite values since step {self._origin_step}, which began on {named}{more}; "
                f"still non-finite at step {frame.step}"
            ), None
        # a finite value here is past the near-INF limit: call it what it is, not "non-finite"
        what = "non-finite value" if not math.isfinite(where.value) else "near-INF value"
        return message_at(
            f"{what} at step {frame.step}: ",
            where.metric,
            where.layer,
            f" = {where.value:.4g} on {named}{more}{spread}",
        )

    def _evidence(self, bad: _BadStep, blame: _Blame, where: _Where, listed: list[_Hit]) -> dict[str, Any]:
        """The finding's evidence: the counts, the culprits, whom it reached, and the hits listed."""
        out: dict[str, Any] = {
            "values_bad": bad.n_bad,
            "ranks_with_own_bad_values": sorted(blame.culprits),
            "ranks_with_bad_all_reduced_values": sorted(bad.all_reduced),
        }
        if blame.pipeline:
            out["pipeline_followers"] = sorted(blame.pipeline)[: self.max_listed]
        if blame.tensor_parallel:
            out["tensor_parallel_followers"] = sorted(blame.tensor_parallel)[: self.max_listed]
        if blame.by_position:
            out["first_bad_position"] = {str(r): bad.ordinals[r] for r in sorted(bad.ordinals)[: self.max_listed]}
        if where.module is not None:
            out["act_max_module"] = where.module
        out["hits"] = [_listed_hit(h, bad.modules) for h in listed]
        return out
