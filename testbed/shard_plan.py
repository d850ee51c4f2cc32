"""Who holds what in a simulated ``tp x pp x dp`` job: the layout helpers and :class:`ShardPlan`.

A layout names each global rank's (replica, stage, tensor shard); :class:`ShardPlan` says which
pipeline stage holds each module of the reference GPT and which tensor shard holds each element
of its outputs and parameters (Megatron-LM's column- and row-parallel split; see
:mod:`sdcwatch.testbed.parallel3d`).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.mesh import Layout
from sdcwatch.testbed.fault_bounds import WHOLE, Share
from torch import nn

__all__ = [
    "SIMULATED_DIMS",
    "BLOCK",
    "parse_layout",
    "sizes",
    "rank_at",
    "place_of",
    "stage_blocks",
    "place_fault",
    "ShardPlan",
    "StageView",
]

#: A module name inside a transformer block: ``blocks.<index>`` and what it holds.
BLOCK = re.compile(r"^blocks\.(\d+)(\.|$)")


#: The mesh dims the simulation lays ranks out on (:mod:`sdcwatch.core.mesh` names).
SIMULATED_DIMS = ("pp", "dp_replicate", "tp")


def parse_layout(layout: "Layout | str") -> Layout:
    """A ``tp x pp x dp`` layout (:class:`sdcwatch.core.mesh.Layout`) with all three dims, from
    ``"tp=2,pp=2,dp=4"`` (any order; a dim left out has size 1) or a layout; ConfigError for a dim
    the simulation does not model (context, expert or sharded data parallelism)."""
    parsed = Layout.parse(layout, key="parallel") if isinstance(layout, str) else layout
    if not isinstance(parsed, Layout):
        raise ConfigError("parallel", f"expected a layout such as tp=2,pp=2,dp=4, got {layout!r}")
    other = [d for d in parsed.sizes if d not in SIMULATED_DIMS]
    if other:
        raise ConfigError("parallel", f"{', '.join(other)} is not simulated (only tp, pp and dp): {parsed}")
    return Layout({d: parsed.sizes.get(d, 1) for d in SIMULATED_DIMS}, key="parallel")


def sizes(layout: Layout) -> tuple[int, int, int]:
    """(tp, pp, dp) of a layout from :func:`parse_layout`."""
    return layout.sizes["tp"], layout.sizes["pp"], layout.sizes["dp_replicate"]


def rank_at(layout: Layout, dp: int, pp: int, tp: int) -> int:
    """The global rank of data-parallel replica ``dp``, stage ``pp``, tensor shard ``tp``."""
    return layout.rank_of({"pp": pp, "dp_replicate": dp, "tp": tp})


def place_of(layout: Layout, rank: int) -> tuple[int, int, int]:
    """(replica, stage, tensor shard) of global ``rank``."""
    c = layout.coords(rank)
    return c["dp_replicate"], c["pp"], c["tp"]


# -- who holds what ----------------------------------------------------------------------------


def stage_blocks(n_layer: int, pp: int) -> list[list[int]]:
    """The blocks of each pipeline stage: as even as it gets, the earlier stages taking the remainder."""
    if pp > n_layer:
        raise ConfigError("parallel.pp", f"{pp} stages for a model of {n_layer} blocks")
    per, extra = divmod(n_layer, pp)
    out, start = [], 0
    for p in range(pp):
        n = per + (1 if p < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def place_fault(spec: dict[str, Any], layout: Layout | str, n_layer: int) -> dict[str, Any]:
    """A fault dict moved where its rank can have it: a block target to a block of the rank's stage
    (same position within the stage list, modulo its length), a fault on the head to the rank of the
    same replica and tensor shard on the last stage. Faults on every rank are left as they are."""
    layout = parse_layout(layout)
    rank, target = spec.get("rank"), spec.get("target")
    if rank is None or not isinstance(target, str):
        return spec
    _, pp, _ = sizes(layout)
    d, p, t = place_of(layout, rank)
    stages = stage_blocks(n_layer, pp)
    if target.split(".", 1)[0] in ("head", "ln_f") and p != pp - 1:
        return {**spec, "rank": rank_at(layout, d, pp - 1, t)}
    if target.split(".", 1)[0] in ("embed", "pos") and p != 0:
        return {**spec, "rank": rank_at(layout, d, 0, t)}
    m = re.match(r"^blocks\.(\d+)(.*)$", target)
    if m and int(m.group(1)) not in stages[p]:
        mine = stages[p]
        return {**spec, "target": f"blocks.{mine[int(m.group(1)) % len(mine)]}{m.group(2)}"}
    return spec


def _contiguous(n: int, tp: int) -> torch.Tensor:
    return torch.arange(n) // (n // tp)


class StageView:
    """The modules of one pipeline stage, named and ordered as in the whole model (``named_modules``):
    the model piece a stage's ranks hold, as its fault injector and its canary see it."""

    def __init__(self, plan: "ShardPlan", stage: int) -> None:
        self._modules = [(n, m) for n, m in plan.modules.items() if n and plan.stage_of(n) == stage]

    def named_modules(self):
        return iter(self._modules)


