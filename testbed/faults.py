"""Fault injection: the injector that applies fault specs (:mod:`sdcwatch.testbed.faultspec`)
to a model, through forward and gradient hooks, on the fault's rank, steps and target.

It is both the test instrument of sdcwatch and a feature: users inject faults into their own run
to check their alerting. Every random choice derives from ``(seed, step, rank)``: a fault is
deterministic, and touches nothing outside its rank, steps and target. Each fault says, once per
rank, when it first fires (an INFO line of the ``sdcwatch.faults`` logger). It knows a guard's
rerun of a step (``begin_step`` again for the same step, before ``end_step``): a fault of one step is transient and
leaves the rerun alone; a lasting one hits it again.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from sdcwatch.core.errors import FaultSpecError
from sdcwatch.telemetry.probes.output_faults import OutputFault
from sdcwatch.testbed.faultspec import ELEMENT_KINDS, NEAR_INF, TENSOR_KINDS, FaultSpec

if TYPE_CHECKING:
    import torch

__all__ = ["FaultInjector", "Injection", "flip_bit"]

log = logging.getLogger("sdcwatch.faults")


def flip_bit(t: "torch.Tensor", index: int, bit: int) -> None:
    """Flip bit ``bit`` of flat element ``index`` of ``t`` in place (no autograd)."""
    import torch

    size = t.element_size()
    if bit >= 8 * size:
        raise FaultSpecError("bit", f"{bit} is outside a {t.dtype} element ({8 * size} bits)")
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    ints = t.view(-1).view(as_int)
    mask = 1 << bit
    if bit == 8 * size - 1:  # the sign bit: the mask is the most negative value of the int type
        mask -= 1 << (8 * size)
    ints[index] ^= mask


@dataclass
class Injection:
    """One application of a fault, kept for tests and logs (values stay on the device)."""

    step: int
    rank: int
    kind: str
    where: str
    target: str
    index: int | None = None
    before: Any = None
    after: Any = None


def _rng(spec_index: int, spec: FaultSpec, step: int, rank: int) -> random.Random:
    return random.Random(f"sdcwatch-fault:{spec.seed}:{spec_index}:{step}:{rank}")


class FaultInjector:
    """Applies :class:`FaultSpec` s to one model replica through forward and gradient hooks.

    Real data parallelism: one injector per rank (``rank=``), ``attach(model, optimizer)``,
    then ``begin_step(step)`` before the forward, ``batch = corrupt_batch(batch)`` on the data,
    and ``end_step()`` after the optimizer step. The simulated driver sets :attr:`rank` before
    each virtual rank's forward instead.

    ``begin_step`` again for the same step and rank before ``end_step`` starts a rerun (:attr:`rerun`):
    a hardware fault of one step (``duration`` 1) is transient and does not fire on a rerun, a
    lasting one (``duration`` 0 or above 1) is persistent and fires on every pass; the data
    (``bad_batch``) is the same on every pass, and an lr spike or a parameter fault is applied once.
    """

    def __init__(self, faults: Iterable[FaultSpec] = (), *, rank: int = 0) -> None:
        self.faults: list[FaultSpec] = list(faults)
        for f in self.faults:
            if not isinstance(f, FaultSpec):
                raise FaultSpecError("fault", f"expected a FaultSpec, got {type(f).__name__}")
        self.rank = rank
        self.step = -1
        self.rerun = 0
        """The pass of the current step: 0 the first, 1 and on a rerun of it."""
        self.injections: list[Injection] = []
        # CPU seconds (this thread's) spent corrupting values: a simulated driver takes them out of
        # the rank's step time, so an injected fault does not also make its rank look slow
        self.cpu_seconds = 0.0
        self._handles: list[Any] = []
        self._done: set[tuple[int, int, int, int]] = set()
        self._fired: set[tuple[int, int]] = set()  # (fault, rank) already announced in the log
        self._targets: dict[int, list[str]] = {}
        self._param_targets: dict[int, list[tuple[str, "torch.Tensor"]]] = {}
        self._optimizer = None
        self._saved_lrs: list[float] | None = None
        self._entered: tuple[int, int] | None = None  # (step, rank) until end_step: entered again, a rerun
        self._modules: dict[str, Any] = {}

    # -- wiring -------------------------------------------------------------------------------
    def attach(self, model: "torch.nn.Module", optimizer: Any = None) -> "FaultInjector":
        """Register hooks on the modules each fault targets; a glob matching nothing is an error. As
        ``attach()`` does, a DDP or ``torch.compile`` wrapper is looked through: targets name the model's modules."""
        import torch

        model = getattr(model, "_orig_mod", model)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = getattr(model.module, "_orig_mod", model.module)
        self._optimizer = optimizer
        self._modules = dict(model.named_modules())
        names = [n for n in self._modules if n]
        for i, spec in enumerate(self.faults):
            if spec.kind not in TENSOR_KINDS:
                continue
            matched = sorted(n for n in names if fnmatch.fnmatchcase(n, spec.target))
            if spec.where in ("grad", "param"):
                params = [
                    (f"{n}.{pn}", p) for n in matched for pn, p in self._modules[n].named_parameters(recurse=False)
                ]
                if not params:
                    raise FaultSpecError(
                        "target", f"{spec.target!r} matches no module with parameters (modules: {_sample(names)})"
                    )
                self._param_targets[i] = params
                sharded = [n for n, p in params if hasattr(p, "to_local")]
                if spec.where == "grad" and sharded:
                    raise FaultSpecError(
                        "where",
                        f"'grad' cannot reach {sharded[0]!r}: an FSDP2 shard is outside the autograd graph "
                        "(its hooks never fire); inject at the module's 'output' instead",
                    )
                if spec.where == "grad":
                    for pname, p in params:
                        self._handles.append(p.register_hook(self._grad_hook(i, spec, pname)))
            else:
                if not matched:
                    raise FaultSpecError("target", f"{spec.target!r} matches no module (modules: {_sample(names)})")
                self._targets[i] = matched
                for n in matched:
                    # first among the module's forward hooks, whenever the probes (or anything else)
                    # registered theirs: every observer sees the corrupted output, as with real hardware
                    hook = OutputFault(self._output_hook(i, spec, n))  # whatever a subclass makes of it
                    self._handles.append(self._modules[n].register_forward_hook(hook, prepend=True))
        return self

    def detach(self) -> None:
        """Remove every hook this injector registered."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def active(self, kind: str | None = None) -> list[FaultSpec]:
        """Faults active at the current step on the current rank (optionally of one kind)."""
        return [f for f in self.faults if f.hits(self.step, self.rank) and (kind is None or f.kind == kind)]

    def _fires(self, spec: FaultSpec) -> bool:
        """Whether a hardware fault hits this pass: at its steps and rank, and on a rerun only when it lasts."""
        return spec.hits(self.step, self.rank) and (self.rerun == 0 or spec.duration != 1)

    # -- per step ------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Enter ``step``: apply lr spikes (restored by :meth:`end_step`) and parameter faults; or,
        for the step already entered, begin a rerun of it (nothing applied again)."""
        if self._entered == (step, self.rank):
            self.rerun += 1
            return
        self.step, self.rerun, self._entered = step, 0, (step, self.rank)
        factor = self.lr_factor()
        for i, f in enumerate(self.faults):
            if f.kind == "lr_spike" and f.hits(step, self.rank):
                self._announce(i, "optimizer", "lr")
        if self._optimizer is not None and factor != 1.0:
            self._saved_lrs = [g["lr"] for g in self._optimizer.param_groups]
            for g in self._optimizer.param_groups:
                g["lr"] = g["lr"] * factor
        self.apply_param_faults()

    def end_step(self) -> None:
        """Leave the step: restore the learning rates an lr_spike changed."""
        self._entered = None
        if self._saved_lrs is not None and self._optimizer is not None:
            for g, lr in zip(self._optimizer.param_groups, self._saved_lrs):
                g["lr"] = lr
        self._saved_lrs = None

    def lr_factor(self) -> float:
        """Product of the active lr_spike factors for the current rank and step."""
        factor = 1.0
        for f in self.active("lr_spike"):
            factor *= float(f.magnitude)
        return factor

    def corrupt_batch(self, tokens: "torch.Tensor", vocab: int = 256) -> "torch.Tensor":
        """The batch, or garbage tokens of the same shape when a bad_batch fault is active."""
        import torch

        for i, f in enumerate(self.faults):
            if f.kind == "bad_batch" and f.hits(self.step, self.rank):
                gen = torch.Generator().manual_seed(_rng(i, f, self.step, self.rank).getrandbits(63))
                garbage = torch.randint(0, vocab, tokens.shape, generator=gen, dtype=torch.int64)
                self._record(i, Injection(self.step, self.rank, f.kind, "data", "batch"))
                return garbage.to(device=tokens.device, dtype=tokens.dtype)
        return tokens

    def apply_param_faults(self) -> list[str]:
        """Apply ``where: "param"`` faults that start now on this rank; returns parameter names hit."""
        import torch

        hit = []
        for i, f in enumerate(self.faults):
            if f.where != "param" or f.step != self.step or not f.hits(self.step, self.rank):
                continue
            rng = _rng(i, f, self.step, self.rank)
            params = self._param_targets[i]
            if f.kind in ELEMENT_KINDS:
                name, p = params[rng.randrange(len(params))]
                with torch.no_grad():
                    self._apply(i, f, _local(p), name, rng)
            else:
                for name, p in params:
                    with torch.no_grad():
                        _local(p).copy_(self._transform(i, f, _local(p), name, rng))
            hit.append(name)
        return hit

    # -- hooks ---------------------------------------------------------------------------------
    def _claim(self, i: int) -> bool:
        """One-element faults fire once per (fault, step, rank, pass), whatever calls the module again."""
        key = (i, self.step, self.rank, self.rerun)
        if key in self._done:
            return False
        self._done.add(key)
        return True

    def _output_hook(self, i: int, spec: FaultSpec, name: str):
        def hook(module, inputs, output):
            if not self._fires(spec):
                return None
            rng = _rng(i, spec, self.step, self.rank)
            if spec.kind in ELEMENT_KINDS:
                targets = self._targets[i]
                if targets[rng.randrange(len(targets))] != name or not self._claim(i):
                    return None
            tensor, rebuild = _local_part(*_first_tensor(output))
            if tensor is None:
                return None
            t0 = time.thread_time()
            out = rebuild(self._transform(i, spec, tensor, name, rng))
            self.cpu_seconds += time.thread_time() - t0
            return out

        return hook

    def _grad_hook(self, i: int, spec: FaultSpec, pname: str):
        def hook(grad):
            if not self._fires(spec):
                return None
            rng = _rng(i, spec, self.step, self.rank)
            if spec.kind in ELEMENT_KINDS:
                params = self._param_targets[i]
                if params[rng.randrange(len(params))][0] != pname or not self._claim(i):
                    return None
            t0 = time.thread_time()
            out = self._transform(i, spec, grad, pname, rng)
            self.cpu_seconds += time.thread_time() - t0
            return out

        return hook

    def _transform(self, i: int, spec: FaultSpec, x: "torch.Tensor", name: str, rng: random.Random):
        """A corrupted copy of ``x`` (keeps autograd through the untouched elements)."""
        import torch

        if spec.kind == "scale":
            self._record(i, Injection(self.step, self.rank, spec.kind, spec.where, name))
            return x * spec.magnitude
        if spec.kind == "noise":
            gen = torch.Generator(device=x.device).manual_seed(rng.getrandbits(63))
            noise = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
            finite = x.detach().float()
            finite = torch.where(torch.isfinite(finite), finite, torch.zeros((), device=x.device))
            rms = finite.pow(2).mean().sqrt().to(x.dtype)  # masked -inf logits must not make it inf
            self._record(i, Injection(self.step, self.rank, spec.kind, spec.where, name))
            return x + noise * (rms * spec.magnitude)
        out = x.clone()
        with torch.no_grad():
            self._apply(i, spec, out, name, rng)
        return out

    def _pick(self, spec: FaultSpec, t: "torch.Tensor", name: str, rng: random.Random) -> int:
        """The flat index of the element of ``t`` a one-element fault changes (any, here)."""
        return rng.randrange(t.numel())

    def _apply(self, i: int, spec: FaultSpec, t: "torch.Tensor", name: str, rng: random.Random) -> None:
        """Change exactly one element of ``t`` in place, as ``spec`` says."""
        index = self._pick(spec, t, name, rng)
        flat = t.view(-1)
        before = flat[index].detach().clone()
        if spec.kind == "bitflip":
            flip_bit(t, index, spec.bit)
        elif spec.kind == "near_inf":
            flat[index] = at_least(spec.value, t.dtype)
        else:
            flat[index] = spec.value
        self._record(
            i, Injection(self.step, self.rank, spec.kind, spec.where, name, index, before, flat[index].detach().clone())
        )

    def _record(self, i: int, injection: Injection) -> None:
        """Keep ``injection`` (fault ``i`` applied) and announce the fault if it is its first on this rank."""
        self.injections.append(injection)
        self._announce(i, injection.where, injection.target)

    def _announce(self, i: int, where: str, target: str) -> None:
        """One INFO line when fault ``i`` first fires on this rank: not one a step of a lasting fault."""
        if (i, self.rank) in self._fired:
            return
        self._fired.add((i, self.rank))
        spec = self.faults[i]
        if spec.duration == 1:
            lasting = ""
        elif spec.duration == 0:
            lasting = "; on to the end of the run"
        else:
            lasting = f"; on until step {spec.step + spec.duration - 1}"
        log.info(
            "fault %d fired on rank %d at step %d: %s at %s (%s)%s",
            i,
            self.rank,
            self.step,
            spec.kind,
            target,
            where,
            lasting,
        )


