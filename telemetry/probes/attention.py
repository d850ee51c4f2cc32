"""Attention probes: the per-layer statistics of q, k and the logits, who reports them, and how an
``nn.MultiheadAttention`` is read without changing it (docs/probes.md, "How the probes are built").
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

import torch
from sdcwatch.telemetry.probes.canary import canary_running
from torch import nn

if TYPE_CHECKING:
    from sdcwatch.telemetry.probes.watch import Watch

__all__ = [
    "observe_attention",
    "attention_stats",
    "attention_vector",
    "combine_attention",
    "finish_attention",
    "sampled_heads",
    "sampled_queries",
    "mha_qk_logits",
    "ATTENTION_WATCHES",
    "LIVE_WATCHES",
]

#: attention module -> [(watch, layer index)]; weak so a dropped model leaves no trace
ATTENTION_WATCHES: "weakref.WeakKeyDictionary[nn.Module, list[tuple[Watch, int]]]" = weakref.WeakKeyDictionary()
#: open watches: a module no setting named finds the watch of its model through them
LIVE_WATCHES: "weakref.WeakSet[Watch]" = weakref.WeakSet()


def observe_attention(
    layer: nn.Module, q: torch.Tensor, k: torch.Tensor, *, logits: torch.Tensor | None = None, causal: bool = True
) -> None:
    """Report one attention layer's q, k (batch, heads, time, d_head) to every watch attached to it.

    ``logits`` (pre-softmax, masked slots -inf), when given, are used as they are (a corrupted score
    GEMM shows); else sampled ones are recomputed. A module of a watched model becomes a layer at its
    first report. One dictionary look-up when no watch is attached.
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(
            f"observe_attention() takes the attention module, got {type(layer).__name__}; "
            "use watch.observe_attention(index, q, k) for a layer index"
        )
    if canary_running():
        return
    entries = getattr(layer, "_sdcwatch_watches", None)  # its list in ATTENTION_WATCHES, set by the watch
    if entries:
        if torch.compiler.is_compiling():  # the module, not its index: traced code then holds no index
            for entry in entries:
                if entry[0].enabled:
                    entry[0].observe_attention(layer, q, k, logits=logits, causal=causal)
            return
        for watch, index in entries:
            if watch.enabled:
                watch.observe_attention(index, q, k, logits=logits, causal=causal)
        return
    for watch in list(LIVE_WATCHES):  # a layer no setting named: it becomes one of its model's watch
        if layer in watch.module_names and watch.enabled and watch.config.attention != "none":
            watch.observe_attention(layer, q, k, logits=logits, causal=causal)


def sampled_heads(heads: int, n_head: int) -> slice:
    """The heads probed: ``heads`` of ``n_head``, evenly strided from head 0 (0 = all)."""
    if heads <= 0 or heads >= n_head:
        return slice(0, n_head)
    stride = n_head // heads
    return slice(0, stride * heads, stride)


def sampled_queries(queries: int, t: int) -> slice:
    """The query positions probed: ``queries`` strided positions from ``t // 4`` (early positions
    see too few keys for their entropy to mean much)."""
    start = t // 4
    stride = max(1, (t - start) // queries)
    return slice(start, min(t, start + stride * queries), stride)


def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    heads: int = 4,
    queries: int = 16,
    sequences: int = 0,
    causal: bool = True,
) -> torch.Tensor:
    """The :data:`ATTENTION_STATS` of one layer as a float32 (7,) tensor on the device: q and k norms
    over everything, the entropy (nats) over the sampled heads and queries of the first ``sequences``
    sequences (0 = all; mean per head, then mean and minimum over heads), the largest logit over
    the whole ``logits`` when given, else over the sampled ones.
    """
    with torch.no_grad():
        if q.dim() == 3:
            q, k = q.unsqueeze(1), k.unsqueeze(1)
        if q.dim() != 4 or k.dim() != 4:
            raise ValueError(f"q and k must be (batch, heads, time, d_head), got {tuple(q.shape)} and {tuple(k.shape)}")
        q, k = q.detach(), k.detach()
        n_head, t, d_head = q.shape[1:]
        qn = torch.linalg.vector_norm(q, dim=-1)
        kn = torch.linalg.vector_norm(k, dim=-1)
        seqs = slice(0, sequences if sequences > 0 else q.shape[0])
        hs, qs = sampled_heads(heads, n_head), sampled_queries(queries, t)
        if logits is not None:
            logits = logits.detach()
            sampled = logits[seqs, hs, qs]
            top = logits.amax()
        else:
            sampled = (q[seqs, hs, qs] @ k[seqs, hs].transpose(-2, -1)) * (1.0 / math.sqrt(d_head))
            if causal:
                positions = torch.arange(qs.start, qs.stop, qs.step, device=q.device)
                future = torch.arange(k.shape[2], device=q.device)[None, :] > positions[:, None]
                sampled = sampled.masked_fill(future, float("-inf"))
            top = sampled.amax()
        return attention_vector(sampled, qn, kn, top)


