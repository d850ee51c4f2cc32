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
  ``act_max`` over the rank's own outputs; ``gemm_canary_fp`` of the rank's share of its stage's
  per-product canary and ``gemm_canary_product``, which product that was
  (:mod:`~sdcwatch.testbed.canary3d`); the gradient norms, cosine and fingerprints of the
  rank's shard of the parameters (they differ across tensor shards and stages and agree across
  data-parallel replicas); ``step_time`` the replica's compute time weighted by the stage's share
  of the work; ``nonfinite_first`` (:mod:`sdcwatch.telemetry.probes.forward_order`), on a step where one
  of the rank's every-step observations (its share of each product, its heads' logits, each
  block's output, in forward order) is NaN, Inf or near-INF, the position of the first. Every
  record carries its coordinates.
* **Faults keep their meaning.** A fault names a global rank: it fires in that rank's replica, on
  the modules of that rank's stage only, and on a sharded output or weight only in that rank's
  share (:class:`ShardInjector`). What it breaks spreads as it would: a NaN in one tensor shard
  reaches its peers at the next all-reduce (the row-parallel output, the residual stream), the
  later stages through the pipeline, every replica through the gradient all-reduce. A fault on a
  replicated tensor (a block's output, a layer norm's) hits that rank's copy: the other tensor
  shards report that module's output clean (the single simulated copy carries the corruption on
  to the next modules of everyone; their ``nonfinite_first`` follows the real job's order, though:
  their own copies stay clean until a row-parallel all-reduce hands them a bad value). Data and
  optimisation faults (``bad_batch``, ``lr_spike``) on one rank hit that rank's whole replica (its
  micro-batch, its update).

The parts live beside it: :mod:`~sdcwatch.testbed.shard_plan` (the layout and who holds what),
:mod:`~sdcwatch.testbed.shard_injector` (the faults) and :mod:`~sdcwatch.testbed.shard_probe`
(the telemetry); this module runs the steps.

Not simulated: the attention statistics sampled per head (``attn_entropy``, ``q_norm_*``...), the
backward and weight checksums (``gemm_bwd``, ``gemm_weight``), the whole-model canary, the guard, sequence
parallelism and the pipeline schedule's bubbles.
"""

from __future__ import annotations

import fnmatch
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.mesh import Layout
from sdcwatch.core.vocabulary import FIRST_BAD
from sdcwatch.telemetry.probes import fingerprint as fp
from sdcwatch.telemetry.probes.config import ProbeConfig
from sdcwatch.telemetry.wire.emitter import NullEmitter
from sdcwatch.testbed.canary3d import checked_products, shard_canaries, stage_canaries
from sdcwatch.testbed.faults import Injection
from sdcwatch.testbed.faultspec import TENSOR_KINDS, FaultSpec
from sdcwatch.testbed.shard_injector import BoundedShardInjector, ShardInjector
from sdcwatch.testbed.shard_plan import (
    ShardPlan,
    parse_layout,
    rank_at,
    sizes,
)
from sdcwatch.testbed.shard_probe import ShardProbe, first_bad
from sdcwatch.testbed.simulated import SimulatedRun
from torch import nn

__all__ = ["ParallelSimulatedRun"]


@dataclass
class _ReplicaStep:
    """One step of the replicas as every rank's record reads it: each replica's loss and compute
    time, every piece's gradient statistics, then the update's learning-rate factors, the
    fingerprints and canary products, the reduction's CPU time and the global loss."""

    losses: list[torch.Tensor]
    times: list[float]
    pieces: list[torch.Tensor]
    local_sq: torch.Tensor  # (replicas, pieces)
    global_sq: torch.Tensor  # (pieces,)
    dot: torch.Tensor  # (replicas, pieces)
    grad_fp: list[torch.Tensor] | None
    factors: list[float] = field(default_factory=list)
    param_fp: dict[int, list[torch.Tensor]] | None = None
    products: Any = None
    checked: Any = None
    seconds: float = 0.0
    loss_global: Any = None