def at_least(value: float, dtype: "torch.dtype") -> "torch.Tensor":
    """``value`` as a 0-d CPU tensor of ``dtype``, still near-INF: rounded to nearest, unless that
    takes a value at or above the near-INF threshold below it (1e10 is 9.9992e9 in bf16), then the
    next one away from zero."""
    import torch

    v = torch.tensor(value, dtype=dtype)
    if math.isfinite(value) and abs(value) >= NEAR_INF > abs(float(v)):
        v = torch.nextafter(v, torch.tensor(math.copysign(math.inf, value), dtype=dtype))
    return v


def _local(p: "torch.Tensor") -> "torch.Tensor":
    """The memory this rank holds of a parameter: its local shard under FSDP2 (a DTensor), else its data."""
    data = p.data
    return data.to_local() if hasattr(data, "to_local") else data


def _first_tensor(output: Any):
    """The tensor to corrupt in a module's output, and how to put the result back."""
    import torch

    if isinstance(output, torch.Tensor):
        return output, lambda t: t
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0], lambda t: type(output)([t, *output[1:]])
    return None, None


def _local_part(tensor: Any, rebuild: Any):
    """This rank's part of a DTensor output, and how to put a corrupted part back. Under tensor
    parallelism the injector's hook runs before the output hook ``parallelize_module`` registered,
    on the DTensor of the rank's product (a row-parallel one's partial sum, before its all-reduce):
    the fault hits this rank's product, as a faulty device would. Changing the DTensor itself
    would be a distributed operation run by one rank only (a collective the others never join)."""
    if tensor is None or not hasattr(tensor, "to_local"):
        return tensor, rebuild
    dt = type(tensor)

    def back(local: Any) -> Any:
        return rebuild(
            dt.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
        )

    return tensor.to_local(), back


def _sample(names: Sequence[str], n: int = 8) -> str:
    shown = ", ".join(names[:n])
    return shown + (", ..." if len(names) > n else "")
