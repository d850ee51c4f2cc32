"""Replica divergence: values every data-parallel replica must hold bit for bit (fingerprints, the
all-reduced gradient norm), voted per step within each replica group; no majority is a split that
blames no rank. The canaries (:data:`PEER_VOTED`, from unsharded weights) are voted within the peer
group, and one that disagrees alike on a whole FSDP shard group is not blamed on the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import IncidentKind
from sdcwatch.core.mesh import DIMS, format_coords, replica_key
from sdcwatch.core.model_place import message_at, where
from sdcwatch.core.vocabulary import CANARY_PRODUCT
from sdcwatch.detectors.base import DetectorSettings, SplitDetector, StepContext
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.peers import Groups, coords_of, group_keys, known_coords, rank_label
from sdcwatch.detectors.registry import register

__all__ = ["ReplicaDivergenceDetector", "ReplicaConfig", "majority", "checked_product", "PEER_VOTED"]

#: Float scalars that must agree exactly across replicas (compared by their bits).
REPLICA_SCALARS = ("grad_norm_global",)
#: Fingerprints of unsharded computations: equal across the whole peer group, voted there.
PEER_VOTED = frozenset({"canary_fp", "gemm_canary_fp"})
#: The per-product canary's fingerprint: which product it checked comes with it (``CANARY_PRODUCT``).
_PRODUCT_FP = "gemm_canary_fp"


def checked_product(frame: StepFrame, ranks: Any) -> int | None:
    """The product the per-product canary checked at ``frame``'s step (the index every rank sends
    as ``gemm_canary_product`` with its ``gemm_canary_fp``; ingest bounds it as a counter): the value
    most of ``ranks`` sent, when it is a whole number; None when none sent one (older probes)."""
    col = frame.scalar(CANARY_PRODUCT)
    if col is None:
        return None
    v = col[np.asarray(ranks, np.int64)]
    v = v[np.isfinite(v) & (v >= 0) & (v == np.floor(v))]
    if not v.size:
        return None
    values, counts = np.unique(v, return_counts=True)
    return int(values[counts.argmax()])


def majority(values: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """(majority value or None, mask of ranks that differ from it) for a 1-D array of bit patterns."""
    first = values[0]
    if (values == first).all():  # the healthy fast path
        return first, np.zeros(values.shape, bool)
    uniq, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    top = counts.argmax()
    if counts[top] * 2 <= values.size:
        return None, np.ones(values.shape, bool)
    return uniq[top], inverse.reshape(values.shape) != top


def _own_compute(frame: StepFrame, odd: np.ndarray, have: np.ndarray) -> np.ndarray:
    """The ranks of ``odd`` whose canary disagrees through their own compute: not a whole FSDP shard
    group (the ranks that all-gather one weight) disagreeing alike, whose gathered weight changed in
    one member's shard (``param_fp`` and ``gemm_weight`` name that member)."""
    coords = known_coords(frame)
    if coords is None or odd.size < 2:
        return odd
    gather = group_keys(coords, _GATHER)
    holders = np.bincount(gather[have], minlength=int(gather.max()) + 1)
    flagged = np.bincount(gather[odd], minlength=holders.size)
    whole = (flagged == holders) & (holders > 1)
    return odd[~whole[gather[odd]]]


#: Columns of an FSDP shard group's key: every mesh dim but ``dp_shard``.
_GATHER = tuple(i for i, d in enumerate(DIMS) if d != "dp_shard")


@dataclass(frozen=True)
class ReplicaConfig(DetectorSettings, section="replica", positive="min_world max_listed"):
    """Settings of the replica-divergence detector ``[detectors.replica]``."""

    min_world: int = 3
    """Fewest ranks holding a value for a majority vote on it (in the world, and in a replica group)."""
    max_listed: int = 16
    """Most ranks a finding names in its message and evidence."""


