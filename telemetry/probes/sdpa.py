"""Attention without the model's cooperation: a forward pass's attention calls, seen from outside (docs/probes.md)."""

from __future__ import annotations

import inspect
import math
import os
import textwrap
import warnings
from typing import TYPE_CHECKING, Any

import torch
from sdcwatch.telemetry.probes.attention import attention_stats, attention_vector, sampled_heads, sampled_queries
from sdcwatch.telemetry.probes.canary import canary_running
from sdcwatch.telemetry.probes.compiled import running_compiled
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from sdcwatch.telemetry.probes.watch import Watch

__all__ = ["AttentionTap", "sdpa_attention_stats", "attention_blind_spots", "REPORT_HINT"]

_SDPA = F.scaled_dot_product_attention
_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MAX_DEPTH = 40  # frames searched for the calling module
#: Names under which eager attention code holds q and k when it calls softmax (Hugging Face, nanoGPT, Llama).
_QK_NAMES = (("query", "key_states"), ("query_states", "key_states"), ("query", "key"), ("q", "k"), ("xq", "xk"))
#: Hugging Face attention implementations the tap sees (the others run kernels outside PyTorch).
HF_VISIBLE = ("sdpa", "eager")

REPORT_HINT = (
    "report each layer from its forward with sdcwatch.telemetry.observe_attention(self, q, k) "
    "(q, k after RoPE, shape (batch, heads, time, d_head); no other change needed)"
)


def _expand_kv(k: torch.Tensor, n_head: int) -> torch.Tensor:
    """k with one head per query head (grouped-query attention shares each k head among a group)."""
    if k.shape[1] == n_head:
        return k
    if n_head % k.shape[1]:
        raise ValueError(f"{n_head} query heads do not divide into {k.shape[1]} key heads")
    return k.repeat_interleave(n_head // k.shape[1], dim=1)


def sdpa_attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    heads: int = 4,
    queries: int = 16,
    sequences: int = 0,
) -> torch.Tensor:
    """The attention statistics of one ``F.scaled_dot_product_attention(q, k, v, ...)`` call, with the
    kernel's semantics (grouped kv heads, bool or float ``attn_mask``, top-left ``is_causal``,
    ``scale``); only the sampled heads and query rows are recomputed.
    """
    with torch.no_grad():
        q, k = q.detach(), k.detach()
        if q.dim() != 4 or k.dim() != 4:
            raise ValueError(f"q and k must be (batch, heads, time, d_head), got {tuple(q.shape)} and {tuple(k.shape)}")
        b, n_head, tq, d = q.shape
        tk = k.shape[2]
        qn = torch.linalg.vector_norm(q, dim=-1)
        kn = torch.linalg.vector_norm(k, dim=-1)
        seqs = slice(0, sequences if sequences > 0 else b)
        hs, qs = sampled_heads(heads, n_head), sampled_queries(queries, tq)
        if k.shape[1] != n_head:
            if n_head % k.shape[1]:
                raise ValueError(f"{n_head} query heads do not divide into {k.shape[1]} key heads")
            kv = torch.arange(n_head, device=k.device)[hs] // (n_head // k.shape[1])
            ks = k[seqs][:, kv]
        else:
            ks = k[seqs, hs]
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        sampled = (q[seqs, hs, qs].float() @ ks.float().transpose(-2, -1)) * scale
        positions = torch.arange(qs.start, qs.stop, qs.step, device=q.device)
        if is_causal:
            future = torch.arange(tk, device=q.device)[None, :] > positions[:, None]
            sampled = sampled.masked_fill(future, float("-inf"))
        if attn_mask is not None:
            mask = torch.broadcast_to(attn_mask.detach(), (b, n_head, tq, tk))[seqs, hs, qs]
            if mask.dtype == torch.bool:
                sampled = sampled.masked_fill(~mask, float("-inf"))
            else:
                sampled = sampled + mask.float()
        return attention_vector(sampled, qn, kn, sampled.amax())


