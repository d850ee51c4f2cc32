"""The DDP communication hook: the all-reduce (average) DDP would do, bit for bit the same, measuring
each gradient bucket before and after it (local and global sums of squares, their dot product, the
all-reduced gradient's fingerprint) without keeping a copy of the gradient beyond one bucket.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from sdcwatch.telemetry.probes import fingerprint as fp

if TYPE_CHECKING:
    from sdcwatch.telemetry.probes.gradients import GradientStats

__all__ = ["comm_hook"]


def float_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot product of two flat buckets in float32 or wider, without a temporary of their size
    (three such temporaries a bucket cost about ten times more)."""
    if a.dtype not in (torch.float32, torch.float64):
        a, b = a.float(), b.float()
    return torch.dot(a.reshape(-1), b.reshape(-1))


def comm_hook(grads: GradientStats, bucket):  # noqa: ANN001,ANN201 - DDP rejects string annotations here
    """DDP all-reduce (average) that also measures the bucket before and after the reduction, into
    the step buffer of ``grads`` (the watch's gradient part, DDP's hook state)."""
    import torch.distributed as dist

    group = grads.group if grads.group is not None else dist.group.WORLD
    buf = bucket.buffer()
    measure = grads.measuring
    if measure:
        local = buf.detach().clone()  # transient, one bucket: the local gradient for the dot product
        local_sq = float_dot(local, local)
    # as DDP's own reducer averages without a hook: times the reciprocal of the world size (dividing
    # instead gives other bits at a world size that is not a power of two)
    buf.mul_(1.0 / dist.get_world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    if not measure:
        return fut.then(lambda f: f.value()[0])
    index = bucket.index()
    want_fp = grads.fingerprint_due

    def measured(f: Any) -> torch.Tensor:
        g = f.value()[0]
        with torch.no_grad():
            grads.buffer.buckets.append(
                (index, local_sq, float_dot(local, g), float_dot(g, g), fp.tensor_parts(g) if want_fp else None)
            )
        return g

    return fut.then(measured)
