"""Simulated 3D parallelism: ``tp x pp x dp`` ranks training the reference GPT in one process.

Large jobs are never pure data parallel. Under tensor parallelism (Megatron-LM's column- and
row-parallel linear layers) each rank holds some attention heads and some MLP columns; under
pipeline parallelism each rank holds some blocks; only ranks with the same tensor and pipeline
coordinates (the *peer group*) hold the same numbers. :class:`ParallelSimulatedRun` reproduces
what a telemetry stream of such a job looks like, so detection quality can be measured under it:

* **Compute.** Each data-parallel replica runs its micro-batch through the whole model (one
  forward and backward per replica, like :class:`~sdcwatch.testbed.simulated.SimulatedRun`); the
  gradients are averaged over the replicas (the all-reduce of every peer group at once) and one
  optimizer step updates the model.
* **Who holds what** (:class:`ShardPlan`). Stage ``p`` holds an equal share of the blocks (the
  first stage also the embeddings, the last ``ln_f`` and the head). Tensor shard ``t`` holds the
  heads ``t * H/tp ...`` of ``attn.qkv`` (rows), ``attn.scores`` and ``attn.mix``; the columns of
  ``attn.proj`` (row parallel) that read those heads; a contiguous ``1/tp`` of ``mlp.fc``'s rows
  and of ``mlp.proj``'s columns; a ``1/tp`` of the vocabulary of ``embed`` and ``head``. Layer
  norms, ``pos`` and the biases of row-parallel layers are replicated.
* **Telemetry of a rank** (:class:`ShardProbe`): only what that rank computes. The loss and the
  global loss only on the last stage (other stages send none); ``stream_max``,
  ``attn_logit_max`` and ``attn_logit_min`` (one value per block *of the rank's stage*, indexed
  from 0 within the stage), the logits over the rank's heads only; ``gemm_out`` every step and the
  matrix checksums ``gemm_fwd`` and ``gemm_in`` on checked steps, of the rank's share of each
  product (a row-parallel product's partial sum, before the all-reduce);
  ``act_max`` over the rank's own outputs; the gradient norms, cosine and fingerprints of the
  rank's shard of the parameters (they differ across tensor shards and stages and agree across
  data-parallel replicas); ``step_time`` the replica's compute time weighted by the stage's share
  of the work. Every record carries its coordinates.
* **Faults keep their meaning.** A fault names a global rank: it fires in that rank's replica, on
  the modules of that rank's stage only, and on a sharded output or weight only in that rank's
  share (:class:`ShardInjector`). What it breaks spreads as it would: a NaN in one tensor shard
  reaches its peers at the next all-reduce (the row-parallel output, the residual stream), the
  later stages through the pipeline, every replica through the gradient all-reduce. A fault on a
  replicated tensor (a block's output, a layer norm's) hits that rank's copy: the other tensor
  shards report that module's output clean (the single simulated copy carries the corruption on
  to the next modules of everyone). Data and optimisation faults (``bad_batch``, ``lr_spike``) on
  one rank hit that rank's whole replica (its micro-batch, its update).

Not simulated: the attention statistics sampled per head (``attn_entropy``, ``q_norm_*``...), the
backward and weight checksums (``gemm_bwd``, ``gemm_weight``), the canary, the guard, sequence
parallelism and the pipeline schedule's bubbles.
"""

from __future__ import annotations

import fnmatch
import inspect
import math
import re
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.mesh import Layout
from sdcwatch.telemetry import fingerprint as fp
from sdcwatch.telemetry.canary import canary_running
from sdcwatch.telemetry.checksum import abs_max, check_linear, check_matmul
from sdcwatch.telemetry.emitter import NullEmitter
from sdcwatch.telemetry.extremes import peak
from sdcwatch.telemetry.faults import FaultInjector, FaultSpec, Injection
from sdcwatch.telemetry.faultspec import TENSOR_KINDS
from sdcwatch.telemetry.probes import ProbeConfig
from sdcwatch.testbed.canary3d import shard_canaries
from sdcwatch.testbed.simulated import SimulatedRun

