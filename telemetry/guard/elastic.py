"""Elastic eviction (``GuardConfig(on_evict="leave")``): the replica group of an evicted rank leaves
the job's quorum at a step boundary and the others go on; :class:`TorchFTMembership` does it over
torchft. Importing this module imports neither torch nor torchft.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

from sdcwatch.core.validate import check_int
from sdcwatch.telemetry.guard.checks import TensorAgreement

__all__ = ["ReplicaMembership", "TorchFTMembership", "TorchFTAgreement", "leave_quorum"]


@runtime_checkable
class ReplicaMembership(Protocol):
    """Who is in the job's quorum of replica groups (the ranks holding one copy of the model), and
    how a group leaves it."""

    min_replicas: int
    """The fewest replica groups the job may go on with (below it the guard evicts by exiting)."""

    def replica_of(self, rank: int) -> int:
        """The replica group that holds global ``rank``."""
        ...

    def replicas(self) -> int:
        """How many replica groups are in the quorum now."""
        ...

    def agreement(self) -> Any:
        """The guard's agreement across every process still in, or None to keep the guard's own."""
        ...

    def leave(self, step: int, replicas: Iterable[int]) -> bool:
        """``replicas`` leave the quorum after ``step`` (every process); False: this one's group left."""
        ...


def leave_quorum(
    membership: ReplicaMembership, step: int, ranks: Sequence[int], hosts: Sequence[str], reason: str, out: Any
) -> Any:
    """The eviction of ``ranks`` by ``membership``: their replica groups leave after ``step``, ``out``
    says so (action ``leave``); None, changing nothing, when too few groups would be left."""
    going = sorted({membership.replica_of(r) for r in ranks})
    remaining = membership.replicas() - len(going)
    if remaining < max(1, membership.min_replicas):
        return None
    named = ", ".join(f"rank {r}" + (f" (host {h})" if h else "") for r, h in zip(ranks, hosts))
    out.action, out.ranks = "leave", tuple(ranks)
    out.message = (
        f"sdcwatch guard: {named} left the quorum after step {step} with replica group(s) "
        f"{', '.join(map(str, going))}: {reason}; the other {remaining} group(s) go on from step {step + 1}, "
        f"no restart"
    )
    out.applied = bool(membership.leave(step, going))
    return out


class TorchFTAgreement(TensorAgreement):
    """The guard's agreement over torchft: an all-reduce across replica groups through the ``Manager``,
    then one inside the group (``group``) for groups of more than one process."""

    def __init__(self, manager: Any, *, rank: int, world: int, group: Any = None) -> None:
        self.manager, self.rank, self.world, self.group = manager, int(rank), int(world), group

    def reduce(self, t: Any, op: str) -> Any:
        from torch.distributed import ReduceOp

        red = ReduceOp.MAX if op == "max" else ReduceOp.SUM
        self.manager.allreduce(t, reduce_op=red).wait()
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(t, op=red, group=self.group)
        return t


class TorchFTMembership:
    """Replica groups as torchft sees them: a ``torchft.Manager`` per group, a lighthouse quorum;
    global rank = ``replica`` x ``group_size`` + ``group_rank``. Leaving shuts this group's manager
    down: the lighthouse forms the next quorum from the others. ``group``: a torch.distributed group
    of this replica's ranks (groups of more than one process).
    """

    def __init__(
        self,
        manager: Any,
        *,
        replica: int,
        replicas: int,
        group_rank: int = 0,
        group_size: int = 1,
        group: Any = None,
        min_replicas: int = 1,
    ) -> None:
        check_int("elastic.replicas", replicas, lo=1)
        check_int("elastic.replica", replica, lo=0, hi=replicas - 1)
        check_int("elastic.group_size", group_size, lo=1)
        self.manager, self.replica, self.group_size, self.group = manager, replica, group_size, group
        self.min_replicas = int(min_replicas)
        self.rank = replica * group_size + int(group_rank)
        self.world = replicas * group_size
        self._in = set(range(replicas))
        self.left_at: int | None = None  # the step after which this process's group left

    def replica_of(self, rank: int) -> int:
        return int(rank) // self.group_size

    def replicas(self) -> int:
        return len(self._in)

    def agreement(self) -> TorchFTAgreement:
        return TorchFTAgreement(self.manager, rank=self.rank, world=self.world, group=self.group)

    def leave(self, step: int, replicas: Iterable[int]) -> bool:
        going = set(replicas)
        self._in -= going
        if self.replica not in going:
            return True
        self.left_at = int(step)
        self.manager.shutdown(wait=False)  # heartbeats stop: the lighthouse drops this group
        return False