def attention_vector(sampled: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """The :data:`ATTENTION_STATS` vector from sampled logits (sequences, heads, queries, keys; masked
    slots -inf), the q and k norms and the largest logit; a fully masked row is left out of the entropy.
    """
    sampled = sampled.float()
    empty = (sampled == float("-inf")).all(-1, keepdim=True)
    logp = torch.log_softmax(sampled.masked_fill(empty, 0.0), dim=-1)
    # -sum p log p; masked keys have p = 0 and log p = -inf: clamping makes their term 0, not NaN
    per_row = -(logp.exp() * logp.clamp_min(-1e4)).sum(-1)
    weight = (~empty.squeeze(-1)).float()
    entropy = (per_row * weight).sum(dim=(0, 2)) / weight.sum(dim=(0, 2)).clamp_min(1.0)  # per sampled head
    return torch.stack([entropy.mean(), entropy.min(), qn.mean(), qn.amax(), kn.mean(), kn.amax(), top]).float()


#: Which of :data:`ATTENTION_STATS` average over observations (the others are extremes).
_MEAN_STATS = (True, False, True, False, True, False, False)
_MIN_STATS = (False, True, False, False, False, False, False)


def combine_attention(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two observations of one layer as one: means summed, the minimum the lower, maxima the higher (NaN kept)."""
    mean = torch.tensor(_MEAN_STATS, device=a.device)
    low = torch.tensor(_MIN_STATS, device=a.device)
    return torch.where(mean, a + b, torch.where(low, torch.minimum(a, b), torch.maximum(a, b)))


def finish_attention(acc: torch.Tensor, n: int) -> torch.Tensor:
    """The layer's statistics from ``n`` observations folded by :func:`combine_attention`."""
    if n == 1:
        return acc
    return torch.where(torch.tensor(_MEAN_STATS, device=acc.device), acc / n, acc)


def mha_project(m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of the first sequence, (1, heads, time, d_head), from an ``nn.MultiheadAttention``'s inputs."""
    with torch.no_grad():
        if query.dim() == 2:  # unbatched
            query, key = query.unsqueeze(0), key.unsqueeze(0)
        elif not m.batch_first:
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        query, key = query[:1], key[:1]
        e = m.embed_dim
        if m.in_proj_weight is not None:
            wq, wk = m.in_proj_weight[:e], m.in_proj_weight[e : 2 * e]
        else:
            wq, wk = m.q_proj_weight, m.k_proj_weight
        bq = bk = None
        if m.in_proj_bias is not None:
            bq, bk = m.in_proj_bias[:e], m.in_proj_bias[e : 2 * e]
        q = nn.functional.linear(query, wq, bq)
        k = nn.functional.linear(key, wk, bk)
        h = m.num_heads
        q = q.view(1, q.shape[1], h, e // h).transpose(1, 2)
        k = k.view(1, k.shape[1], h, e // h).transpose(1, 2)
        return q, k


_MHA_ARGS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


def mha_qk_logits(
    module: nn.MultiheadAttention, args: tuple, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k and (when masked) the logits of the first sequence, from a forward pre-hook's arguments."""
    bound = dict(zip(_MHA_ARGS, args)) | kwargs
    q, k = mha_project(module, bound["query"], bound["key"])
    with torch.no_grad():
        logits = None
        mask = bound.get("attn_mask")
        if mask is not None or bound.get("is_causal"):
            logits = (q[:1] @ k[:1].transpose(-2, -1)) / math.sqrt(q.shape[-1])
            if mask is not None:
                m = mask if mask.dim() == 2 else mask[: module.num_heads]
                logits = logits.masked_fill(m, float("-inf")) if m.dtype == torch.bool else logits + m
            else:
                t = logits.shape[-1]
                logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return q, k, logits