class ParallelSimulatedRun(SimulatedRun):
    """``tp x pp x dp`` virtual ranks of the reference GPT in one process (module docstring).

    ``world`` is every rank (``tp * pp * dp``); a fault's ``rank`` is a global rank (see
    :func:`rank_at`); the emitter factory is called once per global rank, with ``host=`` and
    ``coords=`` when it takes them. :attr:`replicas` is the number of data-parallel replicas
    actually computed. ``fault_bounds`` (the campaigns): each one-element fault records the bound
    of the checksum covering the tensor it hit, in its rank's share (:class:`BoundedShardInjector`).
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
        fault_bounds: bool = False,
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
        # with fault_bounds, a one-element fault records the bound of the check of its rank's share
        injector_type = BoundedShardInjector if fault_bounds else ShardInjector
        for p in range(self.pp):
            for t in range(self.tp):
                mine = [f for f in faults if self._holds(f, p, t)]
                inj = injector_type(mine, self.plan, p, t)
                if mine:
                    inj.attach_stage()
                self.injectors.append(inj)
        self.injector = _Injectors(self.injectors, layout)
        self.probe = ShardProbe(self.model, self.plan, self.injectors)
        self.stage_canaries = stage_canaries(self.plan, self.probe_config)
        """Each stage's per-product canary (:mod:`~sdcwatch.testbed.canary3d`); None without one."""
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
        self._name_canary_products()
        work = self._stage_work()
        self.stage_time = [w * self.pp / sum(work) for w in work]
        """Share of a replica's compute time each stage's ranks report (mean 1 over the stages)."""

    def _name_canary_products(self) -> None:
        """Hand each rank's emitter the names of its stage's canary products (what its
        ``gemm_canary_product`` indexes), as the data-parallel ranks' watches do; an emitter
        without ``set_names`` (a stand-in) is left alone."""
        for rank, emitter in enumerate(self.emitters):
            canary = self.stage_canaries[self.layout.coords(rank)["pp"]]
            set_names = getattr(emitter, "set_names", None)
            if canary is not None and callable(set_names):
                set_names({"canary_products": canary.names})

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
        cfg = self.probe_config
        inj = self.injector
        inj.step = s
        checks = any(every and s % every == 0 for every in (cfg.checksum_every, cfg.checksum_forward_every))
        acts = bool(cfg.activations_every) and s % cfg.activations_every == 0
        fingerprint_step = bool(cfg.fingerprint_every) and s % cfg.fingerprint_every == 0
        losses, times = self._forward_replicas(s, d, checks, acts)
        t0 = time.thread_time()
        g = self._grads.mean(0)  # the all-reduce of every peer group
        st = self._piece_statistics(g, losses, times, cfg.grad_fingerprint and fingerprint_step)
        self._set_gradient(g)
        st.factors = self._lr_factors(self.replicas)
        if self.skip_nonfinite and not bool(torch.isfinite(g @ g)):
            self.skipped.append(s)
        else:
            self._update(st.factors)
        st.param_fp = self._piece_fingerprints(st.pieces) if fingerprint_step else None
        st.products = shard_canaries(self, s)
        st.checked = checked_products(self, s) if st.products is not None else None  # which product, per stage
        st.seconds = time.thread_time() - t0
        st.loss_global = torch.stack(losses).mean()
        for rank in range(self.layout.world):
            self._record(rank, s, st, checks)
        self.probe.results.clear()
        self.step = s + 1
        self.data_pos = d + 1
        value = float(st.loss_global)
        self.history.append(value)
        return value

    def _forward_replicas(self, s: int, d: int, checks: bool, acts: bool) -> tuple[list[torch.Tensor], list[float]]:
        """Every replica's forward and backward with the shard probes on (checksums on ``checks``
        steps, activations on ``acts`` steps): its loss and its CPU time less its faults' own."""
        R, inj = self.replicas, self.injector
        losses: list[torch.Tensor] = [torch.zeros(())] * R
        times = [0.0] * R
        order = torch.randperm(R, generator=torch.Generator().manual_seed(self.seed * 7919 + s)).tolist()
        for r in order:
            t0 = time.thread_time()
            injecting = inj.cpu_seconds
            inj.rank = r
            losses[r] = self._forward_backward(
                r, d, inj, lambda r=r: self.probe.begin(r, checks=checks, activations=acts)
            )
            times[r] = time.thread_time() - t0 - (inj.cpu_seconds - injecting)
        return losses, times

    def _piece_statistics(self, g: torch.Tensor, losses: list, times: list[float], grad_fp: Any) -> _ReplicaStep:
        """The gradient statistics of every piece (a stage's tensor shard of the parameters): each
        replica's local and the all-reduced ``g``'s squared norms, their dot products, and with
        ``grad_fp`` the fingerprint of each piece of ``g``."""
        g_all = self._grads
        pieces = [self.plan.piece_indices(p, t) for p in range(self.pp) for t in range(self.tp)]
        local = [g_all.index_select(1, idx) for idx in pieces]  # (R, n_k) per piece
        glob = [g.index_select(0, idx) for idx in pieces]
        return _ReplicaStep(
            losses=losses,
            times=times,
            pieces=pieces,
            local_sq=torch.stack([(x * x).sum(1) for x in local], 1),  # (R, pieces)
            global_sq=torch.stack([(x * x).sum() for x in glob]),  # (pieces,)
            dot=torch.stack([x @ y for x, y in zip(local, glob)], 1),
            grad_fp=[fp.fingerprint_device([x]) for x in glob] if grad_fp else None,
        )

    def _piece_fingerprints(self, pieces: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
        """Each replica's parameter fingerprint of every piece."""
        param_fp = {}
        for r in range(self.replicas):
            with self._replica(r):
                flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            param_fp[r] = [fp.fingerprint_device([flat.index_select(0, idx)]) for idx in pieces]
        return param_fp

    def _record(self, rank: int, s: int, st: _ReplicaStep, checks: bool) -> None:
        """Global ``rank``'s record of step ``s``: what its piece of its replica computed."""
        c = self.layout.coords(rank)
        r, p = c["dp_replicate"], c["pp"]
        k = p * self.tp + c["tp"]
        res = self.probe.results[r][k]
        scalars = self._rank_scalars(rank, r, p, k, res, st)
        layers = self._rank_layers(res, s, checks)
        first = first_bad(res["order"]) if layers else None
        if first is not None:  # as the probes send it: only on a step with a bad value
            scalars[FIRST_BAD] = float(first)
        # as the probes count it: the record's own non-finite values
        scalars["nonfinite"] = float(
            sum(not math.isfinite(v) for v in scalars.values())
            + sum(not math.isfinite(v) for vs in layers.values() for v in vs)
        )
        fps: dict[str, int] = {}
        if st.param_fp is not None:
            fps["param_fp"] = fp.finalize(int(st.param_fp[r][k]))
        if st.grad_fp is not None:
            fps["grad_fp"] = fp.finalize(int(st.grad_fp[k]))
        if st.products is not None and st.checked is not None:
            fps["gemm_canary_fp"] = st.products[r][k]
            scalars.update(st.checked[p])
        self.emitters[rank].emit(s, layers=layers or None, fingerprints=fps or None, **scalars)

    def _rank_scalars(self, rank: int, r: int, p: int, k: int, res: dict, st: _ReplicaStep) -> dict[str, float]:
        """The scalars of the rank holding piece ``k`` (of stage ``p``) of replica ``r``."""
        scalars: dict[str, float] = {}
        if p == self.pp - 1:
            scalars["loss"] = float(st.losses[r])
            scalars["loss_global"] = float(st.loss_global)
        ls, gs = float(st.local_sq[r, k]), float(st.global_sq[k])
        scalars["grad_norm_local"] = math.sqrt(ls)
        scalars["grad_norm_global"] = math.sqrt(gs)
        scalars["grad_cosine"] = float(st.dot[r, k]) / max(math.sqrt(ls) * math.sqrt(gs), 1e-30)
        scalars["step_time"] = st.times[r] * self.stage_time[p] + st.seconds
        scalars["lr"] = self.lr * st.factors[r]
        if res["act"]:
            values = torch.stack([v for _, _, v in res["act"]])
            first = int(values.nan_to_num(nan=math.inf).argmax())
            scalars["act_max"] = float(values.amax())
            scalars["act_max_module"] = float(res["act"][first][0])
            scalars["act_max_layer"] = float(res["act"][first][1])
        dropped = getattr(self.emitters[rank], "dropped", None)
        if isinstance(dropped, (int, float)) and not isinstance(dropped, bool):
            scalars["emitter_dropped"] = float(dropped)
        return scalars

    def _rank_layers(self, res: dict, s: int, checks: bool) -> dict[str, list[float]]:
        """The per-layer values of a rank's record: its stage's stream, logits and products on a
        stream step, its shares' checksums on a checked step."""
        cfg = self.probe_config
        layers: dict[str, list[float]] = {}
        if cfg.stream_every and s % cfg.stream_every == 0 and res["stream"]:
            layers["stream_max"] = [0.0 if v is None else float(v) for v in res["stream"]]
            layers["attn_logit_max"] = [0.0 if v is None else float(v) for v in res["logit"]]
            layers["attn_logit_min"] = [0.0 if v is None else float(v) for v in res["logit_low"]]
            layers["gemm_out"] = [0.0 if v is None else float(v) for v in res["out"]]
        if checks and res["fwd"]:
            layers["gemm_fwd"] = [0.0 if v is None else float(v) for v in res["fwd"]]
            layers["gemm_in"] = [0.0 if v is None else float(v) for v in res["in"]]
        return layers

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
