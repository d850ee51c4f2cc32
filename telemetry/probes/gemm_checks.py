"""The matrix checksums on a model: :class:`GemmChecks` hooks every linear layer (``nn.Linear`` and
Hugging Face's ``Conv1D``, :mod:`~sdcwatch.telemetry.probes.linear_layout`; forward, weight
and bias gradient, weights in memory) and the products modules report with :func:`observe_gemm`;
the checks and their rounding bounds are :mod:`sdcwatch.telemetry.probes.checksum_bounds`'s.

Two depths. On a *checked* step a hook does the reductions that must read the step's tensors (the
output's row sums, one matrix-vector product with the input, the input's largest |value|, the
weight's column sums against the sealed ones; in the backward, when that is checked too
(:mod:`sdcwatch.telemetry.probes.gemm_backward`, sampled on its own), the output gradient's row sums
and norm, one vector-matrix product, the gradient's column sums) and keeps their results on the device; the residuals and ratios of every product
are formed once per step in :meth:`GemmChecks.collect` with stacked operations. On a *scanned*
step (every step at the default) a hook only takes the row sums of the product's output
(``gemm_out`` is the largest |row sum|, one fast reduction): a NaN, Inf or near-INF the product
wrote shows at its step and product, whichever step the checksums sample. A row, not the whole
output, so that the values of a large model's wide outputs never add up to a near-INF.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import math
import os
import warnings
from typing import Any, Callable

import torch
from sdcwatch.core.vocabulary import GEMM_METRICS
from sdcwatch.telemetry.probes.checksum_bounds import (
    TINY,
    abs_max,
    accumulated_sum,
    accumulation_dtype,
    gemm_input_roundoff,
    product_dtype,
    rounding_coefficient,
)
from sdcwatch.telemetry.probes.gemm_backward import GradientChecks, TracedReference
from sdcwatch.telemetry.probes.kept import kept_calls
from sdcwatch.telemetry.probes.gemm_traced import TracedCalls
from sdcwatch.telemetry.probes.gemm_state import (
    GEMM_OBSERVERS,
    SealedWeight,
    StepChecks,
    call_peaks,
    holds_whole_rows,
    is_shard,
    local_part,
    stack_rows,
)
from sdcwatch.telemetry.probes.row_scan import FUSED_DTYPES, triton_available
from sdcwatch.telemetry.probes.linear_layout import is_linear, linear_weight, transposed
from torch import nn

__all__ = ["GemmChecks"]

_SERIALS = itertools.count()


class GemmChecks(TracedCalls, GradientChecks):
    """Checksums of every linear layer of a model (forward, weight and bias gradient, weights),
    plus the custom products reported with :func:`observe_gemm`; one value per product and step.

    ``active`` says whether the step in progress is checked forward (the products and the weights
    in memory; the probes' sampling and enabled flag), ``backward`` whether its weight gradients
    are checked too (a checked forward only: the backward's reference is taken in the forward),
    ``scan`` whether its products' outputs are summed (``gemm_out``) when it is not checked;
    hooks cost a function call otherwise. :meth:`collect` returns this step's per-layer
    ratios (:data:`GEMM_METRICS`) as device tensors and starts the next step. A weight shared with
    another module (tied embeddings) is checked forward only: its gradient is a sum over uses.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        active: Callable[[], bool] = lambda: True,
        scan: Callable[[], bool] = lambda: False,
        backward: Callable[[], bool] | None = None,
        modules: str = "*",
        weights: bool = True,
        order: Any = None,  # a ForwardOrder numbering the outputs in forward order (nonfinite_first)
    ) -> None:
        serial = next(_SERIALS)  # compiled code's per-module attributes (TracedCalls), one pair a watch
        self._calls_attr = f"_sdcwatch_calls_{serial}"
        self._seal_attr = f"_sdcwatch_seal_{serial}"
        self._index_of: dict[int, int] = {}  # id(module) -> product index (eager code)
        self.active = active
        self.scan = scan
        self.backward = active if backward is None else backward
        self.order = order
        self.names: list[str] = []
        """Names of the checked products, in layer order (the index in the ``gemm_*`` metrics)."""
        self._modules: list[nn.Module] = []
        self._handles: list[Any] = []
        self._forward: list[tuple[nn.Module, Callable]] = []  # forward hooks, registered only when due
        self._forward_handles: list[Any] = []
        self._weights = weights
        self.keep_bounds = False
        """Keep each check's absolute bound of the last step in :attr:`bounds` (fault-injection
        campaigns use it to tell which faults a checksum can see; off in training)."""
        self.bounds: dict[tuple[str, str], torch.Tensor] = {}
        self._sealed_at: list[SealedWeight | None] = []
        self._bias_checked: list[bool] = []
        self._index_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._zeros: dict[tuple, torch.Tensor] = {}
        owners: dict[int, int] = {}
        for _, m in model.named_modules():
            for p in m.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        globs = [g.strip() for g in modules.split(",") if g.strip()]
        self._grad_hooked: list[int] = []  # products whose weight gradient is checked
        for name, m in model.named_modules():
            if is_linear(m) and any(fnmatch.fnmatchcase(name, g) for g in globs):
                i = self._add(name, m)
                self._forward.append((m, self._any_linear_hook))
                # an FSDP2 shard (a DTensor) is outside the autograd graph: its hook would never fire
                if m.weight.requires_grad and owners.get(id(m.weight), 0) == 1 and not is_shard(m.weight):
                    hook = functools.partial(self._weight_grad_hook, i)  # Conv1D's gradient is (in, out): turned
                    hook = functools.partial(_turned, hook) if transposed(m) else hook
                    self._handles.append(m.weight.register_hook(hook))
                    self._grad_hooked.append(i)
                    if m.bias is not None and m.bias.requires_grad and owners.get(id(m.bias), 0) == 1:
                        self._handles.append(m.bias.register_hook(functools.partial(self._bias_grad_hook, i)))
                        self._bias_checked[i] = True
        for name, m in model.named_modules():
            GEMM_OBSERVERS.setdefault(m, []).append(self)
            if getattr(m, "_sdcwatch_gemm", False) and any(fnmatch.fnmatchcase(name, g) for g in globs):
                self._add(name, m)  # a module whose forward(a, b) returns a @ b
                self._forward.append((m, self._product_hook))
        self._fused = triton_available() and os.environ.get("SDCWATCH_TRITON", "1") != "0"
        self.hook_forward(True)
        self._sealed_by_optimizer = False
        self.optimizer_seals = False
        """Whether an optimizer's step hook seals the weights after each update (set by the watch):
        compiled code then takes the weight's sums from the seal instead of reading the weight."""
        self._provisional_key: tuple | None = None  # (device, products) of the last provisional seals
        self.seal_provisionally()
        # decided once (a cached call in a traced hook is a guard); SDCWATCH_TRITON=0 keeps torch's ops
        # (self._fused, above); opt in (SDCWATCH_COMPILED_GRAD_CHECK=1): inductor took it on torch 2.13 (CPU) but failed to
        # compile it on torch 2.11 (CUDA, an H100), an error that would stop the job
        self.traced_backward = os.environ.get("SDCWATCH_COMPILED_GRAD_CHECK", "0") == "1"
        """Whether the weight-gradient check runs in compiled code (a hook on each product's output
        that torch.compile traces into the backward graph); off where it breaks the graph."""
        self._traced: dict[int, TracedReference] = {}
        self._traced_meta: dict[int, tuple[int, float, torch.dtype]] = {}
        self._n_registered = len(self.names)  # the products found here (observe_gemm may add more)
        self._coverage_told = False
        self._owners = [m for _, m in model.named_modules()]
        self._module_names = {id(m): n for n, m in model.named_modules()}
        self._reset()

    def _add(self, name: str, module: nn.Module) -> int:
        self.names.append(name)
        self._modules.append(module)
        self._sealed_at.append(None)
        self._bias_checked.append(False)
        self._index_of[id(module)] = len(self.names) - 1
        module.__dict__[self._calls_attr] = []
        module.__dict__[self._seal_attr] = None
        return len(self.names) - 1

    def _set_seal(self, i: int, sealed: SealedWeight | None) -> None:
        """Product ``i``'s seal, kept in the watch's list and on its module (for compiled code)."""
        self._sealed_at[i] = sealed
        self._modules[i].__dict__[self._seal_attr] = sealed

    def _reset(self) -> None:
        kept_calls(self._modules, self._calls_attr)  # compiled code's calls of a dropped step
        self._step = StepChecks(self.order)
        self._weights_seen: set[int] = set()  # products whose weights were compared this step
        self._judged = (0, 0, 0)  # forward, gradient and weight checks violated() has judged
        # per product: this backward's weight-gradient reference [Σ s X, bound scale, tokens,
        # Σ s, bias bound scale, input roundoff, checks still waiting]
        self._pending: list[list | None] = [None] * len(self.names)

    # -- forward ----------------------------------------------------------------------------------
    def _scanned(self, i: int, y: torch.Tensor) -> None:
        """A scanned step: the row sums of the product's output (a NaN, Inf or near-INF survives)."""
        y = y if type(y) is torch.Tensor else local_part(y)  # a DTensor: this rank's part
        if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel():
            self._step.scanned(i)
            self._step.o_ys.append(self._row_sums(y.detach(), torch.float32))

    def _row_sums(self, y: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """The (rows,) sums of ``y``'s last dim accumulated in ``acc``: in eager code on a GPU one read
        of ``y`` by the fused Triton kernel (:mod:`~sdcwatch.telemetry.probes.row_scan`), elsewhere
        ``y.sum`` (the records of the CPU stay bit for bit). In code torch.compile traces, ``y.sum``
        too: inductor fuses the row reduction into the kernel that already reads ``y`` beside it (the
        rotary embedding, the activation, the residual add and the next normalisation), where the
        custom operator would be one more read of ``y``."""
        if (
            self._fused
            and y.is_cuda
            and acc == torch.float32
            and y.dtype in FUSED_DTYPES
            and not torch.compiler.is_compiling()
        ):
            return torch.ops.sdcwatch.row_scan(y)[0]
        return accumulated_sum(y, -1, acc).reshape(-1)

    def _linear_hook(self, i: int, module: nn.Linear, args: tuple, output: Any) -> None:
        if not args or not self.active():  # a scanned step (the usual one), or nothing: the least work first
            return self._scanned(i, output) if args and self.scan() else None
        tensor_parallel = is_shard(module.weight)  # its forward weight a DTensor: the rank's part is checked
        if tensor_parallel and not holds_whole_rows(module.weight):  # row-wise: the output is the ranks'
            return self._scanned(i, output)  # products all-reduced, scanned only
        x, y = local_part(args[0]), local_part(output)
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and y.is_floating_point()):
            return
        if x.numel() == 0 or y.numel() == 0:
            return
        hi, lo = self._check_forward(i, module, x, y)
        if y.requires_grad and torch.is_grad_enabled() and not tensor_parallel and self.backward():
            if torch.compiler.is_compiling():  # the hook is traced: it adds into buffers (see TracedReference)
                if i not in self._traced:
                    return
                tokens = x.numel() // x.shape[-1]
                before = self._traced_meta.get(i)
                # dW = dY^T X is rounded to y's dtype (dY's); under autocast X is cast to it
                roundoff, out = gemm_input_roundoff(x, y, compute=y.dtype), y.dtype
                if before is not None:
                    tokens, roundoff, out = (
                        max(before[0], tokens),
                        max(before[1], roundoff),
                        product_dtype(before[2], out),
                    )
                self._traced_meta[i] = (tokens, roundoff, out)
            # autograd keeps x for the weight gradient anyway: no extra memory
            y.register_hook(functools.partial(self._output_grad, i, x.detach(), torch.maximum(hi, -lo)))

    def _check_forward(
        self, i: int, module: nn.Linear, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward check's reductions of one call: row sums of ``y`` against ``x (W^T 1) + Σ b``,
        the weight's column sums beside the sealed ones (subtracted for every product at once in
        :meth:`collect`); returns the input's largest and smallest value."""
        with torch.no_grad():
            w, b = (local_part(t) for t in linear_weight(module))
            acc = accumulation_dtype(y.dtype)
            sealed = self._sealed_at[i]
            if torch.compiler.is_compiling() and self._seal_usable(sealed, w):  # the weight-gradient check's path
                self._check_forward_traced(module, sealed, w, b, x, y, acc)
                return x.amax(), x.amin()
            v = accumulated_sum(w, 0, acc)
            b_sum = accumulated_sum(b, None, acc) if b is not None else None
            traced = torch.compiler.is_compiling()  # a constant while Dynamo traces the hook
            if not traced and sealed is not None and sealed.provisional:
                sealed = None  # eager code: only the optimizer's seal counts (see SealedWeight)
            k = b_abs = None
            if sealed is not None:
                vw, bw = v, b_sum  # the weights as this rank holds them: a shard's own under FSDP2
                if sealed.shard is not None:
                    sw_, sb_ = sealed.shard
                    vw = accumulated_sum(sw_.to_local(), 0, acc)
                    bw = None if sb_ is None else accumulated_sum(sb_.to_local(), None, acc)
                elif not traced:  # traced: the norms taken now, the same code on every checked step
                    k, b_abs = sealed.k, sealed.b_abs
                if self._weights and i not in self._weights_seen and sealed.v.shape == vw.shape:
                    self._compare_weight(i, sealed, vw, bw)
                if sealed.v.shape != v.shape and sealed.shard is None:
                    k = b_abs = None  # the weight changed shape since it was sealed
            if k is None:
                k = torch.linalg.vector_norm(w, dim=1, dtype=acc).sum() * math.sqrt(w.shape[1])
                b_abs = accumulated_sum(b.abs(), None, acc) if b is not None else None
            ys = self._row_sums(y, acc)
            ref = ((x if x.dtype == acc else x.to(acc)) @ v).reshape(-1)
            if b_sum is not None:
                ref = ref.add_(b_sum)
            hi, lo = x.amax(), x.amin()
            self._note_check(i, w, x, y, ys, ref, hi, lo, k, b_abs if b_abs is not None else self._zero(acc, y.device))
            return hi, lo

    def _compare_weight(self, i: int, sealed: SealedWeight, vw: torch.Tensor, bw: torch.Tensor | None) -> None:
        """Keep product ``i``'s weight sums now (``vw``; ``bw`` its bias's) beside the sealed ones, once a
        step: the same reduction of the same bits, so any difference past rounding is a weight changed
        in memory (compared for every product at once in :meth:`collect`)."""
        self._weights_seen.add(i)
        st = self._step
        st.w_idx.append(i)
        st.w_now.append(vw)
        st.w_then.append(sealed.v)
        st.w_bound.append(sealed.w_bound)
        st.w_names.append(self.names[i] + ".weight")
        if bw is not None and sealed.b_sum is not None:
            st.w_idx.append(i)
            st.w_now.append(bw.reshape(1))
            st.w_then.append(sealed.b_sum.reshape(1))
            st.w_bound.append(sealed.b_bound)
            st.w_names.append(self.names[i] + ".bias")

    def _note_check(self, i: int, w, x, y, ys, ref, hi, lo, k, b_abs, trust=None) -> None:
        """Keep one checked call's reductions for :meth:`collect` (see :class:`StepChecks`)."""
        self._step.checked(i)
        coef = rounding_coefficient(
            w.shape[1], w.shape[0], y.dtype, input_roundoff=gemm_input_roundoff(x, w, compute=y.dtype)
        )
        self._step.add_check(ys, ref, hi, lo, k, b_abs, trust, coef)

    def _zero(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 0-d zero of ``dtype`` on ``device`` (kept: the bias term of a product without one)."""
        if torch.compiler.is_compiling():  # a constant of the graph (a cache filled on the first step is a guard)
            return torch.zeros((), dtype=dtype, device=device)
        key = (dtype, str(device))
        zero = self._zeros.get(key)
        if zero is None:
            zero = self._zeros[key] = torch.zeros((), dtype=dtype, device=device)
        return zero

    def arm_traced_backward(self) -> None:
        """Before a step whose weight gradients are checked: a :class:`TracedReference` for every
        product whose gradient is hooked (allocated once; compiled backwards add into them), and
        no forward noted yet."""
        if not self.traced_backward:
            return
        for i in self._traced_meta:  # a backward that never reached the weight's hook: start from zero
            if i in self._traced:
                self._traced[i].clear()
        self._traced_meta.clear()
        for i in self._grad_hooked:
            held = self._traced.get(i)
            w, _ = linear_weight(self._modules[i])
            if held is None or held.ref.device != w.device:
                self._traced[i] = TracedReference(w.shape[1], accumulation_dtype(w.dtype), w.device)

    def seal_provisionally(self) -> None:
        """A provisional seal of every weight not sealed yet, or sealed provisionally on another
        device than the weight's now (see :class:`SealedWeight`): taken when the checks are made,
        and while the optimizer has not stepped, so that compiled code sees one structure."""
        if not self._weights or self._sealed_by_optimizer:
            return
        # called before every step until the optimizer seals (never, without one): the walk over the
        # products runs only when the model moved or gained a product since the last one
        first = next((p.device for m in self._modules[:1] for p in m.parameters(recurse=False)), None)
        if self._provisional_key == (first, len(self._modules)):
            return
        self._provisional_key = (first, len(self._modules))
        with torch.no_grad():
            for i, m in enumerate(self._modules):
                sealed = self._sealed_at[i]
                w, b = linear_weight(m) if is_linear(m) else (getattr(m, "weight", None), getattr(m, "bias", None))
                if not isinstance(w, torch.Tensor) or w.dim() != 2 or is_shard(w):
                    continue
                if sealed is None or (sealed.provisional and sealed.v.device != w.device):
                    self._set_seal(i, SealedWeight(w, b if isinstance(b, torch.Tensor) else None, provisional=True))

    def seal(self) -> None:
        """Take the weights' column sums as they are now (call right after the optimizer step; the
        probes do): the next forward compares against them. Costs one pass over the weights."""
        if not self._weights:
            return
        self._sealed_by_optimizer = True
        with torch.no_grad():
            for i, m in enumerate(self._modules):
                w, b = linear_weight(m) if is_linear(m) else (getattr(m, "weight", None), getattr(m, "bias", None))
                if isinstance(w, torch.Tensor) and w.dim() == 2:
                    self._set_seal(i, SealedWeight(w, b if isinstance(b, torch.Tensor) else None))

    def unseal(self) -> None:
        """Forget the sealed column sums (after weights were changed outside the optimizer, e.g. a
        checkpoint loaded): the weight check resumes after the next :meth:`seal`."""
        for i in range(len(self._sealed_at)):
            self._set_seal(i, None)
        self._sealed_by_optimizer = False
        self._provisional_key = None
        self.seal_provisionally()

    # -- custom products --------------------------------------------------------------------------
    def _product_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if len(args) >= 2 and isinstance(output, torch.Tensor):
            self.observe(module, args[0], args[1], output)

    def observe(
        self, owner: nn.Module, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """A custom product of ``owner`` (see :func:`observe_gemm`); a new owner becomes a new layer."""
        checked = self.active()
        if not (checked or self.scan()) or a.numel() == 0 or c.numel() == 0:
            return
        traced = torch.compiler.is_compiling() and self._calls_attr in owner.__dict__  # kept on the owner
        if traced and not checked:
            self._traced_scan(owner, c)
            return
        i = None
        if not traced:
            try:
                i = self._modules.index(owner)
            except ValueError:
                i = self._add(self._module_names.get(id(owner), type(owner).__name__), owner)
                self._pending.append(None)
            if not checked:
                self._scanned(i, c)
                return
        with torch.no_grad():
            acc = accumulation_dtype(c.dtype)
            n, m = b.shape[-2], b.shape[-1]
            ys = accumulated_sum(c, -1, acc).reshape(-1)
            # a batched matrix-vector product as a batched dot product: the same sums, a faster kernel on CPU
            ref = torch.linalg.vecdot(a if a.dtype == acc else a.to(acc), accumulated_sum(b, -1, acc).unsqueeze(-2))
            if bias is not None:
                ref = ref + accumulated_sum(bias, None, acc)
            ref = ref.reshape(-1)
            # ||a_i|| <= sqrt(n) max|a| and Σ_j ||b_:j|| <= m sqrt(n) max|b|
            k = abs_max(b).to(acc) * (n * m)
            b_abs = accumulated_sum(bias.abs(), None, acc) if bias is not None else self._zero(acc, c.device)
            coef = rounding_coefficient(n, m, c.dtype, input_roundoff=gemm_input_roundoff(a, b, compute=c.dtype))
            if traced:
                ordinal = self.order.traced_tick() if self.order is not None else None
                owner.__dict__[self._calls_attr].append(
                    ("f", ys, ref, a.amax(), a.amin(), k, b_abs, None, coef, ordinal)
                )
                return
            self._step.checked(i)
            self._step.add_check(ys, ref, a.amax(), a.amin(), k, b_abs, None, coef)

    # -- the step ---------------------------------------------------------------------------------
    def _indices(self, key: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Device tensors of this step's per-call bookkeeping (product indices, coefficients); a step calls the layers as the previous one did, so they are cached."""
        got = self._index_cache.get(key)
        if got is None:
            if len(self._index_cache) > 64:
                self._index_cache.clear()
            got = tuple(torch.tensor(part, device=device) for part in key)
            self._index_cache[key] = got
        return got

    def collect(self) -> dict[str, torch.Tensor] | None:
        """This step's (n_products,) tensor per :data:`GEMM_METRICS` on a checked step, only
        ``gemm_out`` on a scanned one (None if nothing was seen); resets for the next step.
        Products not seen this step report 0."""
        self._drain()
        st = self._step
        n = len(self.names)
        if not self._coverage_told and (st.f_idx or st.o_idx):
            self._tell_unseen(set(st.f_idx) | set(st.o_idx))
        if not st.f_idx:
            out = None
            if st.o_idx:
                with torch.no_grad():
                    (idx,) = self._indices((tuple(st.o_idx),), st.o_ys[0].device)
                    top = call_peaks(st.o_ys).float()
                    out = {"gemm_out": torch.zeros(n, device=top.device).scatter_reduce_(0, idx, top, "amax")}
                    st.note(st.o_seq, top)
            self._reset()
            return out
        keep = self.keep_bounds
        device = st.f_ys[0].device
        out = {}
        with torch.no_grad():
            idx, top, ratio, bound, xm = self._forward_ratios(st)
            st.note(st.f_seq, top)
            # gemm_out as a scanned step reports it
            out["gemm_out"] = torch.zeros(n, device=device).scatter_reduce_(0, idx, top, "amax")
            if st.o_idx:  # products only scanned on a checked step (row-wise tensor parallel)
                o_idx, o_top = self._indices((tuple(st.o_idx),), device)[0], stack_rows(st.o_ys).abs_().amax(-1)
                out["gemm_out"].scatter_reduce_(0, o_idx, o_top.float(), "amax")
            out["gemm_fwd"] = torch.zeros(n, device=device).scatter_reduce_(0, idx, ratio, "amax")
            if keep:
                for c, i in enumerate(st.f_idx):
                    self.bounds[("gemm_fwd", self.names[i])] = bound[c]
            g_res = torch.stack(st.g_res) if st.g_res else None
            out["gemm_bwd"] = self._ratios(st.g_idx, g_res, st.g_bound, st.g_names, "gemm_bwd", n, device)
            w_diff = self._weight_differences(st) if st.w_idx else None
            out["gemm_weight"] = self._ratios(st.w_idx, w_diff, st.w_bound, st.w_names, "gemm_weight", n, device)
            out["gemm_in"] = torch.zeros(n, device=device).scatter_reduce_(0, idx, xm, "amax")
        self._reset()
        return {name: out[name] for name in GEMM_METRICS}

    def _tell_unseen(self, seen: set[int]) -> None:
        """Warn once, on the first step any product ran, about the linear layers whose forward did
        not run in it: their products are neither checked nor scanned (``nn.MultiheadAttention``,
        for one, multiplies by its ``out_proj`` weight without calling the module)."""
        self._coverage_told = True
        unseen = [self.names[i] for i in range(self._n_registered) if i not in seen]
        if unseen:
            warnings.warn(
                f"sdcwatch checksums: {len(unseen)} of {self._n_registered} linear layers ran no forward in the "
                f"first training step, and are neither checked nor scanned while they do not: "
                f"{', '.join(unseen[:8])}{' ...' if len(unseen) > 8 else ''} (a module that multiplies by a "
                "layer's weight without calling the layer, such as nn.MultiheadAttention, can report the product "
                "with observe_gemm; an idle expert of a mixture of experts is checked when it runs)",
                RuntimeWarning,
                stacklevel=2,
            )

    def _forward_ratios(self, st: StepChecks, start: int = 0) -> tuple[torch.Tensor, ...]:
        """(product index, largest |row sum|, ratio, bound, largest |input|) of the forward checks
        from call ``start`` on: the max |residual| of every call at once, over its bound."""
        f_ys, f_ref = st.f_ys[start:], st.f_ref[start:]
        idx, coef = self._indices((tuple(st.f_idx[start:]), tuple(st.f_coef[start:])), f_ys[0].device)
        ys = stack_rows(f_ys)
        top = ys.abs().amax(-1).float()
        rmax = (ys - stack_rows(f_ref)).abs_().amax(-1)
        xm = torch.maximum(torch.stack(st.f_xhi[start:]), torch.stack(st.f_xlo[start:]).neg_()).float()
        k, b = torch.stack(st.f_k[start:]), torch.stack(st.f_b[start:])
        bound = (xm.to(rmax.dtype) * k + b).mul_(coef).clamp_min_(TINY)
        trust = st.f_trust[start:]
        if any(t is not None for t in trust):  # traced checks against provisional seals: never judged
            one = torch.ones((), dtype=bound.dtype, device=bound.device)
            bound = bound * torch.stack([one if t is None else t.to(bound.dtype) for t in trust])
        return idx, top, (rmax / bound).float(), bound, xm

    def violated(self, bound: float = 1.0) -> bool:
        """Whether a product checked since the last call (in this step) passed its rounding bound:
        a forward, gradient or weight ratio above ``bound``, or NaN. The guard's trigger; it reads
        the device (one sync), so it is called only where the guard decides, before the update."""
        self._drain()
        st = self._step
        f0, g0, w0 = self._judged
        self._judged = (len(st.f_idx), len(st.g_idx), len(st.w_idx))
        parts = []
        with torch.no_grad():
            if len(st.f_idx) > f0:
                parts.append(self._forward_ratios(st, f0)[2].max())
            if len(st.g_idx) > g0:
                parts.append((torch.stack(st.g_res[g0:]) / torch.stack(st.g_bound[g0:])).max().float())
            if len(st.w_idx) > w0:
                parts.append((self._weight_differences(st, w0) / torch.stack(st.w_bound[w0:])).max().float())
            if not parts:
                return False
            top = float(torch.stack(parts).max()) if len(parts) > 1 else float(parts[0])
        return not top <= bound  # NaN too

    def _ratios(
        self,
        index: list[int],
        residuals: torch.Tensor | None,
        bounds: list[torch.Tensor],
        names: list[str],
        check: str,
        n: int,
        device: torch.device,
    ) -> torch.Tensor:
        """Largest residual / bound per product of the stacked residuals and 0-d bounds (zeros where none)."""
        out = torch.zeros(n, device=device)
        if not index or residuals is None:
            return out
        (idx,) = self._indices((tuple(index),), device)
        bound = torch.stack(bounds)
        if self.keep_bounds:
            for c, name in enumerate(names):
                self.bounds[(check, name)] = bound[c]
        return out.scatter_reduce_(0, idx, (residuals / bound).float(), "amax")

    @staticmethod
    def _weight_differences(st: StepChecks, start: int = 0) -> torch.Tensor:
        """The largest |column sum now - sealed| of each weight (and |Σ b now - sealed|) compared from
        entry ``start`` on: one subtraction and one reduction for them all."""
        return (stack_rows(st.w_now[start:]) - stack_rows(st.w_then[start:])).abs_().amax(-1)

    def discard(self) -> None:
        """Drop what this step measured (a step that is not recorded)."""
        self._reset()

    def hook_forward(self, want: bool) -> None:
        """Register the forward hooks (``True``) or remove them: a module with a forward hook leaves
        PyTorch's fast call path, so the probes keep them only on the steps that are checked."""
        if want and not self._forward_handles:
            self._forward_handles = [m.register_forward_hook(hook) for m, hook in self._forward]
        elif not want and self._forward_handles:
            for h in self._forward_handles:
                h.remove()
            self._forward_handles = []

    def remove(self) -> None:
        """Remove every hook (and what the hooks kept on the modules)."""
        self.hook_forward(False)
        for m in self._modules:
            m.__dict__.pop(self._calls_attr, None)
            m.__dict__.pop(self._seal_attr, None)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._owners:
            lst = GEMM_OBSERVERS.get(m)
            if lst:
                lst[:] = [c for c in lst if c is not self]


def _turned(hook: Callable, grad: torch.Tensor) -> None:
    """``hook`` on the transpose of ``grad``: a ``Conv1D`` weight's gradient, as ``(out, in)``."""
    hook(grad.t())
