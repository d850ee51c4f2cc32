"""How a bad value made on one rank reaches the others of a parallel job (through the pipeline, a
tensor-parallel all-reduce, the gradient all-reduce), so the non-finite detector blames the rank it
began on. A hit is ``(rank, metric, layer, value)``, ``layer`` None for a scalar.
"""

from __future__ import annotations

import numpy as np
from sdcwatch.core.mesh import DIMS
from sdcwatch.detectors.peers import KEYS, group_keys

__all__ = [
    "ALL_REDUCED_METRICS",
    "BACKWARD_METRICS",
    "through_pipeline",
    "through_tensor_parallel",
    "first_in_tensor_group",
    "all_reduce_followers",
]

#: values computed from the all-reduced gradient or loss: identical on every rank, so a NaN there
#: spreads to all ranks and does not say which rank produced it
ALL_REDUCED_METRICS = ("grad_norm_global", "loss_global", "grad_cosine")
#: values of the backward pass: a bad value made in a later pipeline stage reaches the earlier
#: stages' gradients (and only them) through the backward pass
BACKWARD_METRICS = ("grad_norm_local", "gemm_bwd")


def through_pipeline(
    culprits: set[int], coords: np.ndarray | None, backward_only: set[int]
) -> tuple[set[int], set[int]]:
    """(culprits, ranks it reached through the pipeline): within one pipeline, the ranks with a bad
    forward value at the earliest stage made it (later stages received it forward, every stage in
    its gradients); with only bad gradients, the latest stage with one.

    One pipeline of four stages (ranks 0-3): stage 1 made it, stages 2 and 3 received it forward,
    stage 0 only in its gradients:

    >>> stages = np.array([[pp, 0, -1, -1, -1, -1] for pp in range(4)])  # pp, dp_replicate
    >>> through_pipeline({0, 1, 2, 3}, stages, backward_only={0})
    ({1}, {0, 2, 3})
    """
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


def through_tensor_parallel(
    culprits: set[int], coords: np.ndarray | None, hits: list[tuple[int, str, int | None, float]]
) -> tuple[set[int], set[int]]:
    """(culprits, ranks it reached through tensor parallelism): in each tensor-parallel group the
    ranks whose first bad forward value comes earliest in forward order (the lowest layer, its own
    attention logits first; else the lowest product with a bad output from a good input) made it."""
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
        if rank not in first or layer is None or metric in BACKWARD_METRICS or metric in ALL_REDUCED_METRICS:
            continue
        if metric in ("gemm_fwd", "gemm_out"):
            if (rank, layer) not in bad_inputs:
                first[rank][1] = min(first[rank][1], layer)
        elif metric not in ("gemm_in", "gemm_weight"):
            within = 0 if metric in ("attn_logit_max", "attn_logit_min") else 1
            first[rank][0] = min(first[rank][0], (layer, within))
    group = group_keys(coords[c], KEYS["tensor"])
    keys = [tuple(first[int(r)]) for r in c]
    blamed, reached = set(), set()
    for g in np.unique(group):
        members = np.nonzero(group == g)[0]
        earliest = min(keys[i] for i in members)
        unplaced = earliest == (never, np.inf)  # no layer or product says where: blame them all
        for i in members:
            (blamed if unplaced or keys[i] == earliest else reached).add(int(c[i]))
    return blamed, reached


def first_in_tensor_group(
    culprits: set[int], coords: np.ndarray | None, first: dict[int, float]
) -> tuple[set[int], set[int]]:
    """(culprits, tensor-parallel followers): in each tensor-parallel group of two or more culprits
    with ``tp`` coordinates, the ranks with the smallest ordinal where they first saw a bad value in
    their forward pass (``first``: rank -> ordinal) made it; groups without ordinals keep all theirs.

    Ranks 0 and 1 of one tensor-parallel group; rank 1 saw it first in its forward pass:

    >>> pair = np.array([[0, 0, -1, -1, -1, tp] for tp in range(2)])  # pp, dp_replicate, tp
    >>> first_in_tensor_group({0, 1}, pair, {0: 7.0, 1: 3.0})
    ({1}, {0})
    """
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


def all_reduce_followers(culprits: set[int], others: set[int], coords: np.ndarray | None) -> set[int]:
    """The ranks of ``others`` in a culprit's data-parallel group (all of them without coordinates):
    those an all-reduce with a culprit reaches."""
    if coords is None or not others or not culprits:
        return others
    peers = group_keys(coords, KEYS["peer"])
    mine = set(peers[sorted(culprits)].tolist())
    return {r for r in others if int(peers[r]) in mine}
