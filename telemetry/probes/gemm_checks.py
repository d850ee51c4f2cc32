"""The matrix checksums on a model: :class:`GemmChecks` hooks every linear layer (forward, weight
and bias gradient, weights in memory) and the products modules report with :func:`observe_gemm`;
the bounds are :mod:`~sdcwatch.telemetry.probes.checksum_bounds`'s (docs/probes.md says how and why).
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import math
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
    rounding_coefficient,
)
from sdcwatch.telemetry.probes.gemm_backward import GradientChecks
from sdcwatch.telemetry.probes.gemm_state import (
    GEMM_OBSERVERS,
    ProductTable,
    SealedWeight,
    StepChecks,
    call_peaks,
    holds_whole_rows,
    is_shard,
    local_part,
    stack_rows,
    zero_of,
)
from sdcwatch.telemetry.probes.gemm_traced import TracedCalls
from sdcwatch.telemetry.probes.compiled_calls import cached, remove_hooks
from sdcwatch.telemetry.probes.row_scan import FUSED_DTYPES, triton_available
from sdcwatch.telemetry.probes.linear_layout import is_linear, linear_weight, transposed
from torch import nn

__all__ = ["GemmChecks"]


class GemmChecks:
    """Checksums of every linear layer of a model and of the products reported with
    :func:`observe_gemm`: one value per product and step (:meth:`collect`, :data:`GEMM_METRICS`).

    ``active``: the step in progress is checked forward (products, weights in memory);
    ``backward``: its weight gradients too (a checked forward only: the reference is taken there);
    ``scan``: its outputs are summed (``gemm_out``) when not checked. A weight shared with another
    module (tied embeddings) is checked forward only. Its parts, :class:`TracedCalls` (compiled
    code) and :class:`GradientChecks`, share :attr:`products` and :attr:`step`.
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
        triton: bool = True,
        compiled_grad_check: bool = False,
    ) -> None:
        self.active = active
        self.scan = scan
        self.backward = active if backward is None else backward
        self.order = order
        self.weights = weights  # compare the weights in memory with their seals
        self.products = ProductTable()
        self.names = self.products.names  # the index of each product in the gemm_* metrics
        self.step = StepChecks(order)
        self.keep_bounds = False  # keep each check's absolute bound of the last step (fault campaigns)
        self.bounds: dict[tuple[str, str], torch.Tensor] = {}
        self.optimizer_seals = False  # an optimizer's hook seals the weights: compiled code reads the seal
        # opt in: inductor compiled the traced backward check on torch 2.13 (CPU) but failed on
        # torch 2.11 (CUDA, an H100), an error that would stop the job
        self.traced_backward = compiled_grad_check
        self.traced = TracedCalls(self)
        self.gradients = GradientChecks(self.products, self.step)
        self._fused = triton and triton_available()
        self._handles: list[Any] = []
        self._forward: list[tuple[nn.Module, Callable]] = []  # forward hooks, registered only when due
        self._forward_handles: list[Any] = []
        self._index_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._grad_hooked = self._find_products(model, [g.strip() for g in modules.split(",") if g.strip()])
        self.hook_forward(True)
        self._sealed_by_optimizer = False
        self._provisional_key: tuple | None = None  # (device, products) of the last provisional seals
        self.seal_provisionally()
        self._n_registered = len(self.names)  # the products found here (observe_gemm may add more)
        self._coverage_told = False
        self._owners = list(model.modules())
        self._module_names = {id(m): n for n, m in model.named_modules()}
        self._reset()

    def _find_products(self, model: nn.Module, globs: list[str]) -> list[int]:
        """Hook the linear layers and ``_sdcwatch_gemm`` modules matching ``globs``; returns the
        products whose weight gradient is checked."""
        owners = collections.Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
        grad_hooked = []
        table = self.products
        for name, m in model.named_modules():
            if is_linear(m) and any(fnmatch.fnmatchcase(name, g) for g in globs):
                i = table.add(name, m)
                self._forward.append((m, self._any_linear_hook))
                # an FSDP2 shard (a DTensor) is outside the autograd graph: its hook would never fire
                if m.weight.requires_grad and owners[id(m.weight)] == 1 and not is_shard(m.weight):
                    hook = functools.partial(self.gradients.weight_grad, i)  # Conv1D's gradient is (in, out): turned
                    hook = functools.partial(_turned, hook) if transposed(m) else hook
                    self._handles.append(m.weight.register_hook(hook))
                    grad_hooked.append(i)
                    if m.bias is not None and m.bias.requires_grad and owners[id(m.bias)] == 1:
                        self._handles.append(m.bias.register_hook(functools.partial(self.gradients.bias_grad, i)))
                        table.bias_checked[i] = True
        for name, m in model.named_modules():
            GEMM_OBSERVERS.setdefault(m, []).append(self)
            if getattr(m, "_sdcwatch_gemm", False) and any(fnmatch.fnmatchcase(name, g) for g in globs):
                table.add(name, m)  # a module whose forward(a, b) returns a @ b
                self._forward.append((m, self._product_hook))
        return grad_hooked

    def _reset(self) -> None:
        self.products.take_calls()  # compiled code's calls of a dropped step
        self.step.clear()
        self._judged = (0, 0, 0)  # forward, gradient and weight checks violated() has judged
        self.gradients.reset()

    # -- forward ----------------------------------------------------------------------------------
    def _scanned(self, i: int, y: torch.Tensor) -> None:
        """A scanned step: the row sums of the product's output (a NaN, Inf or near-INF survives)."""
        y = y if type(y) is torch.Tensor else local_part(y)  # a DTensor: this rank's part
        if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel():
            self.step.scanned(i)
            self.step.o_ys.append(self._row_sums(y.detach(), torch.float32))

    def _row_sums(self, y: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """The (rows,) sums of ``y``'s last dim in ``acc``: the Triton kernel in eager code on a GPU,
        else ``y.sum`` (in traced code inductor fuses it into the kernel that already reads ``y``)."""
        if (
            self._fused
            and y.is_cuda
            and acc == torch.float32
            and y.dtype in FUSED_DTYPES
            and not torch.compiler.is_compiling()
        ):
            return torch.ops.sdcwatch.row_scan(y)[0]
        return accumulated_sum(y, -1, acc).reshape(-1)

    def _any_linear_hook(self, module: nn.Linear, args: tuple, output: Any) -> None:
        """The forward hook of every linear layer: traced code then holds no product index (a
        constant Dynamo guards on: each block would compile its own graph)."""
        if torch.compiler.is_compiling() and self.traced.linear(module, args, output):
            return
        self._linear_hook(self.products.index_of(module), module, args, output)

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
            # the hook is traced: it adds into buffers (see TracedReference)
            if torch.compiler.is_compiling() and not self.gradients.note_traced_forward(i, x, y):
                return
            # autograd keeps x for the weight gradient anyway: no extra memory
            y.register_hook(functools.partial(self.gradients.output_grad, i, x.detach(), torch.maximum(hi, -lo)))

    def _check_forward(
        self, i: int, module: nn.Linear, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row sums of ``y`` against ``x (W^T 1) + Σ b``, and the weight's column sums beside the
        sealed ones; returns the input's largest and smallest value."""
        with torch.no_grad():
            w, b = (local_part(t) for t in linear_weight(module))
            acc = accumulation_dtype(y.dtype)
            sealed = self.products.seals[i]
            if torch.compiler.is_compiling() and self.traced.seal_usable(sealed, w):  # the weight-gradient check's path
                self.traced.check_forward(module, sealed, w, b, x, y, acc)
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
                if self.weights and i not in self.step.weights_seen and sealed.v.shape == vw.shape:
                    self.step.compare_weight(i, self.names[i], sealed, vw, bw)
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
            self.step.checked(i)
            coef = rounding_coefficient(
                w.shape[1], w.shape[0], y.dtype, input_roundoff=gemm_input_roundoff(x, w, compute=y.dtype)
            )
            self.step.add_check(ys, ref, hi, lo, k, b_abs if b_abs is not None else zero_of(acc, y.device), None, coef)
            return hi, lo

    def arm_traced_backward(self) -> None:
        """Before a step whose weight gradients are checked (see :meth:`GradientChecks.arm_traced`)."""
        if self.traced_backward:
            self.gradients.arm_traced(self._grad_hooked)

    def seal_provisionally(self) -> None:
        """A provisional seal (:class:`SealedWeight`) of every weight not sealed yet, or sealed
        provisionally on another device, until the optimizer steps: compiled code sees one structure."""
        if not self.weights or self._sealed_by_optimizer:
            return
        # called before every step until the optimizer seals (never, without one): the walk over the
        # products runs only when the model moved or gained a product since the last one
        table = self.products
        first = next((p.device for m in table.modules[:1] for p in m.parameters(recurse=False)), None)
        if self._provisional_key == (first, len(table)):
            return
        self._provisional_key = (first, len(table))
        with torch.no_grad():
            for i, (w, b) in self._weights():
                sealed = table.seals[i]
                if not is_shard(w) and (sealed is None or (sealed.provisional and sealed.v.device != w.device)):
                    table.set_seal(i, SealedWeight(w, b, provisional=True, triton=self._fused))

    def seal(self) -> None:
        """Take the weights' column sums as they are now (right after the optimizer step): the next
        forward compares against them. Costs one pass over the weights."""
        if not self.weights:
            return
        self._sealed_by_optimizer = True
        with torch.no_grad():
            for i, (w, b) in self._weights():
                self.products.set_seal(i, SealedWeight(w, b, triton=self._fused))

    def _weights(self) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor | None]]]:
        """(index, (weight, bias or None)) of the products with a 2-d weight."""
        out = []
        for i, m in enumerate(self.products.modules):
            w, b = linear_weight(m) if is_linear(m) else (getattr(m, "weight", None), getattr(m, "bias", None))
            if isinstance(w, torch.Tensor) and w.dim() == 2:
                out.append((i, (w, b if isinstance(b, torch.Tensor) else None)))
        return out

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
        calls = self.products.calls_on(owner) if torch.compiler.is_compiling() else None
        traced = calls is not None  # kept on the owner
        if traced and not checked:
            self.traced.scan(owner, c)
            return
        i = None
        if not traced:
            try:
                i = self.products.modules.index(owner)
            except ValueError:
                i = self.products.add(self._module_names.get(id(owner), type(owner).__name__), owner)
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
            b_abs = accumulated_sum(bias.abs(), None, acc) if bias is not None else zero_of(acc, c.device)
            coef = rounding_coefficient(n, m, c.dtype, input_roundoff=gemm_input_roundoff(a, b, compute=c.dtype))
            if traced:
                ordinal = self.step.traced_ordinal()
                calls.append(("f", ys, ref, a.amax(), a.amin(), k, b_abs, None, coef, ordinal))
                return
            self.step.checked(i)
            self.step.add_check(ys, ref, a.amax(), a.amin(), k, b_abs, None, coef)

    # -- the step ---------------------------------------------------------------------------------
    def _indices(self, key: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Device tensors of this step's per-call bookkeeping (product indices, coefficients)."""
        return cached(self._index_cache, key, lambda: tuple(torch.tensor(part, device=device) for part in key))

    def collect(self) -> dict[str, torch.Tensor] | None:
        """This step's (n_products,) tensor per :data:`GEMM_METRICS` (0 for a product not seen) on a
        checked step, only ``gemm_out`` on a scanned one, None if nothing was seen; resets."""
        self.traced.drain()
        st = self.step
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
            if self.keep_bounds:
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
        not run in it (neither checked nor scanned)."""
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
        from call ``start`` on, every call at once."""
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
        """Whether a product checked since the last call (in this step) has a ratio above ``bound``
        or NaN: the guard's trigger, one device sync."""
        self.traced.drain()
        st = self.step
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
        """The largest |column sum now - sealed| of each weight (and bias) compared from ``start`` on."""
        return (stack_rows(st.w_now[start:]) - stack_rows(st.w_then[start:])).abs_().amax(-1)

    def hook_forward(self, want: bool) -> None:
        """Register the forward hooks or remove them (a hooked module leaves PyTorch's fast call path)."""
        if want and not self._forward_handles:
            self._forward_handles = [m.register_forward_hook(hook) for m, hook in self._forward]
        elif not want and self._forward_handles:
            remove_hooks(self._forward_handles)

    def remove(self) -> None:
        """Remove every hook (and what the hooks kept on the modules)."""
        self.hook_forward(False)
        self.products.forget()
        remove_hooks(self._handles)
        for m in self._owners:
            lst = GEMM_OBSERVERS.get(m)
            if lst:
                lst[:] = [c for c in lst if c is not self]


def _turned(hook: Callable, grad: torch.Tensor) -> None:
    """``hook`` on the transpose of ``grad``: a ``Conv1D`` weight's gradient, as ``(out, in)``."""
    hook(grad.t())