class ShardPlan:
    """Which stage holds each module and which tensor shard holds each element of the model.

    ``owner`` maps are integer tensors over a dimension: shard index per position (``-1`` never
    appears: a replicated tensor has no map). All of it follows :class:`~sdcwatch.testbed.model.GPT`'s
    module names (module docstring).
    """

    def __init__(self, model: nn.Module, layout: Layout) -> None:
        cfg = model.cfg
        self.layout = layout
        self.tp, self.pp, self.dp = tp, pp, _ = sizes(layout)
        for what, n in (("n_head", cfg.n_head), ("vocab", cfg.vocab), ("mlp width", cfg.mlp_ratio * cfg.d_model)):
            if n % tp:
                raise ConfigError("parallel.tp", f"{tp} tensor shards do not divide the model's {what} ({n})")
        self.n_layer, self.n_head, self.d_head = cfg.n_layer, cfg.n_head, cfg.d_model // cfg.n_head
        self.d_model, self.hidden, self.vocab = cfg.d_model, cfg.mlp_ratio * cfg.d_model, cfg.vocab
        self.stage_blocks = stage_blocks(cfg.n_layer, pp)
        self._block_stage = {b: p for p, bs in enumerate(self.stage_blocks) for b in bs}
        heads = torch.arange(cfg.n_head) // (cfg.n_head // tp)
        col_head = torch.arange(cfg.d_model) // self.d_head  # a (head, d_head) position's head
        self.qkv_cols = heads[col_head].repeat(3)  # [q | k | v], each head-major
        self.head_owner = heads
        self.proj_cols = heads[col_head]
        self.fc_cols = _contiguous(self.hidden, tp)
        self.vocab_owner = _contiguous(cfg.vocab, tp)
        self.modules = dict(model.named_modules())
        self.params = [(n, p) for n, p in model.named_parameters()]
        self._piece_index = self._flat_pieces()
        self._shares: dict[tuple[str, int], Share] = {}  # share() of each (module, shard), built once

    # modules --------------------------------------------------------------------------------------
    def stage_of(self, name: str) -> int | None:
        """The pipeline stage holding module (or parameter) ``name``; None for a container of all."""
        m = BLOCK.match(name)
        if m:
            return self._block_stage[int(m.group(1))]
        root = name.split(".", 1)[0]
        if root in ("embed", "pos"):
            return 0
        if root in ("ln_f", "head"):
            return self.pp - 1
        return None

    def stage_view(self, stage: int) -> StageView:
        """The modules pipeline stage ``stage`` holds."""
        return StageView(self, stage)

    def local_layer(self, name: str) -> int:
        """The index within its stage of the block holding ``name`` (-1 outside every block)."""
        m = BLOCK.match(name)
        if not m:
            return -1
        b = int(m.group(1))
        return self.stage_blocks[self._block_stage[b]].index(b)

    def output_owner(self, name: str) -> tuple[int, torch.Tensor] | None:
        """(dimension, shard of each position) of a sharded module output; None if replicated."""
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("attn.qkv"):
            return -1, self.qkv_cols
        if name.endswith("attn.scores") or name.endswith("attn.mix"):
            return 1, self.head_owner
        if name.endswith("mlp.fc") or name.endswith("mlp.act"):
            return -1, self.fc_cols
        if leaf == "head":
            return -1, self.vocab_owner
        return None

    def row_parallel(self, name: str) -> torch.Tensor | None:
        """Shard of each input column of a row-parallel linear layer (its output is all-reduced)."""
        if name.endswith("attn.proj"):
            return self.proj_cols
        if name.endswith("mlp.proj"):
            return self.fc_cols
        return None

    def share(self, name: str, shard: int) -> Share:
        """What tensor shard ``shard`` computes of module ``name``'s product, and so what its
        checksums cover: the input features of a row-parallel layer (its partial sum), the output
        features of a column-parallel one, the heads of an attention product; all of a replicated one."""
        key = (name, shard)
        got = self._shares.get(key)
        if got is None:
            got = self._shares[key] = self._share(name, shard)
        return got

    def _share(self, name: str, shard: int) -> Share:
        if self.tp == 1:
            return WHOLE
        row = self.row_parallel(name)
        if row is not None:
            return Share(cols=(row == shard).nonzero().reshape(-1))
        owner = self.output_owner(name)
        if owner is None:
            return WHOLE
        dim, own = owner
        mine = (own == shard).nonzero().reshape(-1)
        return Share(rows=mine) if dim == -1 else Share(batch=(dim, mine))

    def param_owner(self, name: str) -> tuple[int, torch.Tensor] | None:
        """(dimension, shard of each position) of a sharded parameter; None if replicated."""
        module, _, kind = name.rpartition(".")
        if module.endswith("attn.qkv"):
            return 0, self.qkv_cols
        if module.endswith("mlp.fc"):
            return 0, self.fc_cols
        if module in ("head", "embed"):
            return 0, self.vocab_owner
        if kind == "weight" and module.endswith("attn.proj"):
            return 1, self.proj_cols
        if kind == "weight" and module.endswith("mlp.proj"):
            return 1, self.fc_cols
        return None

    def mask(self, owner: tuple[int, torch.Tensor] | None, shape: Sequence[int], shard: int) -> torch.Tensor | None:
        """Boolean mask of ``shape`` true where shard ``shard`` holds the element (None: replicated)."""
        if owner is None or self.tp == 1:
            return None
        dim, own = owner
        dim = dim % len(shape)
        if shape[dim] != own.numel():
            return None
        view = [1] * len(shape)
        view[dim] = own.numel()
        return (own == shard).reshape(view).expand(*shape)

    # the flat parameter vector ------------------------------------------------------------------
    def _flat_pieces(self) -> list[torch.Tensor]:
        """Per piece ``k = p * tp + t``: the flat-parameter indices that piece holds."""
        tp = self.tp
        pieces: list[list[torch.Tensor]] = [[] for _ in range(self.pp * tp)]
        offset = 0
        for name, p in self.params:
            n = p.numel()
            stage = self.stage_of(name)
            idx = torch.arange(offset, offset + n)
            for t in range(tp):
                m = self.mask(self.param_owner(name), p.shape, t)
                sel = idx if m is None else idx[m.reshape(-1)]
                pieces[stage * tp + t].append(sel)
            offset += n
        return [torch.cat(parts) for parts in pieces]

    def piece_indices(self, pp: int, tp: int) -> torch.Tensor:
        """Flat-parameter indices held by the ranks at pipeline stage ``pp``, tensor shard ``tp``."""
        return self._piece_index[pp * self.tp + tp]
