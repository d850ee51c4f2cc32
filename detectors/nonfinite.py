"""Non-finite values: NaN, Inf or |x| >= 1e10 (ATTNChecker's near-INF) anywhere in a step.

No warm-up and no history: a non-finite value is a critical finding at the very step it is seen,
naming the rank(s), the metric and the layer. With mesh coordinates, a rank whose bad values came
to it through the pipeline is not blamed: the later stages' forward values (the activations they
are sent) and the earlier stages' gradients (the backward pass) follow from the stage where the bad
value was made; and the ranks whose all-reduced values followed are counted within the culprit's
data-parallel group. Within a tensor-parallel group (the same coordinates but for ``tp``) the
culprit and its peers all hold the all-reduced residual stream, so all of them report a bad value
at the same layer; the rank that saw it first in its forward pass (the smallest
``nonfinite_first``, :mod:`sdcwatch.telemetry.probes.forward_order`) is blamed and the others are listed
as ``tensor_parallel_followers``. Records without that scalar (and ranks tied on it) are placed by
their first bad layer metric in forward order, as before.
A rank's own ``nonfinite`` counter (NaN/Inf the
probes saw in gradients or activations) counts too. A streak of non-finite steps keeps naming the rank(s) it began on while they stay
bad, and the incident book keeps one incident per onset (:mod:`sdcwatch.service.incidents`), so
a run that stays NaN for 16,000 steps raises one alert, not 16,000, and a later NaN on other ranks
(once the first fault's ranks are clean again) raises its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.validate import check_positive
from sdcwatch.detectors.base import SplitDetector, StepContext
from sdcwatch.detectors.registry import register
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.vocabulary import CANARY_PRODUCT, FIRST_BAD, RATIO_METRICS
from sdcwatch.core.mesh import DIMS
from sdcwatch.core.where import message_at
from sdcwatch.detectors.act_module import act_layer, act_modules, listed_hit
from sdcwatch.detectors.peers import KEYS, group_keys, known_coords, rank_label

__all__ = ["NonFiniteDetector"]

_COUNTERS = ("nonfinite",)  # scalars that count non-finite values seen inside the rank
#: bookkeeping counters and positions, not model values
_SKIP = ("emitter_dropped", FIRST_BAD, CANARY_PRODUCT)
#: values computed from the all-reduced gradient or loss: identical on every rank, so a NaN there
#: spreads to all ranks and does not say which rank produced it
_GLOBAL = ("grad_norm_global", "loss_global", "grad_cosine")
#: values of the backward pass: a bad value made in a later pipeline stage reaches the earlier
#: stages' gradients (and only them) through the backward pass
_BACKWARD = ("grad_norm_local", "gemm_bwd")


def _through_pipeline(
    culprits: set[int], coords: np.ndarray | None, backward_only: set[int]
) -> tuple[set[int], set[int]]:
    """(culprits, ranks it reached through the pipeline). Within one pipeline (the same
    coordinates but for ``pp`` and ``tp``) a bad forward value made at stage s reaches the later
    stages' forward values with the activations they are sent, and every stage's gradients with
    the backward pass: those ranks are not blamed, the ranks with a bad forward value at the
    earliest such stage are. When the pipeline has only bad gradients, the latest stage with one
    is where it began (the backward pass runs from the last stage to the first)."""
    if coords is None or len(culprits) < 2:
        return culprits, set()
    c = np.array(sorted(culprits))
    pp = coords[c, DIMS.index("pp")].astype(np.int64)
    if (pp < 0).all():
        return culprits, set()
    fwd = ~np.isin(c, sorted(backward_only))
    pipe = group_keys(coords[c], KEYS["pipeline"])
    n = int(pipe.max()) + 1
    first_fwd = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(first_fwd, pipe[fwd], pp[fwd])
    last = np.full(n, -1)
    np.maximum.at(last, pipe, pp)
    has_fwd = first_fwd[pipe] < np.iinfo(np.int64).max
    s0 = np.where(has_fwd, first_fwd[pipe], last[pipe])
    reached = np.where(has_fwd, (fwd & (pp > s0)) | ~fwd, pp < s0)
    return set(c[~reached].tolist()), set(c[reached].tolist())


def _through_tensor_parallel(
    culprits: set[int], coords: np.ndarray | None, hits: list[tuple[int, str, int | None, float]]
) -> tuple[set[int], set[int]]:
    """(culprits, ranks it reached through tensor parallelism). The ranks of one tensor-parallel
    group (the same coordinates but for ``tp``) all-reduce the row-parallel outputs of every block
    in the forward pass, so a bad value made in one rank's shard reaches its peers' residual stream
    in the same step. Per rank, the first bad forward value in forward order (the lowest layer;
    within a layer the attention logits of the rank's own heads before the block's output; then
    the lowest product that made a bad output from a good input) says where it was made: the ranks
    of a group whose first bad value is the earliest are blamed, the later ones reached."""
    if coords is None or len(culprits) < 2:
        return culprits, set()
    tp = DIMS.index("tp")
    c = np.array(sorted(culprits))
    if (coords[c, tp] < 0).all():
        return culprits, set()
    bad_inputs = {(h[0], h[2]) for h in hits if h[1] == "gemm_in"}
    never = (np.inf, np.inf)
    first: dict[int, list] = {int(r): [never, np.inf] for r in c}
    for rank, metric, layer, _ in hits:
        if rank not in first or layer is None or metric in _BACKWARD or metric in _GLOBAL:
            continue
        if metric in ("gemm_fwd", "gemm_out"):
            if (rank, layer) not in bad_inputs:
                first[rank][1] = min(first[rank][1], layer)
        elif metric not in ("gemm_in", "gemm_weight"):
            within = 0 if metric in ("attn_logit_max", "attn_logit_min") else 1
            first[rank][0] = min(first[rank][0], (layer, within))
    group = group_keys(coords[c], tuple(i for i, d in enumerate(DIMS) if d != "tp"))
    keys = [tuple(first[int(r)]) for r in c]
    blamed, reached = set(), set()
    for g in np.unique(group):
        members = np.nonzero(group == g)[0]
        earliest = min(keys[i] for i in members)
        unplaced = earliest == (never, np.inf)  # no layer or product says where: blame them all
        for i in members:
            (blamed if unplaced or keys[i] == earliest else reached).add(int(c[i]))
    return blamed, reached


def _first_in_tensor_group(
    culprits: set[int], coords: np.ndarray | None, first: dict[int, float]
) -> tuple[set[int], set[int]]:
    """(culprits, tensor-parallel followers). Within each tensor-parallel group of two or more
    culprits whose ranks all give a ``tp`` coordinate and at least one of which reported where in
    its forward pass it first saw a bad value (``first``: rank -> ordinal), the ranks with the
    smallest ordinal made it; the others (a later ordinal, or none: nothing of theirs was bad
    before the collective) received it through the tensor-parallel all-reduce. Other groups, and
    steps without ordinals (older probes), keep all their culprits."""
    if coords is None or len(culprits) < 2 or not first:
        return culprits, set()
    c = np.array(sorted(culprits))
    order = np.array([first.get(r, np.inf) for r in c.tolist()], float)
    group = group_keys(coords[c], KEYS["tensor"])
    n = int(group.max()) + 1
    lowest = np.full(n, np.inf)
    np.minimum.at(lowest, group, order)
    untensored = np.bincount(group, weights=coords[c, DIMS.index("tp")] < 0, minlength=n) > 0
    judged = (np.bincount(group, minlength=n) >= 2) & np.isfinite(lowest) & ~untensored
    later = judged[group] & (order > lowest[group])
    return set(c[~later].tolist()), set(c[later].tolist())


def _followers(culprits: set[int], others: set[int], coords: np.ndarray | None) -> set[int]:
    """The ranks of ``others`` in a culprit's data-parallel group (all of them without coordinates):
    those an all-reduce with a culprit reaches."""
    if coords is None or not others or not culprits:
        return others
    peers = group_keys(coords, KEYS["peer"])
    mine = set(peers[sorted(culprits)].tolist())
    return {r for r in others if int(peers[r]) in mine}


def _origin_order(hits: list[tuple[int, str, int | None, float]]):
    """Sort key that puts first the hit closest to where the bad value was made, named by the model
    layer (block) it is in: the residual stream or the largest attention logit of the lowest layer,
    else another metric of the lowest layer (``act_max`` last). The ``gemm_*`` metrics are indexed
    by product, not by layer, so they name the origin only when no layer metric went bad: then a
    product whose output is bad while its input is fine made it (``gemm_fwd`` or ``gemm_out``
    without ``gemm_in``), else the first product that received it. Scalars come last."""
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


@dataclass(frozen=True)
class NonFiniteConfig:
    """Settings of the non-finite detector ``[detectors.nonfinite]``."""

    limit: float = 1e10
    """A value of at least this magnitude counts as non-finite (ATTNChecker's near-INF)."""
    max_listed: int = 16
    """Most bad values a finding lists in its evidence."""

    def __post_init__(self) -> None:
        check_positive("nonfinite", limit=self.limit, max_listed=self.max_listed)


@register(default=True)
class NonFiniteDetector(SplitDetector):
    """Critical finding for any NaN, Inf or near-INF value, localised to rank, metric and layer."""

    name = "nonfinite"
    fault = "nonfinite"
    Config = NonFiniteConfig
    limit: float
    max_listed: int

    def __init__(self, config: NonFiniteConfig | None = None, /, **settings: Any) -> None:
        super().__init__(config, **settings)
        # the ranks blamed when the current non-finite streak began, and the streak's last step:
        # one step after a rank's NaN reaches the all-reduce, every replica's parameters are NaN
        # and every rank reports its own NaN; the streak keeps naming the rank it started on
        self._origin: tuple[int, ...] | None = None
        self._origin_step: int | None = None
        self._last_bad: int | None = None
        self._origin_where: tuple[str, int | None, int | None] | None = None  # (metric, layer, act_max module)
        self._masks: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._bwd: dict[tuple[str, ...], np.ndarray] = {}
        self._limits: dict[tuple[str, ...], np.ndarray] = {}

    def _columns(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(value columns, counter columns, all-reduced columns) of a scalar layout (cached)."""
        masks = self._masks.get(names)
        if masks is None:
            counters = np.array([n in _COUNTERS for n in names], bool)
            values = ~counters & np.array([n not in _SKIP for n in names], bool)
            is_global = np.array([n in _GLOBAL for n in names], bool)
            masks = self._masks[names] = (values, counters, is_global)
        return masks

    def _layer_limits(self, names: tuple[str, ...]) -> np.ndarray:
        """Per layer metric: ``limit``, or infinity for ratios to a bound (only NaN/Inf count there;
        a large ratio is the checksum detector's finding, not a near-INF value)."""
        limits = self._limits.get(names)
        if limits is None:
            limits = self._limits[names] = np.array([np.inf if n in RATIO_METRICS else self.limit for n in names])
        return limits

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
            values, counters, is_global = self._columns(frame.scalar_names)
            with np.errstate(invalid="ignore"):
                # the common case costs one reduction: every cell finite and small, no counter set
                calm = np.abs(S).max() < self.limit and not (counters.any() and (S[:, counters] > 0).any())
                if not calm:
                    bad = ~(np.abs(S) < self.limit) & frame.sent_scalars() & values[None, :]
                    own = bad & ~is_global[None, :]
                    local_ranks.update(np.nonzero(own.any(axis=1))[0].tolist())
                    backward = self._backward(frame.scalar_names)
                    forward_ranks.update(np.nonzero((own & ~backward[None, :]).any(axis=1))[0].tolist())
                    if counters.any():
                        counted = (S > 0) & counters[None, :]
                        counted_ranks.update(np.nonzero(counted.any(axis=1))[0].tolist())
                        bad |= counted
                    global_ranks.update(np.nonzero((bad & is_global[None, :]).any(axis=1))[0].tolist())
                    r, c = np.nonzero(bad)
                    n_bad += r.size
                    hits += [
                        (int(a), frame.scalar_names[b], act_layer(frame, S, a, b), float(S[a, b])) for a, b in zip(r, c)
                    ]
        L = frame.layers
        if L.size and not np.abs(L).max() < self.limit:  # NaN fails the comparison: look closer
            limits = self._layer_limits(frame.layer_names)
            with np.errstate(invalid="ignore"):
                bad = ~(np.abs(L) < limits[None, :, None]) & frame.sent_layers()
            if bad.any():
                r, m, lay = np.nonzero(bad)
                n_bad += r.size
                local_ranks.update(np.unique(r).tolist())
                forward_ranks.update(np.unique(r[~self._backward(frame.layer_names)[m]]).tolist())
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
        first = self._first_bad(frame, forward_ranks)
        if first:
            seen["first_bad"] = first
        modules = act_modules(frame, {h[0] for h in hits if h[1] == "act_max"})
        if modules:  # the leaf module each rank's act_max came from: it names the module
            seen["act_max_module"] = modules
        return seen

    @staticmethod
    def _first_bad(frame: StepFrame, ranks: set[int]) -> list[list[float]]:
        """[[rank, ordinal]] of ``ranks`` that sent ``nonfinite_first``."""
        return [[r, v] for r, v in frame.sent_positions(FIRST_BAD, ranks)]

    def _backward(self, names: tuple[str, ...]) -> np.ndarray:
        """Which of ``names`` are values of the backward pass (cached)."""
        mask = self._bwd.get(names)
        if mask is None:
            mask = self._bwd[names] = np.array([n in _BACKWARD for n in names], bool)
        return mask

    def judge(self, frame: StepContext, seen: dict[str, Any] | None) -> list[Finding]:
        """Name the ranks of a non-finite step, keeping the rank a non-finite streak began on."""
        if seen is None:
            self._origin = None
            return []
        hits = [(int(r), str(m), None if lay is None else int(lay), float(v)) for r, m, lay, v in seen["hits"]]
        modules = {int(r): int(m) for r, m in seen.get("act_max_module", ())}
        n_bad = int(seen["n_bad"])
        local_ranks, counted_ranks = set(seen["local"]), set(seen["counted"])
        global_ranks = set(seen["global"])
        # A value that is bad in a rank's own numbers (its loss, its local gradient, its layers)
        # names that rank. The all-reduced values (global gradient norm, global loss, the cosine
        # with the global gradient) go bad on every rank at once when one rank poisons the
        # all-reduce: they are a consequence and never blame a rank. A rank's non-finite counter
        # counts the all-reduced gradient too, so it names ranks only when no rank has a bad value
        # of its own (a NaN the probes saw inside an activation that reached nothing else).
        culprits = local_ranks or counted_ranks
        coords = known_coords(frame)
        # the streak goes on while its origin is still bad (or silent): one step after a rank's NaN
        # reaches the all-reduce every rank has bad values of its own, the origin's among them. A
        # new fault on other ranks while the origin is clean again is a new onset, judged afresh
        # (the all-reduced values and the counters that count them say nothing of who is bad)
        streak = (
            self._origin is not None
            and self._last_bad is not None
            and 0 < frame.step - self._last_bad <= 1
            and (not self._origin or bool(set(self._origin) & (culprits | set(seen.get("absent", ())))))
        )
        self._last_bad = frame.step
        downstream: set[int] = set()
        tensor_peers: set[int] = set()
        ordinals = {int(r): float(o) for r, o in seen.get("first_bad", ())}
        by_position = False
        if streak:
            culprits = set(self._origin)
        else:
            culprits, downstream = _through_pipeline(culprits, coords, set(seen.get("backward_only", ())))
            # where each rank saw it first in its forward pass decides; without positions (older
            # probes) or on a tie, where its first bad value lies in the layer metrics
            culprits, tensor_peers = _first_in_tensor_group(culprits, coords, ordinals)
            by_position = bool(tensor_peers)
            culprits, later = _through_tensor_parallel(culprits, coords, hits)
            tensor_peers |= later
            self._origin, self._origin_step = tuple(sorted(culprits)), frame.step
        ranks = tuple(sorted(culprits))
        own = [h for h in hits if h[0] in culprits] or hits
        # name the layer-level hit first: it localises better than a loss; the product that made a
        # bad value first, else the lowest layer the forward pass reached, a layer metric before act_max
        first = min(own, key=_origin_order(own))
        rank, metric, layer, value = first
        if ranks and rank not in culprits:  # the streak's origin was cut from a long list of hits
            rank = ranks[0]
        module = modules.get(rank) if metric == "act_max" else None
        if streak and self._origin_where is not None:
            metric, layer, module = self._origin_where  # where it began, not where it has spread to since
        else:
            self._origin_where = (metric, layer, module)
        if frame.world > 1 and ranks:
            on = rank_label(frame, rank)
            more = f" and {len(ranks) - 1} more rank(s)" if len(ranks) > 1 else ""
            followed = _followers(culprits, global_ranks - culprits, coords)
            spread = f"; the all-reduced values of {len(followed)} other rank(s) followed" if followed else ""
            if downstream:
                spread += f"; {len(downstream)} other rank(s) of its pipeline received it (activations, gradients)"
            if tensor_peers:
                at = ordinals.get(rank) if by_position else None
                if at is not None:
                    spread += f"; first in its tensor-parallel group's forward pass (position {at:g})"
                spread += f"; {len(tensor_peers)} other rank(s) of its tensor-parallel group received it (all-reduce)"
        elif frame.world > 1:
            on, more, spread = "the all-reduced values of every rank (not localised)", "", ""
        else:  # one process: nothing to localise, but say where it ran
            on, more, spread = rank_label(frame, rank), "", ""
        around = None
        if streak:
            msg = (
                f"non-finite values since step {self._origin_step}, which began on {on}{more}; "
                f"still non-finite at step {frame.step}"
            )
        else:
            # a finite value here is past the near-INF limit: call it what it is, not "non-finite"
            what = "non-finite value" if not math.isfinite(value) else "near-INF value"
            msg, around = message_at(
                f"{what} at step {frame.step}: ", metric, layer, f" = {value:.4g} on {on}{more}{spread}"
            )
        listed = own[: self.max_listed]
        return [
            Finding(
                detector=self.name,
                kind=IncidentKind.NONFINITE.value,
                severity=Severity.CRITICAL,
                run=frame.run,
                step=frame.step,
                score=float(n_bad),
                message=msg,
                around=around,
                ranks=ranks if frame.world > 1 else (),
                hosts=tuple(sorted({frame.hosts[r] for r in ranks} - {""})),
                metric=metric,
                layer=layer,
                evidence={
                    "values_bad": n_bad,
                    "ranks_with_own_bad_values": sorted(culprits),
                    "ranks_with_bad_all_reduced_values": sorted(global_ranks),
                    **({"pipeline_followers": sorted(downstream)[: self.max_listed]} if downstream else {}),
                    **({"tensor_parallel_followers": sorted(tensor_peers)[: self.max_listed]} if tensor_peers else {}),
                    **(
                        {"first_bad_position": {str(r): ordinals[r] for r in sorted(ordinals)[: self.max_listed]}}
                        if by_position
                        else {}
                    ),
                    **({"act_max_module": module} if module is not None else {}),
                    "hits": [listed_hit(h, modules) for h in listed],
                },
            )
        ]

    def snapshot(self) -> dict[str, Any]:
        return {
            "origin": None if self._origin is None else list(self._origin),
            "origin_step": self._origin_step,
            "last_bad": self._last_bad,
            "origin_where": None if self._origin_where is None else list(self._origin_where),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self._origin = None if state.get("origin") is None else tuple(int(r) for r in state["origin"])
        self._origin_step = state.get("origin_step")
        self._last_bad = state.get("last_bad")
        where = [*(state.get("origin_where") or [None]), None][:3]  # [metric, layer] when saved without module
        self._origin_where = (
            None if where[0] is None else (str(where[0]), *(w if w is None else int(w) for w in where[1:]))
        )
