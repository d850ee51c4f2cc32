"""FSDP2 (``fully_shard``) and HSDP: the gradient statistics of a sharded model, measured in its
reduce-scatters (a custom reduce-scatter sees the local gradient, the all-reduce hook the reduced
shard); docs/integrations.md ("FSDP2 and HSDP") says where each metric comes from and why.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from sdcwatch.core.errors import ConfigError
from sdcwatch.telemetry.probes import fingerprint as fp
from sdcwatch.telemetry.probes.ddp_hook import float_dot
from torch import nn

if TYPE_CHECKING:
    from sdcwatch.telemetry.probes.gradients import GradientStats

__all__ = ["ShardedGradients", "fsdp_modules", "is_sharded", "local_tensors"]


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (the root first), in module order."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or a module in it) is sharded by FSDP2."""
    return bool(fsdp_modules(model))


def local_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's part of each tensor: ``to_local()`` of a DTensor, the tensor itself otherwise."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


class _MeasuredReduceScatter:
    """The reduce-scatter FSDP would run for one module, measuring its input first (see the module
    docstring). A ``torch.distributed.fsdp`` ``ReduceScatter`` by duck typing: ``allocate`` and the call."""

    def __init__(self, owner: "ShardedGradients", index: int, inner: Any) -> None:
        self.owner = owner
        self.index = index
        self.inner = inner

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.inner is not None:
            return self.inner.allocate(size, dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ):
        self.owner.before_reduce(self.index, input_tensor, group)
        if self.inner is not None:
            return self.inner(
                output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op
            )
        import torch.distributed as dist

        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _subclass_reduce_scatter() -> type:
    """:class:`_MeasuredReduceScatter` as a subclass of FSDP's ``ReduceScatter`` interface, where
    this torch has it (a private module: the duck-typed class works without it)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        return _MeasuredReduceScatter
    return type("MeasuredReduceScatter", (_MeasuredReduceScatter, ReduceScatter), {})


class ShardedGradients:
    """Gradient statistics of an FSDP2/HSDP model, measured in its reduce-scatters, into the step
    buffer of ``grads`` (a watch's gradient part); a reduce-scatter or all-reduce hook set before
    attaching runs inside the measured one."""

    def __init__(self, grads: "GradientStats", model: nn.Module) -> None:
        self._grads = grads
        self.modules = fsdp_modules(model)
        self._local: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # module -> (local sum sq, own chunk)
        self._measured: dict[int, tuple] = {}  # module -> (local sq, own sq, dot, reduced sq, fp parts)
        self._group: Any = None  # the reduce-scatter (shard) group, seen at the first reduce-scatter
        self._restore: list[Callable[[], None]] = []
        self._data_parallel = 1  # ranks FSDP reduces gradients over (its mesh: shards x replicas)
        cls = _subclass_reduce_scatter()
        for i, module in enumerate(self.modules):
            groups = _param_groups(module)
            if len(groups) > 1:
                raise ConfigError(
                    "probes.fsdp",
                    f"module {type(module).__name__} has {len(groups)} FSDP parameter groups (per-parameter "
                    "meshes): FSDP allows no custom reduce-scatter there, so its local gradient cannot be measured",
                )
            if not groups:  # fully_shard on a module without parameters of its own
                continue
            group = groups[0]
            mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
            self._data_parallel = max(self._data_parallel, mesh.size() if mesh is not None else 2)
            inner_comm, inner_hook = _custom_collectives(group)
            module.set_custom_reduce_scatter(cls(self, i, inner_comm))
            module.set_all_reduce_hook(self._after_reduce_hook(i, inner_hook))
            self._restore.append(_restorer(module, inner_comm, inner_hook))

    @property
    def _measuring(self) -> bool:
        return self._grads.measuring and not self._grads.watch.closed

    # -- in FSDP's backward: never raise into it --------------------------------------------------
    def before_reduce(self, index: int, grads: torch.Tensor, group: Any) -> None:
        """A module's reduce-scatter input ``grads``: its sum of squares and this rank's chunk."""
        self._group = group
        try:
            if not self._measuring:
                return
            with torch.no_grad():
                flat = grads.reshape(-1)
                size, rank = group.size(), group.rank()
                chunk = flat.view(size, -1)[rank].clone()  # FSDP pads the input to a multiple of the group
                self._local[index] = (float_dot(flat, flat), chunk)
        except Exception as exc:
            self._grads.watch.fail(exc)

    def _after_reduce_hook(self, index: int, inner: Callable | None) -> Callable[[torch.Tensor], None]:
        def hook(reduced: torch.Tensor) -> None:
            if inner is not None:  # the user's hook first: it may be the replicas' all-reduce itself
                inner(reduced)
            local = self._local.pop(index, None)
            try:
                if local is None or not self._measuring:
                    return
                local_sq, chunk = local
                with torch.no_grad():
                    out = reduced.reshape(-1)
                    want_fp = self._grads.fingerprint_due
                    self._measured[index] = (
                        local_sq,
                        float_dot(chunk, chunk),
                        float_dot(chunk, out),
                        float_dot(out, out),
                        fp.tensor_parts(out) if want_fp else None,
                    )
            except Exception as exc:
                self._grads.watch.fail(exc)

        return hook

    # -- at watch.step ----------------------------------------------------------------------------
    def reduce(self) -> None:
        """Close the step's gradient statistics into the watch's scalars (one all-reduce of one scalar
        over the shard group, on every rank at the same recorded step)."""
        import torch.distributed as dist

        measured = [self._measured[i] for i in sorted(self._measured)]
        self._measured.clear()
        self._local.clear()
        for m in measured:  # made on FSDP's reduce-scatter and all-reduce streams, read on this one
            for t in m:
                if t is not None and t.is_cuda:
                    t.record_stream(torch.cuda.current_stream(t.device))
        group = self._group
        if group is None:  # FSDP ran no reduce-scatter: no backward, or a shard group of one
            self._unreduced()
            return
        if measured:
            local_sq, own_sq, dot, out_sq = (torch.stack([m[k] for m in measured]).sum() for k in range(4))
        else:  # a hook failed on this rank: still take part in the all-reduce the others run
            local_sq = own_sq = dot = out_sq = torch.full((), float("nan"))
        global_sq = out_sq.detach().clone().reshape(1).double()
        if group.size() > 1:
            dist.all_reduce(global_sq, group=group)
        if not measured:
            return
        buf = self._grads.buffer
        buf.scalars["grad_norm_local"] = local_sq.sqrt()
        buf.scalars["grad_norm_global"] = global_sq.reshape(()).sqrt().to(out_sq.dtype)
        buf.scalars["grad_cosine"] = dot / (own_sq.sqrt() * out_sq.sqrt()).clamp_min(1e-30)
        parts = [m[4] for m in measured]
        if all(p is not None for p in parts):
            buf.fps["grad_fp"] = fp.combine_parts(parts)
        buf.grads_seen = True

    def before_optimizer(self) -> None:
        """The optimizer's pre-step hook: where a single process reads its gradient (no collective
        here: a rank that skips its optimizer step must not leave the others waiting)."""
        if self._group is None and self._measuring and not self._grads.buffer.grads_seen:
            self._unreduced()

    def _unreduced(self) -> None:
        """No data parallelism (FSDP skips the collective for a shard group of one): the gradient is
        the rank's own, local is global, as for a model without data parallelism. Under tensor
        parallelism with a data-parallel mesh of one, the rank's piece of it."""
        if self._grads.buffer.grads_seen or self._data_parallel > 1:
            return  # replicas without shards (HSDP of shard size 1): the local gradient is not seen
        self._grads.read_world1(local_tensors(p.grad for p in self._grads.params if p.grad is not None))

    def remove(self) -> None:
        """Give FSDP back the reduce-scatter and hook it had before."""
        for restore in self._restore:
            try:
                restore()
            except Exception as exc:  # a torch whose FSDP internals moved: the measured comm stays, idle
                warnings.warn(f"sdcwatch: could not restore FSDP's reduce-scatter ({exc})", RuntimeWarning)
        self._restore.clear()


# FSDP2 has setters for its custom reduce-scatter and all-reduce hook but no getters, nor a public
# list of a module's parameter groups: the two functions below read FSDP's own state for them
def _param_groups(module: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before per-parameter meshes: one group or none
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    return list(groups)


def _custom_collectives(group: Any) -> tuple[Any, Any]:
    """(custom reduce-scatter, all-reduce hook) set on an FSDP parameter group before attaching."""
    return getattr(group, "_reduce_scatter_comm", None), getattr(group, "_all_reduce_hook", None)


def _restorer(module: Any, comm: Any, hook: Any) -> Callable[[], None]:
    def restore() -> None:
        if comm is not None:
            module.set_custom_reduce_scatter(comm)
        module.set_all_reduce_hook(hook)

    return restore