__all__ = [
    "SIMULATED_DIMS",
    "parse_layout",
    "sizes",
    "rank_at",
    "place_of",
    "stage_blocks",
    "place_fault",
    "ShardPlan",
    "ShardInjector",
    "ShardProbe",
    "ParallelSimulatedRun",
]

_BLOCK = re.compile(r"^blocks\.(\d+)(\.|$)")


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

    # modules --------------------------------------------------------------------------------------
    def stage_of(self, name: str) -> int | None:
        """The pipeline stage holding module (or parameter) ``name``; None for a container of all."""
        m = _BLOCK.match(name)
        if m:
            return self._block_stage[int(m.group(1))]
        root = name.split(".", 1)[0]
        if root in ("embed", "pos"):
            return 0
        if root in ("ln_f", "head"):
            return self.pp - 1
        return None

    def local_layer(self, name: str) -> int:
        """The index within its stage of the block holding ``name`` (-1 outside every block)."""
        m = _BLOCK.match(name)
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


# -- faults ----------------------------------------------------------------------------------------


class _StageView:
    """What an injector attaches to: the modules of one pipeline stage."""

    def __init__(self, plan: ShardPlan, stage: int) -> None:
        self._modules = [(n, m) for n, m in plan.modules.items() if n and plan.stage_of(n) == stage]

    def named_modules(self):
        return iter(self._modules)


class ShardInjector(FaultInjector):
    """The injector of the ranks at one (stage, tensor shard): it hooks the stage's modules only
    and corrupts a sharded tensor only in the shard's part (one element drawn there; noise and
    scale on the shard's part alone)."""

    def __init__(self, faults: Iterable[FaultSpec], plan: ShardPlan, stage: int, shard: int) -> None:
        super().__init__(faults, rank=0)
        self.plan, self.stage, self.shard = plan, stage, shard

    def attach_stage(self) -> "ShardInjector":
        return self.attach(_StageView(self.plan, self.stage))  # type: ignore[arg-type]

    def _owner(self, name: str, where: str) -> tuple[int, torch.Tensor] | None:
        return self.plan.param_owner(name) if where in ("grad", "param") else self.plan.output_owner(name)

    def _transform(self, i: int, spec: FaultSpec, x: torch.Tensor, name: str, rng: Any):
        mask = self.plan.mask(self._owner(name, spec.where), tuple(x.shape), self.shard)
        if mask is None or spec.kind not in ("noise", "scale"):
            return super()._transform(i, spec, x, name, rng)
        changed = super()._transform(i, spec, x, name, rng)
        return torch.where(mask.to(x.device), changed, x)

    def _pick(self, spec: FaultSpec, t: torch.Tensor, name: str, rng: Any) -> int:
        """An element of the rank's own shard of ``t`` (any element of a replicated tensor)."""
        mask = self.plan.mask(self._owner(name, spec.where), tuple(t.shape), self.shard)
        if mask is None:
            return rng.randrange(t.numel())
        allowed = mask.reshape(-1).nonzero().reshape(-1)
        return int(allowed[rng.randrange(allowed.numel())])


# -- telemetry -------------------------------------------------------------------------------------


