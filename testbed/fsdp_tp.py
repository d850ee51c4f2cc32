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

import argparse
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from sdcwatch.core.errors import ConfigError
from sdcwatch.telemetry.faults import load_faults
from sdcwatch.testbed.ddp import DDPSettings, add_run_arguments, json_setting, launch as _launch
from sdcwatch.testbed.fsdp import run_rank
from sdcwatch.testbed.model import GPTConfig

__all__ = [
    "FSDPTPSettings",
    "TPGPT",
    "TP_PLAN",
    "parallelize",
    "launch",
    "train_rank",
    "main",
]


class Scores(nn.Module):
    """Causal q k^T / sqrt(d_head) of this rank's heads: the attention logits, a module so faults hit it."""

    def __init__(self, d_head: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(d_head)

    def forward(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ((q @ k.transpose(-2, -1)) * self.scale).masked_fill(mask, float("-inf"))


class TPAttention(nn.Module):
    """Causal self-attention with separate q, k, v projections (a fused qkv cannot be split by
    columns into heads): under ``ColwiseParallel`` each projection returns this rank's heads, so
    the number of heads is read from the tensors, not the config."""

    _sdcwatch_attention = True

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.d_head = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, cfg.d_model)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model)
        self.scores = Scores(self.d_head)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model)
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from sdcwatch.telemetry.probes import observe_attention

        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.d_head).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        logits = self.scores(q, k, self.mask[:t, :t])
        observe_attention(self, q, k, logits=logits)
        y = F.softmax(logits, dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class TPMLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class TPBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = TPAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = TPMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TPGPT(nn.Module):
    """The reference byte-level GPT's shape (:class:`~sdcwatch.testbed.model.GPTConfig`) with
    tensor-parallel-ready blocks. Module names: ``embed, pos, blocks.{i}.attn.{wq,wk,wv,scores,wo},
    blocks.{i}.mlp.{fc,proj}, blocks.{i}.ln{1,2}, ln_f, head``."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = c = cfg or GPTConfig()
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(TPBlock(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


#: Each block's tensor-parallel plan (torchtitan's for Llama, without sequence parallelism).
TP_PLAN = {
    "attn.wq": "colwise",
    "attn.wk": "colwise",
    "attn.wv": "colwise",
    "attn.wo": "rowwise",
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
        tp = self.tp
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or self.world % tp:
            raise ConfigError("fsdp_tp.tp", f"must be a positive divisor of world {self.world}, got {tp!r}")
        heads = GPTConfig().n_head
        if heads % tp:
            raise ConfigError("fsdp_tp.tp", f"must divide the model's {heads} attention heads, got {tp}")
        for key in ("guard", "load", "save"):
            if getattr(self, key) is not None:
                raise ConfigError(f"fsdp_tp.{key}", "is not supported by the 2-D driver (use the DDP one)")

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(dp_shard, tp)."""
        return (self.world // self.tp, self.tp)


def parallelize(model: TPGPT, tp_mesh, dp_mesh) -> TPGPT:
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
        return parallelize(TPGPT(), mesh["tp"], mesh["dp_shard"]), mesh["dp_shard"].get_local_rank()

    run_rank(rank, settings, ("dp_shard", "tp"), build)


def launch(settings: FSDPTPSettings) -> None:
    """Spawn ``settings.world`` processes running :func:`train_rank`; raises if any rank failed."""
    _launch(settings, train_rank)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the 2-D (FSDP2 + tensor parallel) reference model with probes, optionally with faults."""
    ap = argparse.ArgumentParser(prog="python -m sdcwatch.testbed.fsdp_tp", description=main.__doc__)
    add_run_arguments(ap, "fsdp-tp-reference")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per group")
    args = ap.parse_args(argv)
    settings = FSDPTPSettings(
        world=args.world,
        tp=args.tp,
        steps=args.steps,
        seed=args.seed,
        run=args.run,
        bootstrap=args.bootstrap,
        topic=args.topic,
        jsonl_dir=args.jsonl_dir,
        faults=tuple(load_faults(args.faults)) if args.faults else (),
        probes=json_setting(args.probes, "fsdp_tp.probes"),
        ranks_per_host=args.ranks_per_host,
    )
    launch(settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
