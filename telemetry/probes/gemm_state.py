"""The state the parts of the matrix checksums share: the table of products (:class:`ProductTable`),
a weight's sealed reductions (:class:`SealedWeight`), one step's measurements (:class:`StepChecks`),
and which checks report a custom product (:func:`observe_gemm`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Any

import torch
from sdcwatch.telemetry.probes.checksum_bounds import accumulated_sum, accumulation_dtype, memory_bound_of
from sdcwatch.telemetry.probes.compiled_calls import cached, kept_calls
from sdcwatch.telemetry.probes.weight_sums import weight_sums
from torch import nn

__all__ = [
    "ProductTable",
    "zero_of",
    "SealedWeight",
    "StepChecks",
    "stack_rows",
    "call_peaks",
    "is_shard",
    "local_part",
    "holds_whole_rows",
    "observe_gemm",
    "GEMM_OBSERVERS",
]


#: Custom-GEMM owner (a module) -> the GemmChecks that report it; weak so a dropped model leaves no trace.
GEMM_OBSERVERS: "weakref.WeakKeyDictionary[nn.Module, list[Any]]" = weakref.WeakKeyDictionary()


def observe_gemm(
    owner: nn.Module, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """Report one custom or fused product ``c = a @ b (+ bias)`` computed inside ``owner``.

    Every :class:`GemmChecks` attached to the model that holds ``owner`` checks it on its sampled
    steps, as a layer of the ``gemm_*`` metrics named after ``owner``. One dictionary look-up otherwise.
    """
    observers = GEMM_OBSERVERS.get(owner)
    if observers:
        for checks in observers:
            checks.observe(owner, a, b, c, bias)


def stack_rows(vectors: list[torch.Tensor]) -> torch.Tensor:
    """The calls' vectors as the rows of one matrix, zero-padded to the longest (a zero never
    raises a largest |value|): every call is then reduced by one operation."""
    if len(vectors) == 1:
        return vectors[0].unsqueeze(0)
    n = vectors[0].numel()
    if all(v.numel() == n for v in vectors):
        return torch.stack(vectors)
    return torch.nn.utils.rnn.pad_sequence(vectors, batch_first=True)


_CHUNKS: dict[tuple, torch.Tensor] = {}


def call_peaks(vectors: list[torch.Tensor]) -> torch.Tensor:
    """``stack_rows(vectors).abs_().amax(-1)`` (NaN kept) in a few operations whatever the lengths:
    the lengths share a factor (the step's tokens), so the concatenated vectors cut into rows of it
    are reduced at once, then each call's rows by one small scatter (no zero-padding copies).
    """
    if len(vectors) == 1:
        return vectors[0].abs().amax().reshape(1)
    sizes = tuple(v.numel() for v in vectors)
    chunk = math.gcd(*sizes)
    if chunk < 64:  # no common length worth reducing by: pad
        return stack_rows(vectors).abs_().amax(-1)
    peaks = torch.cat(vectors).abs_().view(-1, chunk).amax(-1)
    if peaks.numel() == len(vectors):  # every call one row (the same length)
        return peaks

    def call_of_row() -> torch.Tensor:  # a step calls the products as the previous one did: cached
        rows = torch.tensor([n // chunk for n in sizes])
        return torch.repeat_interleave(torch.arange(len(sizes)), rows).to(peaks.device)

    index = cached(_CHUNKS, (sizes, peaks.device), call_of_row)
    return torch.zeros(len(vectors), dtype=peaks.dtype, device=peaks.device).scatter_reduce_(0, index, peaks, "amax")


class ProductTable:
    """The checked products by index (in the ``gemm_*`` metrics): name, module, seal, whether the
    bias gradient is checked. Compiled code finds a call's list and a seal on the module itself."""

    _serials = itertools.count()

    def __init__(self) -> None:
        serial = next(self._serials)
        self.calls_attr = f"_sdcwatch_calls_{serial}"
        self.seal_attr = f"_sdcwatch_seal_{serial}"
        self.names: list[str] = []
        self.modules: list[nn.Module] = []
        self.seals: list[SealedWeight | None] = []
        self.bias_checked: list[bool] = []
        self._index: dict[int, int] = {}  # id(module) -> product index

    def __len__(self) -> int:
        return len(self.names)

    def add(self, name: str, module: nn.Module) -> int:
        self.names.append(name)
        self.modules.append(module)
        self.seals.append(None)
        self.bias_checked.append(False)
        self._index[id(module)] = len(self.names) - 1
        module.__dict__[self.calls_attr] = []
        module.__dict__[self.seal_attr] = None
        return len(self.names) - 1

    def index_of(self, module: nn.Module) -> int:
        return self._index[id(module)]

    def set_seal(self, i: int, sealed: SealedWeight | None) -> None:
        """Product ``i``'s seal, kept in the table and on its module (for compiled code)."""
        self.seals[i] = sealed
        self.modules[i].__dict__[self.seal_attr] = sealed

    def seal_on(self, module: nn.Module) -> SealedWeight | None:
        return module.__dict__.get(self.seal_attr)

    def calls_on(self, module: nn.Module) -> list | None:
        return module.__dict__.get(self.calls_attr)

    def take_calls(self) -> list[tuple[int, Any]]:
        return kept_calls(self.modules, self.calls_attr)

    def forget(self) -> None:
        for m in self.modules:
            m.__dict__.pop(self.calls_attr, None)
            m.__dict__.pop(self.seal_attr, None)


_ZEROS: dict[tuple, torch.Tensor] = {}


def zero_of(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d zero of ``dtype`` on ``device`` (kept: the bias term of a product without one)."""
    if torch.compiler.is_compiling():  # a constant of the graph (a cache filled on the first step is a guard)
        return torch.zeros((), dtype=dtype, device=device)
    return cached(_ZEROS, (dtype, str(device)), lambda: torch.zeros((), dtype=dtype, device=device))


class SealedWeight:
    """A weight's reductions taken when the optimizer last wrote it: its column sums (the weight
    check's reference) and the norms the forward bound needs.

    A *provisional* seal, taken before any optimizer step, keeps one compiled graph for every
    checked step; its bounds are infinite, so weights loaded after attaching (a checkpoint) are not
    taken for weights changed in memory. Eager code ignores it.
    """

    __slots__ = ("v", "b_sum", "k", "b_abs", "w_bound", "b_bound", "shard", "provisional", "trust")

    def __init__(
        self, w: torch.Tensor, b: torch.Tensor | None, *, provisional: bool = False, triton: bool = True
    ) -> None:
        acc = accumulation_dtype(w.dtype)
        self.provisional = provisional
        # an FSDP2 shard (a DTensor): the rank's own shard is sealed, and checked in the forward
        # against itself (the forward's all-gathered weight is every rank's)
        self.shard = (w, b) if is_shard(w) else None
        if self.shard is not None:
            w, b = w.to_local(), None if b is None else b.to_local()
        # the column sums (as the check takes them: the same bits give the same sum, to rounding on
        # a GPU) and Σ_j ||w_j||, in one read of the weight where the Triton kernel runs
        self.v, sw = weight_sums(w, acc, use_triton=None if triton else False)
        self.k = sw * math.sqrt(w.shape[1])  # Σ||w_j|| x sqrt(n): the forward bound's weight factor
        self.w_bound = memory_bound_of(sw, w.shape[0])
        self.b_sum = self.b_abs = self.b_bound = None
        if isinstance(b, torch.Tensor):
            self.b_sum = accumulated_sum(b, None, acc)
            self.b_abs = accumulated_sum(b.abs(), None, acc)
            self.b_bound = memory_bound_of(self.b_abs, b.numel())
        # what compiled code multiplies the forward check's bound by (a tensor, so that a provisional
        # and an optimizer's seal run the same graph): 1, or inf for a provisional seal
        self.trust = torch.full_like(self.w_bound, math.inf if provisional else 1.0)
        if provisional:  # no difference from a provisional seal is ever a violation (NaN still is)
            self.w_bound = torch.full_like(self.w_bound, math.inf)
            self.b_bound = None if self.b_bound is None else torch.full_like(self.b_bound, math.inf)
        if self.shard is not None:  # a shard's norms are not the whole weight's the forward bound needs
            self.k = self.b_abs = None


class StepChecks:
    """What the hooks measured in one step, as lists of device tensors (one entry per call), the
    calls numbered by ``order`` (a :class:`~sdcwatch.telemetry.probes.forward_order.ForwardOrder`) if any."""

    def __init__(self, order: Any = None) -> None:
        self.order = order
        self.clear()

    def clear(self) -> None:
        self.weights_seen: set[int] = set()  # products whose weights were compared this step
        self.f_seq: list[int] = []  # the forward ordinals of the checked calls and of the scanned calls
        self.o_seq: list[int] = []
        # forward checks: product index, row sums and reference, input extremes, the bound's factor
        # of the input (Σ||w_j|| sqrt(n)) and constant term (Σ|b|), the rounding coefficient
        self.f_idx: list[int] = []
        self.f_ys: list[torch.Tensor] = []  # row sums of the output
        self.f_ref: list[torch.Tensor] = []  # what they should be: x (W^T 1) + Σ b
        self.f_xhi: list[torch.Tensor] = []  # the input's largest and smallest value (max |x| at the step's end)
        self.f_xlo: list[torch.Tensor] = []
        self.f_k: list[torch.Tensor] = []
        self.f_b: list[torch.Tensor] = []
        self.f_coef: list[float] = []
        self.f_trust: list[torch.Tensor | None] = []  # traced checks: 1, or inf against a provisional seal
        # scanned (not checked) calls: product index, the output's row sums
        self.o_idx: list[int] = []
        self.o_ys: list[torch.Tensor] = []
        # weights in memory against their sealed sums: product index, column sums now and sealed, bound
        self.w_idx: list[int] = []
        self.w_now: list[torch.Tensor] = []
        self.w_then: list[torch.Tensor] = []
        self.w_bound: list[torch.Tensor] = []
        self.w_names: list[str] = []
        # gradients: product index, residual (vector for the weight, 0-d for the bias), bound
        self.g_idx: list[int] = []
        self.g_res: list[torch.Tensor] = []
        self.g_bound: list[torch.Tensor] = []
        self.g_names: list[str] = []

    def checked(self, i: int) -> None:
        self.f_idx.append(i)
        if self.order is not None:
            self.f_seq.append(self.order.tick())

    def add_check(self, ys, ref, hi, lo, k, b_abs, trust, coef: float) -> None:  # noqa: ANN001 - tensors
        """The reductions of one call :meth:`checked` noted."""
        self.f_ys.append(ys)
        self.f_ref.append(ref)
        self.f_xhi.append(hi)
        self.f_xlo.append(lo)
        self.f_k.append(k)
        self.f_b.append(b_abs)
        self.f_trust.append(trust)
        self.f_coef.append(coef)

    def compare_weight(
        self, i: int, name: str, sealed: SealedWeight, vw: torch.Tensor, bw: torch.Tensor | None
    ) -> None:
        """Keep product ``i``'s weight (and bias) sums now beside the sealed ones: the same reduction
        of the same bits, so a difference past rounding is a weight changed in memory."""
        self.weights_seen.add(i)
        self.w_idx.append(i)
        self.w_now.append(vw)
        self.w_then.append(sealed.v)
        self.w_bound.append(sealed.w_bound)
        self.w_names.append(name + ".weight")
        if bw is not None and sealed.b_sum is not None:
            self.w_idx.append(i)
            self.w_now.append(bw.reshape(1))
            self.w_then.append(sealed.b_sum.reshape(1))
            self.w_bound.append(sealed.b_bound)
            self.w_names.append(name + ".bias")

    def scanned(self, i: int) -> None:
        self.o_idx.append(i)
        if self.order is not None:
            self.o_seq.append(self.order.tick())

    def add_grad(self, i: int, name: str, residual: torch.Tensor, bound: torch.Tensor) -> None:
        """A gradient check of product ``i`` (``name``: its weight or bias)."""
        self.g_idx.append(i)
        self.g_res.append(residual)
        self.g_bound.append(bound)
        self.g_names.append(name)

    def traced_ordinal(self) -> torch.Tensor | None:
        """The ordinal of a call in traced code (:meth:`ForwardOrder.traced_tick`), None without an order."""
        return self.order.traced_tick() if self.order is not None else None

    def note(self, seq: list[int], top: torch.Tensor) -> None:
        """The largest |row sum| of the calls numbered ``seq``, for the order."""
        if self.order is not None:
            self.order.note(seq, top)


def is_shard(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor shard (FSDP2), outside the autograd graph and the forward's weight."""
    return hasattr(t, "to_local")


def local_part(t: Any) -> Any:
    """This rank's part of a DTensor (tensor parallelism), anything else as it is."""
    return t.to_local() if t is not None and is_shard(t) else t


def holds_whole_rows(w: Any) -> bool:
    """Whether this rank holds whole rows of a tensor-parallel weight (``ColwiseParallel``: a
    complete product of its own). Under ``RowwiseParallel`` the hook sees the ranks' all-reduced sum."""
    return not any(p.is_shard() and getattr(p, "dim", 0) % w.dim() == 1 for p in getattr(w, "placements", ()))
