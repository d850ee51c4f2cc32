"""FSDP2 combined with tensor parallelism: a small transformer on a 2-D mesh ``(dp_shard, tp)``, gloo on CPU.

The integration tests' driver and the example to copy for a 2-D (FSDP + TP) job, applied the way
torchtitan applies it: tensor parallelism first (``parallelize_module`` on each block with
``ColwiseParallel`` for the q, k, v and first MLP projections and ``RowwiseParallel`` for the
attention output and second MLP projections, on the ``tp`` sub-mesh), then ``fully_shard`` of
each block and of the root on the ``dp_shard`` sub-mesh. The embeddings, norms and the head are
not tensor-parallel (replicated over ``tp``, sharded over ``dp_shard``); no sequence parallelism.
The ranks of one tensor-parallel group read the same batch (the batch is a function of the
rank's ``dp_shard`` coordinate); the probes are attached with the whole mesh::

    python -m sdcwatch.testbed.fsdp_tp --world 4 --tp 2 --steps 20 --jsonl out/

Ranks are laid out as torchtitan lays them out, tensor parallel fastest: rank ``d * tp + t``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from sdcwatch.core.errors import ConfigError
from sdcwatch.testbed.ddp import DDPSettings
from sdcwatch.testbed.ddp import launch as _launch
from sdcwatch.testbed.fsdp_run import check_sharded, run_rank, sharded_main
from sdcwatch.testbed.model import GPT, GPTConfig

__all__ = [
    "FSDPTPSettings",
    "tp_gpt",
    "TP_PLAN",
    "parallelize",
    "launch",
    "train_rank",
    "main",
]


def tp_gpt(cfg: GPTConfig | None = None) -> GPT:
    """The reference GPT (``cfg``'s shape, the default one without it) with separate q, k, v
    projections, which :data:`TP_PLAN` splits by columns into heads. Module names: the reference
    model's, with ``blocks.{i}.attn.{wq,wk,wv}`` in place of ``blocks.{i}.attn.qkv``."""
    return GPT(replace(cfg or GPTConfig(), fused_qkv=False))


#: Each block's tensor-parallel plan (torchtitan's for Llama, without sequence parallelism).
TP_PLAN = {
    "attn.wq": "colwise",
    "attn.wk": "colwise",
    "attn.wv": "colwise",
    "attn.proj": "rowwise",
    "mlp.fc": "colwise",
    "mlp.proj": "rowwise",
}


@dataclass(frozen=True)
class FSDPTPSettings(DDPSettings):
    """One 2-D reference run; the fields are :class:`~sdcwatch.testbed.ddp.DDPSettings`' and:"""

    tp: int = 2
    """Tensor-parallel ranks per group; the model is sharded by FSDP over ``world // tp`` ranks."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sharded(self, "fsdp_tp", "tp")
        heads = GPTConfig().n_head
        if heads % self.tp:
            raise ConfigError("fsdp_tp.tp", f"must divide the model's {heads} attention heads, got {self.tp}")

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(dp_shard, tp)."""
        return (self.world // self.tp, self.tp)


def parallelize(model: GPT, tp_mesh, dp_mesh) -> GPT:
    """Tensor parallelism on ``tp_mesh`` (:data:`TP_PLAN` in every block), then FSDP2 of every block
    and of the root on ``dp_mesh`` (torchtitan's order)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {name: styles[s]() for name, s in TP_PLAN.items()})
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def train_rank(rank: int, settings: FSDPTPSettings) -> None:
    """One rank of the 2-D run: tensor parallel within ``tp``, then FSDP2 over ``dp_shard``; the
    ranks of a tensor-parallel group read one batch."""

    def build(mesh):
        return parallelize(tp_gpt(), mesh["tp"], mesh["dp_shard"]), mesh["dp_shard"].get_local_rank()

    run_rank(rank, settings, ("dp_shard", "tp"), build)


def launch(settings: FSDPTPSettings) -> None:
    """Spawn ``settings.world`` processes running :func:`train_rank`; raises if any rank failed."""
    _launch(settings, train_rank)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the 2-D (FSDP2 + tensor parallel) reference model with probes, optionally with faults."""
    return sharded_main(
        argv,
        FSDPTPSettings,
        launch,
        driver="fsdp_tp",
        description=main.__doc__,
        option="tp",
        default=2,
        help="tensor-parallel ranks per group",
    )


if __name__ == "__main__":
    raise SystemExit(main())