class AttentionTap(TorchFunctionMode):
    """Sees the attention calls of one watch's model while entered: on a sampled step, between
    :meth:`forward_begin` and :meth:`forward_end` (hooked on the model's call by :meth:`install`, or
    called by an integration); the mode is pushed once however deeply they nest.
    """

    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch
        self.depth = 0
        self.calls = 0  # attention calls seen (sampled steps only)
        self.forwards = 0  # forward passes the tap was entered for
        self.modules = watch.module_names
        self._stack: list[bool] = []
        self._warned = False
        # a sampled forward ran compiled, where the tap sees nothing (it finds the layer on the
        # Python call stack, which compiled code does not have)
        self.compiled = False
        # every layer found when attaching reports itself: never entered (decided once, so that
        # compiled code sees the same mode stack on every sampled step)
        self.reported = self._all_report_themselves()

    def install(self, model: nn.Module) -> list[Any]:
        """Bracket ``model``'s forward; warn once about attention it cannot see. Returns the hooks."""
        handles = [
            model.register_forward_pre_hook(lambda m, a: self.forward_begin()),
            model.register_forward_hook(lambda m, a, o: self.forward_end(), always_call=True),
        ]
        if self.watch.config.attention == "auto":
            blind = attention_blind_spots(model)
            if blind:
                self.warn_blind(f"attention not measured: {'; '.join(blind)}")
        return handles

    def forward_begin(self) -> None:
        w = self.watch
        # training forwards of sampled steps only: an evaluation or generation pass is not the step's
        entered = w.enabled and w.attention_on and w.model.training and not canary_running()
        if entered and self.reported:
            entered = False  # every layer reports itself: the tap would see nothing new
        elif entered and not w.config.attention_compiled and running_compiled():
            # a compiled forward: the tap would see nothing, and every compiled frame would compile
            # once more for the mode on the stack
            self.compiled = True
            entered = False
        elif entered and self.forwards and not self.calls and self._all_report_themselves():
            # every attention call of a sampled forward came from layers that report themselves:
            # the tap would see nothing new, and a TorchFunctionMode costs on every torch call
            entered = False
        self._stack.append(entered)
        if entered:
            self.forwards += 1
            self.depth += 1
            if self.depth == 1:
                self.__enter__()

    def _all_report_themselves(self) -> bool:
        layers = self.watch.attention
        return bool(layers.layers) and all(map(layers.reports_itself, layers.layers))

    def forward_end(self) -> None:
        if self._stack and self._stack.pop() and self.depth > 0:
            self.depth -= 1
            if self.depth == 0:
                self.__exit__(None, None, None)

    def close(self) -> None:
        while self._stack:
            self.forward_end()

    def warn_blind(self, what: str) -> None:
        """Say once that attention is not measured, and how to report it."""
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"sdcwatch probes: {what}. Layer statistics stay off until you {REPORT_HINT}.", RuntimeWarning, stacklevel=4
        )

    def check_seen(self) -> None:
        """At a recorded step: a forward pass ran under the tap and no layer showed up."""
        if self.compiled and not self.watch.n_layers:
            self.warn_blind("the forward pass is compiled (torch.compile), where the attention tap sees nothing")
        elif self.forwards and not self.watch.n_layers:
            self.warn_blind("no attention call was seen in a sampled forward pass")

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA or func in _SOFTMAX:
            if torch.compiler.is_compiling() and not self.watch.config.attention_compiled:
                self.compiled = True  # a compiled part of an eager forward: see forward_begin
            else:
                self._observe(func, args, kwargs)
        return func(*args, **kwargs)

    # under torch.compile: a graph break here, the observation runs eagerly (torch.compiler.disable,
    # importing torch._dynamo, seconds, at the first call rather than with this module)
    @torch._disable_dynamo
    def _observe(self, func: Any, args: tuple, kwargs: dict) -> None:
        try:
            if func is _SDPA:
                self._sdpa(*args, **kwargs)
            else:
                self._softmax(*args, **kwargs)
        except Exception as exc:  # a shape we do not understand must not stop the forward pass
            self.watch.fail(exc)

    # -- the calls ----------------------------------------------------------------------------------
    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: Any = None,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        **_: Any,
    ) -> None:
        if query.dim() != 4:
            return
        layer = self._layer(inspect.currentframe().f_back)
        if layer is None:
            return
        stats = sdpa_attention_stats(
            query, key, attn_mask=attn_mask, is_causal=bool(is_causal), scale=scale, **self._sampling()
        )
        self.calls += 1
        self.watch.attention.record(layer, stats)

    def _softmax(self, logits: Any, dim: Any = None, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("dim", dim) not in (-1, 3) or not isinstance(logits, torch.Tensor) or logits.dim() != 4:
            return
        frame = inspect.currentframe().f_back
        while frame is not None and (
            frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
        ):
            frame = frame.f_back  # up to the code that called softmax
        if frame is None:
            return
        qk = _find_qk(frame.f_locals, logits)
        if qk is None:
            return
        layer = self._layer(frame)
        if layer is None:
            return
        q, k = qk
        stats = attention_stats(q, _expand_kv(k, q.shape[1]), logits=logits, causal=False, **self._sampling())
        self.calls += 1
        self.watch.attention.record(layer, stats)

    def _sampling(self) -> dict[str, int]:
        cfg = self.watch.config
        return {"heads": cfg.heads, "queries": cfg.queries, "sequences": cfg.sequences}

    def _layer(self, frame: Any) -> int | None:
        """The layer index of the innermost module of the watched model on the call stack that is (or
        becomes) a layer; None when there is none, or when it reports itself."""
        depth = 0
        while frame is not None and depth < _MAX_DEPTH:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                obj = frame.f_locals.get("self")
                if isinstance(obj, nn.Module) and obj in self.modules:
                    if self.watch.attention.reports_itself(obj):
                        return None
                    index = self.watch.attention.layer_of(obj)
                    if index is not None:  # else a module inside the layer the settings name: go up
                        return index
            frame = frame.f_back
            depth += 1
        return None


def _find_qk(local: dict, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q and k among the caller's locals whose shapes give ``logits`` (batch, heads, Lq, Lk)."""
    b, h, tq, tk = logits.shape
    for qn, kn in _QK_NAMES:
        q, k = local.get(qn), local.get(kn)
        if (
            isinstance(q, torch.Tensor)
            and isinstance(k, torch.Tensor)
            and q.dim() == 4
            and k.dim() == 4
            and tuple(q.shape[:3]) == (b, h, tq)
            and k.shape[0] == b
            and k.shape[2] == tk
            and k.shape[-1] == q.shape[-1]
            and h % k.shape[1] == 0
        ):
            return q, k
    return None


def attention_blind_spots(model: nn.Module) -> list[str]:
    """What the probes cannot see in ``model``, one line per reason: a Hugging Face
    ``attn_implementation`` other than "sdpa" or "eager", or a module that looks like attention whose
    forward calls neither ``scaled_dot_product_attention`` nor ``softmax`` nor reports itself.
    """
    for _, m in model.named_modules():
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if isinstance(impl, str):  # a Hugging Face model (or one inside a LightningModule)
            if impl in HF_VISIBLE:
                return []
            return [
                f"attn_implementation={impl!r} computes attention outside PyTorch's "
                f"scaled_dot_product_attention (use 'sdpa' or 'eager' to have it measured)"
            ]
    blind = []
    for name, m in model.named_modules():
        if not name or isinstance(m, nn.MultiheadAttention) or getattr(m, "_sdcwatch_attention", False):
            continue
        kind = type(m).__name__.lower()
        last = name.rsplit(".", 1)[-1].lower()
        if "attention" not in kind and "attn" not in kind and last not in ("attn", "attention", "self_attn"):
            continue
        if any(isinstance(c, nn.MultiheadAttention) for c in m.children()):
            continue
        source = _source(type(m).forward)
        if source is None or not any(
            s in source for s in ("scaled_dot_product_attention", "softmax", "observe_attention", "attention_interface")
        ):
            blind.append(f"{name} ({type(m).__name__}) calls no attention PyTorch can show")
        if len(blind) >= 3:
            break
    return blind


def _source(fn: Any) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