def _tensor_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class ShardProbe:
    """Per-rank metrics of one replica's forward pass, as each (stage, tensor shard) sees it.

    Hooks every module of the model. Before the injectors' hooks a module's clean output is kept;
    after them the probe knows whether a fault changed it and whose fault it was (the injectors'
    :class:`~sdcwatch.telemetry.faults.Injection` log), and gives each piece its own view: its
    share of a sharded output; for a replicated output, the corrupted copy only to the rank whose
    fault it was; for a row-parallel product, its partial sum for the checksum.
    """

    def __init__(self, model: nn.Module, plan: ShardPlan, injectors: Sequence[ShardInjector]) -> None:
        self.plan = plan
        self.injectors = injectors
        self.layout = plan.layout
        self.tp, self.pp = plan.tp, plan.pp
        self.stage_leaves: list[list[str]] = [[] for _ in range(self.pp)]
        self.stage_products: list[list[str]] = [[] for _ in range(self.pp)]
        self._handles: list[Any] = []
        self._clean: dict[str, torch.Tensor] = {}
        products_mix: list[list[str]] = [[] for _ in range(self.pp)]
        for name, m in plan.modules.items():
            stage = plan.stage_of(name)
            if not name or stage is None:
                continue
            leaf = not any(True for _ in m.children())
            if leaf:
                self.stage_leaves[stage].append(name)
            if isinstance(m, nn.Linear):
                self.stage_products[stage].append(name)
            elif getattr(m, "_sdcwatch_gemm", False):
                products_mix[stage].append(name)  # after the linear layers, as the watch orders them
            self._handles.append(m.register_forward_hook(self._before(name), prepend=True))
            self._handles.append(m.register_forward_hook(self._after(name, stage, leaf)))
        for s in range(self.pp):
            self.stage_products[s] += products_mix[s]
        self._leaf_index = [{n: i for i, n in enumerate(ls)} for ls in self.stage_leaves]
        self._product_index = [{n: i for i, n in enumerate(ps)} for ps in self.stage_products]
        self.replica = 0
        self.checks = self.activations = False
        self._cursor = [0] * len(injectors)
        self.results: dict[int, list[dict[str, Any]]] = {}

    def begin(self, replica: int, *, checks: bool, activations: bool) -> None:
        """Start observing ``replica``'s pass (``checks``: checksum step; ``activations``: act_max step)."""
        self.replica, self.checks, self.activations = replica, checks, activations
        self._cursor = [len(inj.injections) for inj in self.injectors]
        tp = self.tp
        self.results[replica] = [
            {
                "stream": [None] * len(self.plan.stage_blocks[k // tp]),
                "logit": [None] * len(self.plan.stage_blocks[k // tp]),
                "logit_low": [None] * len(self.plan.stage_blocks[k // tp]),
                "out": [None] * len(self.stage_products[k // tp]),
                "fwd": [None] * len(self.stage_products[k // tp]),
                "in": [None] * len(self.stage_products[k // tp]),
                "act": [],
            }
            for k in range(self.pp * tp)
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _before(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            t = _tensor_of(output)
            if t is not None and not canary_running():
                self._clean[name] = t
            return None

        return hook

    def _culprits(self, name: str) -> set[int]:
        """Tensor shards whose injector changed ``name``'s output in this pass."""
        out = set()
        for i, inj in enumerate(self.injectors):
            for rec in inj.injections[self._cursor[i] :]:
                if rec.target == name and rec.where == "output":
                    out.add(inj.shard)
        return out

    def _after(self, name: str, stage: int, leaf: bool) -> Callable:
        plan, tp = self.plan, self.tp

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            y = _tensor_of(output)
            if y is None or not y.is_floating_point() or not self.results or canary_running():
                return None
            clean = self._clean.pop(name, y)
            culprits = self._culprits(name) if clean is not y else set()
            res = self.results[self.replica]
            owner = plan.output_owner(name)
            row = plan.row_parallel(name)
            layer = plan.local_layer(name)
            with torch.no_grad():
                for t in range(tp):
                    r = res[stage * tp + t]
                    # what this rank holds of the output
                    if owner is not None and tp > 1:
                        dim, own = owner
                        mine = y.detach().index_select(dim % y.dim(), (own == t).nonzero().reshape(-1))
                    elif t in culprits or not culprits or row is not None:
                        mine = y.detach()  # its own copy, or the all-reduced output everyone holds
                    else:
                        mine = clean.detach()  # another rank's copy was hit, not this one
                    if leaf and self.activations:
                        v = mine.nan_to_num(nan=math.nan, posinf=math.inf, neginf=0.0).abs().amax().float()
                        r["act"].append((self._leaf_index[stage][name], layer, v))
                    if name.endswith("attn.scores") and layer >= 0:  # its own heads' logits
                        m = mine.amax().float()
                        old = r["logit"][layer]
                        r["logit"][layer] = m if old is None else torch.maximum(old, m)
                        low = mine.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amin().float()
                        old = r["logit_low"][layer]
                        r["logit_low"][layer] = low if old is None else torch.minimum(old, low)
                    if _BLOCK.match(name) and name.count(".") == 1:  # a block's output: the residual stream
                        m = peak(mine)
                        old = r["stream"][layer]
                        r["stream"][layer] = m if old is None else torch.maximum(old, m)
                    if name in self._product_index[stage]:
                        self._product(r, stage, name, module, args, y, clean, t, t in culprits)
            return None

        return hook

    def _product(
        self,
        r: dict,
        stage: int,
        name: str,
        module: nn.Module,
        args: Any,
        y: torch.Tensor,
        clean: torch.Tensor,
        t: int,
        culprit: bool,
    ) -> None:
        """Shard ``t``'s share of product ``name``: the largest |row sum| of its output every step
        (``gemm_out``), the forward checksum and the largest |input| on checked steps."""
        plan = self.plan
        i = self._product_index[stage][name]
        if isinstance(module, nn.Linear):
            x = args[0].detach()
            w, b = module.weight.detach(), module.bias
            b = None if b is None else b.detach()
            row = plan.row_parallel(name)
            owner = plan.output_owner(name)
            if row is not None and plan.tp > 1:  # its partial sum, before the all-reduce (bias added after)
                cols = (row == t).nonzero().reshape(-1)
                x, w, b = x.index_select(-1, cols), w.index_select(1, cols), None
                out = F.linear(x, w)
                if culprit:  # this rank's partial sum is where the fault was
                    out = out + (y.detach() - clean.detach())
            elif owner is not None and plan.tp > 1:
                rows = (owner[1] == t).nonzero().reshape(-1)
                out = y.detach().index_select(-1, rows)
                w = w.index_select(0, rows)
                b = None if b is None else b.index_select(0, rows)
            else:
                out = y.detach()
            check = (lambda: check_linear(x, w, out, b)) if self.checks else None
        else:  # the attention mix: probs @ v, heads split
            a, v = args[0].detach(), args[1].detach()
            out = y.detach()
            if plan.tp > 1:
                heads = (plan.head_owner == t).nonzero().reshape(-1)
                a, v, out = a.index_select(1, heads), v.index_select(1, heads), out.index_select(1, heads)
            x = a
            check = (lambda: check_matmul(a, v, out)) if self.checks else None
        values = {"out": out.sum(-1).abs().amax().float()}
        if check is not None:
            values["fwd"], values["in"] = check().float(), abs_max(x).float()
        for key, value in values.items():
            old = r[key][i]
            r[key][i] = value if old is None else torch.maximum(old, value)


# -- the run ---------------------------------------------------------------------------------------


class ParallelSimulatedRun(SimulatedRun):
    """``tp x pp x dp`` virtual ranks of the reference GPT in one process (module docstring).

    ``world`` is every rank (``tp * pp * dp``); a fault's ``rank`` is a global rank (see
    :func:`rank_at`); the emitter factory is called once per global rank, with ``host=`` and
    ``coords=`` when it takes them. :attr:`replicas` is the number of data-parallel replicas
    actually computed.
    """

    def __init__(
        self,
        layout: Layout | str,
        *,
        seed: int = 0,
        faults: Iterable[FaultSpec] = (),
        emitter_factory: Callable[..., Any] | None = None,
        hosts: int | Sequence[str] | None = None,
        ranks_per_host: int = 4,
        probes: ProbeConfig | None = None,
        guard: Any = None,
        **kw: Any,
    ) -> None:
        layout = parse_layout(layout)
        if guard is not None:
            raise ConfigError("simulated.guard", "the guard is not simulated under tensor or pipeline parallelism")
        self.layout = layout
        self.tp, self.pp, self.dp = sizes(layout)
        faults = list(faults)
        for f in faults:
            if f.rank is not None and not 0 <= f.rank < layout.world:
                raise ConfigError("simulated.faults", f"fault on rank {f.rank} but the layout has {layout.world} ranks")
        # the replicas: a data-parallel run of dp ranks, without telemetry of its own
        super().__init__(self.dp, seed=seed, probes=probes, **kw)
        self.probe_config = self.watches[0].config
        """The probes' sampling: what each rank measures on which step (as the watches would)."""
        for w in self.watches:
            w.close()
        self.watches = []
        self.replicas = self.dp
        self.world = layout.world
        self.hosts = self._host_names(hosts, ranks_per_host)
        self.injector.detach()
        self.plan = ShardPlan(self.model, layout)
        self.injectors: list[ShardInjector] = []
        for p in range(self.pp):
            for t in range(self.tp):
                mine = [f for f in faults if self._holds(f, p, t)]
                inj = ShardInjector(mine, self.plan, p, t)
                if mine:
                    inj.attach_stage()
                self.injectors.append(inj)
        self.injector = _Injectors(self.injectors, layout)
        self.probe = ShardProbe(self.model, self.plan, self.injectors)
        factory = emitter_factory or (lambda rank: NullEmitter())
        params = inspect.signature(factory).parameters
        self.emitters = []
        for r in range(layout.world):
            kwargs: dict[str, Any] = {}
            if "host" in params:
                kwargs["host"] = self.hosts[r]
            if "coords" in params:
                kwargs["coords"] = layout.coords(r)
            self.emitters.append(factory(r, **kwargs))
        work = self._stage_work()
        self.stage_time = [w * self.pp / sum(work) for w in work]
        """Share of a replica's compute time each stage's ranks report (mean 1 over the stages)."""

    def _holds(self, f: FaultSpec, stage: int, shard: int) -> bool:
        """Whether the injector of (``stage``, ``shard``) applies fault ``f``: a fault on one rank
        at that rank's place; a fault on every rank in every piece whose stage holds its target
        (data and learning-rate faults, which act on whole replicas, once)."""
        if f.rank is not None:
            c = self.layout.coords(f.rank)
            return c["pp"] == stage and c["tp"] == shard
        if f.kind not in TENSOR_KINDS:
            return stage == 0 and shard == 0
        return any(fnmatch.fnmatchcase(n, f.target) for n in self.plan.modules if n and self.plan.stage_of(n) == stage)

    def _stage_work(self) -> list[float]:
        """Multiply-adds per token of each stage (what its step time is proportional to)."""
        work = [0.0] * self.pp
        for name, m in self.plan.modules.items():
            stage = self.plan.stage_of(name)
            if stage is not None and isinstance(m, nn.Linear):
                work[stage] += m.weight.numel()
        seq = self.config.seq_len
        for p, blocks in enumerate(self.plan.stage_blocks):  # the attention products
            work[p] += len(blocks) * 2 * seq * self.config.d_model
        return work

    def host_of(self, rank: int) -> str:
        return self.hosts[rank]

    def replica_parameters(self, rank: int) -> list[torch.Tensor]:
        """Copies of the parameters of global ``rank``'s data-parallel replica."""
        return super().replica_parameters(self.layout.coords(rank)["dp_replicate"])

    # -- a step ------------------------------------------------------------------------------------
    def _step(self) -> float:
        s, d = self.step, self.data_pos
        layout, plan, cfg = self.layout, self.plan, self.probe_config
        R, tp = self.replicas, self.tp
        inj = self.injector
        inj.step = s
        losses: list[torch.Tensor] = [torch.zeros(())] * R
        times = [0.0] * R
        checks = bool(cfg.checksum_every) and s % cfg.checksum_every == 0
        acts = bool(cfg.activations_every) and s % cfg.activations_every == 0
        fingerprint_step = bool(cfg.fingerprint_every) and s % cfg.fingerprint_every == 0
        order = torch.randperm(R, generator=torch.Generator().manual_seed(self.seed * 7919 + s)).tolist()
        for r in order:
            t0 = time.thread_time()
            injecting = inj.cpu_seconds
            inj.rank = r
            losses[r] = self._forward_backward(
                r, d, inj, lambda r=r: self.probe.begin(r, checks=checks, activations=acts)
            )
            times[r] = time.thread_time() - t0 - (inj.cpu_seconds - injecting)
        t0 = time.thread_time()
        g_all = self._grads
        g = g_all.mean(0)  # the all-reduce of every peer group
        pieces = [plan.piece_indices(p, t) for p in range(self.pp) for t in range(tp)]
        local = [g_all.index_select(1, idx) for idx in pieces]  # (R, n_k) per piece
        glob = [g.index_select(0, idx) for idx in pieces]
        local_sq = torch.stack([(x * x).sum(1) for x in local], 1)  # (R, pieces)
        global_sq = torch.stack([(x * x).sum() for x in glob])  # (pieces,)
        dot = torch.stack([x @ y for x, y in zip(local, glob)], 1)
        grad_fp = [fp.fingerprint_device([x]) for x in glob] if cfg.grad_fingerprint and fingerprint_step else None
        offset = 0
        for p, n in zip(self.params, self._sizes):
            p.grad = g[offset : offset + n].view_as(p).clone()
            offset += n
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        factors = []
        for r in range(R):
            inj.rank = r
            factors.append(inj.lr_factor())
        if self.skip_nonfinite and not bool(torch.isfinite(g @ g)):
            self.skipped.append(s)
        else:
            self._update(factors)
        param_fp = None
        if fingerprint_step:
            param_fp = {}
            for r in range(R):
                with self._replica(r):
                    flat = torch.cat([p.detach().reshape(-1) for p in self.params])
                param_fp[r] = [fp.fingerprint_device([flat.index_select(0, idx)]) for idx in pieces]
        products = shard_canaries(self, s)
        seconds = time.thread_time() - t0
        loss_global = torch.stack(losses).mean()
        for rank in range(layout.world):
            c = layout.coords(rank)
            r, p, t = c["dp_replicate"], c["pp"], c["tp"]
            k = p * tp + t
            res = self.probe.results[r][k]
            scalars: dict[str, float] = {}
            if p == self.pp - 1:
                scalars["loss"] = float(losses[r])
                scalars["loss_global"] = float(loss_global)
            ls, gs = float(local_sq[r, k]), float(global_sq[k])
            scalars["grad_norm_local"] = math.sqrt(ls)
            scalars["grad_norm_global"] = math.sqrt(gs)
            scalars["grad_cosine"] = float(dot[r, k]) / max(math.sqrt(ls) * math.sqrt(gs), 1e-30)
            scalars["step_time"] = times[r] * self.stage_time[p] + seconds
            scalars["lr"] = self.lr * factors[r]
            if res["act"]:
                values = torch.stack([v for _, _, v in res["act"]])
                first = int(values.nan_to_num(nan=math.inf).argmax())
                scalars["act_max"] = float(values.amax())
                scalars["act_max_module"] = float(res["act"][first][0])
                scalars["act_max_layer"] = float(res["act"][first][1])
            dropped = getattr(self.emitters[rank], "dropped", None)
            if isinstance(dropped, (int, float)) and not isinstance(dropped, bool):
                scalars["emitter_dropped"] = float(dropped)
            layers: dict[str, list[float]] = {}
            if cfg.stream_every and s % cfg.stream_every == 0 and res["stream"]:
                layers["stream_max"] = [0.0 if v is None else float(v) for v in res["stream"]]
                layers["attn_logit_max"] = [0.0 if v is None else float(v) for v in res["logit"]]
                layers["attn_logit_min"] = [0.0 if v is None else float(v) for v in res["logit_low"]]
                layers["gemm_out"] = [0.0 if v is None else float(v) for v in res["out"]]
            if checks and res["fwd"]:
                layers["gemm_fwd"] = [0.0 if v is None else float(v) for v in res["fwd"]]
                layers["gemm_in"] = [0.0 if v is None else float(v) for v in res["in"]]
            # as the probes count it: the record's own non-finite values
            scalars["nonfinite"] = float(
                sum(not math.isfinite(v) for v in scalars.values())
                + sum(not math.isfinite(v) for vs in layers.values() for v in vs)
            )
            fps: dict[str, int] = {}
            if param_fp is not None:
                fps["param_fp"] = fp.finalize(int(param_fp[r][k]))
            if grad_fp is not None:
                fps["grad_fp"] = fp.finalize(int(grad_fp[k]))
            if products is not None:
                fps["gemm_canary_fp"] = products[r][k]
            self.emitters[rank].emit(s, layers=layers or None, fingerprints=fps or None, **scalars)
        self.probe.results.clear()
        self.step = s + 1
        self.data_pos = d + 1
        value = float(loss_global)
        self.history.append(value)
        return value

    def _param_fault_starts(self, replica: int) -> bool:
        """Whether a ``where: "param"`` fault starts at this step on a rank of ``replica`` (the
        per-piece injectors then act for that replica's ranks)."""
        inj = self.injector
        inj.rank = replica
        return any(
            f.where == "param" and f.step == inj.step and f.hits(inj.step, x.rank)
            for x in self.injectors
            for f in x.faults
        )

    def replace_ranks(self, ranks: Iterable[int]) -> None:
        raise ConfigError("simulated.replace_ranks", "not simulated under tensor or pipeline parallelism")

    def close(self) -> None:
        """Close the emitters and remove every hook."""
        self.probe.remove()
        self.injector.detach()
        for e in self.emitters:
            close = getattr(e, "close", None)
            if callable(close):
                close()


class _Injectors:
    """The per-piece injectors behind one injector's interface: setting :attr:`rank` to a replica
    makes each piece's injector act for the global rank of that piece in that replica."""

    def __init__(self, injectors: Sequence[ShardInjector], layout: Layout) -> None:
        self._all, self._layout = list(injectors), layout
        self._step = -1
        self._replica = 0

    @property
    def faults(self) -> list[FaultSpec]:
        return [f for x in self._all for f in x.faults]

    @property
    def injections(self) -> list[Injection]:
        return sorted((i for x in self._all for i in x.injections), key=lambda i: i.step)

    @property
    def cpu_seconds(self) -> float:
        return sum(x.cpu_seconds for x in self._all)

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        for x in self._all:
            x.step = value

    @property
    def rank(self) -> int:
        return self._replica

    @rank.setter
    def rank(self, replica: int) -> None:
        self._replica = replica
        for x in self._all:
            x.rank = rank_at(self._layout, replica, x.stage, x.shard)

    def corrupt_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """The replica's micro-batch: garbage when a bad_batch fault is on any of its ranks."""
        for x in self._all:
            out = x.corrupt_batch(tokens)
            if out is not tokens:
                return out
        return tokens

    def lr_factor(self) -> float:
        factor = 1.0
        for x in self._all:
            factor *= x.lr_factor()
        return factor

    def apply_param_faults(self) -> list[str]:
        return [n for x in self._all for n in x.apply_param_faults()]

    def detach(self) -> None:
        for x in self._all:
            x.detach()