@register(default=True, order=60)
class ReplicaDivergenceDetector(SplitDetector):
    """Critical ``replica_divergence`` naming the rank(s) whose replicated values differ."""

    name = "replica"
    fault = "replica"
    Config = ReplicaConfig

    def _columns(self, frame: StepFrame):
        """(name, bit patterns, which ranks hold it) of every value the replicas must agree on."""
        for j, name in enumerate(frame.fp_names):
            have = frame.fp_present[:, j] & frame.present
            yield name, frame.fingerprints[:, j], have
        for name in REPLICA_SCALARS:
            col = frame.scalar(name)
            if col is not None:
                have = np.isfinite(col) & frame.present
                yield name, np.ascontiguousarray(col).view(np.uint64), have

    def observe(self, frame: StepFrame) -> dict[str, Any] | None:
        """The majority vote of the step: odd ranks per value, values with no majority (None if all agree)."""
        if frame.world < self.min_world:
            return None
        if not frame.replicas.trivial:
            return self._observe_groups(frame)
        odd_by_metric: dict[str, list[int]] = {}
        split: list[str] = []
        for name, bits, have in self._columns(frame):
            idx = np.flatnonzero(have)
            if idx.size < self.min_world:
                continue
            value, differs = majority(bits[idx])
            if value is None:
                split.append(name)
            elif differs.any():
                odd_by_metric[name] = idx[differs].tolist()
        if not odd_by_metric and not split:
            return None
        return self._with_product(frame, {"odd": odd_by_metric, "split": split})

    @staticmethod
    def _with_product(frame: StepFrame, vote: dict[str, Any]) -> dict[str, Any]:
        """``vote``, with the product the canary checked when the canary is among what disagrees: the
        one the ranks it names checked (under pipeline parallelism each stage rotates over its own
        products: another stage's ranks checked another one at the same step)."""
        if _PRODUCT_FP in vote["odd"] or _PRODUCT_FP in vote["split"]:
            ranks = vote["odd"].get(_PRODUCT_FP) or (vote.get("split_ranks") or {}).get(_PRODUCT_FP)
            if not ranks:  # a split over every rank (no groups): all of them
                j = frame.fp_names.index(_PRODUCT_FP)
                ranks = np.flatnonzero(frame.fp_present[:, j] & frame.present)
            product = checked_product(frame, ranks)
            if product is not None:
                vote["product"] = product
        return vote

    def _observe_groups(self, frame: StepFrame) -> dict[str, Any] | None:
        """The vote within each replica group (peer group for :data:`PEER_VOTED`): one comparison
        of every rank with its group's first holder finds the groups that disagree; only those are
        voted on, one by one."""
        odd_by_metric: dict[str, list[int]] = {}
        split: list[str] = []
        split_ranks: dict[str, list[int]] = {}
        for name, bits, have in self._columns(frame):
            replicas: Groups = frame.peers if name in PEER_VOTED else frame.replicas
            ids = replicas.ids
            idx = np.flatnonzero(have)
            if idx.size < 2:
                continue
            gid = ids[idx]
            first = np.full(replicas.n, -1, np.int64)
            first[gid[::-1]] = idx[::-1]  # the lowest rank holding the value in each group
            differs = bits[idx] != bits[first[gid]]
            if not differs.any():  # the healthy fast path
                continue
            for g in np.unique(gid[differs]).tolist():
                members = idx[gid == g]
                value, odd = majority(bits[members]) if members.size >= self.min_world else (None, None)
                if value is None:
                    if name not in split:
                        split.append(name)
                    split_ranks.setdefault(name, []).extend(members.tolist())
                else:
                    bad = members[odd]
                    if name in PEER_VOTED:
                        bad = _own_compute(frame, bad, idx)
                    if bad.size:
                        odd_by_metric.setdefault(name, []).extend(bad.tolist())
        if not odd_by_metric and not split:
            return None
        out: dict[str, Any] = {"odd": odd_by_metric, "split": split}
        if split_ranks:
            out["split_ranks"] = {k: v[: 4 * self.max_listed] for k, v in split_ranks.items()}
        return self._with_product(frame, out)

    def judge(self, frame: StepContext, vote: dict[str, Any] | None) -> list[Finding]:
        if vote is None:
            return []
        odd_by_metric: dict[str, list[int]] = vote["odd"]
        split: list[str] = vote["split"]
        split_ranks: dict[str, list[int]] = vote.get("split_ranks") or {}
        product = vote.get("product")
        head, tail, ranks = f"replicas split at step {frame.step}: no majority on ", "", ()
        if odd_by_metric:
            ranks = tuple(sorted({int(r) for v in odd_by_metric.values() for r in v}))
            who = ", ".join(rank_label(frame, r)[5:] for r in ranks[: self.max_listed])
            head = (
                f"SDC suspected: replica divergence at step {frame.step}: rank {who} disagree(s) with the majority on "
            )
            metrics, score = list(odd_by_metric), float(len(ranks))
            named = {k: [int(r) for r in v[: self.max_listed]] for k, v in odd_by_metric.items()}
            evidence: dict[str, Any] = {"metrics": named, "split": split}
        elif split_ranks:  # replica groups split: their ranks disagree, none can be blamed
            members = [int(r) for r in split_ranks.get(split[0], [])]
            at = coords_of(known_coords(frame), members[0]) if members else {}
            shard = format_coords(dict(replica_key(at)))
            listed = ", ".join(str(r) for r in members[: self.max_listed])
            among = f" among the replicas of {shard}" if shard else ""
            tail = f"{among} (ranks {listed}; too few to tell which is wrong)"
            metrics, score = split, float(len(members))
            kept = {k: [int(r) for r in v[: self.max_listed]] for k, v in split_ranks.items()}
            evidence = {"split": split, "split_ranks": kept}
        else:
            metrics, score, evidence = split, float(frame.world), {"split": split}
        if product is not None:
            evidence["gemm_canary_product"] = int(product)
        kind, severity = IncidentKind.REPLICA_DIVERGENCE, Severity.CRITICAL
        place = _on(head, metrics, product, tail)
        return [Finding.at(frame, self.name, kind, severity, score, ranks=ranks, evidence=evidence, **place)]


def _on(head: str, metrics: list[str], product: int | None, tail: str = "") -> dict[str, Any]:
    """A finding's message, place and metric: ``head``, ``metrics`` (the first is the finding's
    place), ``tail``. The canary's product is named like a layer: an index its metric gives meaning."""
    first, *rest = metrics
    layer = product if first == _PRODUCT_FP else None
    others = "".join(", " + where(m, product if m == _PRODUCT_FP else None, noun="product") for m in rest)
    message, around = message_at(head, first, layer, others + tail, noun="product")
    return {"message": message, "around": around, "metric": first, "layer": layer}
