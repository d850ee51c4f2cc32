"""Simulated data parallelism in one process: W virtual ranks of the reference model.

Each virtual rank runs its own micro-batch through the shared model with its own probes, its own
emitter identity and its own faults; its gradient is kept apart, the gradients are averaged
exactly as an all-reduce would, and one optimizer step updates the model. That makes an
8-rank run cost 8 small forward/backward passes per step, fast enough for demos and tests.

Replica divergence is simulated too: a fault that only one real replica would suffer after the
all-reduce (a ``where: "param"`` memory flip, an ``lr_spike`` on one rank) is kept as a per-rank
delta on top of the shared parameters, applied while that rank computes and when its parameter
fingerprint is taken. The delta is exact for a one-off change when the update is shared, which is
what data parallelism guarantees. A rank's replica can leave the quorum (the guard's ``on_evict =
"leave"``): the others go on without it.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from sdcwatch.core.errors import ConfigError
from sdcwatch.telemetry.guard.config import GuardConfig, GuardEviction, GuardPlace
from sdcwatch.telemetry.guard.guard import Guard
from sdcwatch.telemetry.probes import fingerprint as fp
from sdcwatch.telemetry.probes.canary import canary_fingerprint
from sdcwatch.telemetry.probes.config import ProbeConfig
from sdcwatch.telemetry.probes.gemm_canary import GemmCanary
from sdcwatch.telemetry.probes.watch import Watch, canary_product
from sdcwatch.telemetry.wire.emitter import NullEmitter
from sdcwatch.testbed.corpus import Corpus
from sdcwatch.testbed.elastic import SimulatedMembership, close_departed, quorum_mean, stand_in_losses
from sdcwatch.testbed.fault_bounds import BoundedInjector
from sdcwatch.testbed.faults import FaultInjector
from sdcwatch.testbed.faultspec import FaultSpec
from sdcwatch.testbed.model import GPT, GPTConfig

__all__ = ["SimulatedRun", "shared_corpus"]

_CORPORA: dict[int, Corpus] = {}


def shared_corpus(max_bytes: int = 4 << 20) -> Corpus:
    """The stdlib corpus, read once per process (two seconds the tests and demo pay only once)."""
    corpus = _CORPORA.get(max_bytes)
    if corpus is None:
        corpus = _CORPORA[max_bytes] = Corpus(max_bytes)
    return corpus


def _check_shape(world: Any, batch_size: Any, lr: Any) -> None:
    """ConfigError naming the first of the run's shape settings that is not what it must be."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError("simulated.world", f"must be an integer >= 1, got {world!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError("simulated.batch_size", f"must be an integer >= 1, got {batch_size!r}")
    if not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError("simulated.lr", f"must be a number > 0, got {lr!r}")


class SimulatedRun:
    """W virtual data-parallel ranks training the reference GPT in one process.

    >>> run = SimulatedRun(world=2, seed=0, batch_size=2)   # doctest: +SKIP
    >>> run.train(3)                                        # doctest: +SKIP
    """

    def __init__(
        self,
        world: int = 8,
        *,
        seed: int = 0,
        faults: Iterable[FaultSpec] = (),
        emitter_factory: Callable[..., Any] | None = None,
        hosts: int | Sequence[str] | None = None,
        ranks_per_host: int = 4,
        model: GPTConfig | None = None,
        batch_size: int = 8,
        lr: float = 3e-3,
        clip: float | None = 1.0,
        skip_nonfinite: bool = False,
        probes: ProbeConfig | None = None,
        corpus: Corpus | None = None,
        guard: GuardConfig | None = None,
        control: Any = None,
        fault_bounds: bool = False,
    ) -> None:
        _check_shape(world, batch_size, lr)
        self.world = world
        self.seed = seed
        self.batch_size = batch_size
        self.lr = float(lr)
        self.clip = clip
        self.skip_nonfinite = bool(skip_nonfinite)
        """Skip the optimizer step when the all-reduced gradient is not finite, as Megatron-LM and
        fp16 loss scalers do; otherwise one NaN poisons every replica at the next step."""
        self.skipped: list[int] = []
        """Steps whose update was skipped (``skip_nonfinite``)."""
        self.hosts = self._host_names(hosts, ranks_per_host)
        self.config = model or GPTConfig()
        self.corpus = corpus or shared_corpus()
        self._init_model(seed)
        self._init_faults(faults, fault_bounds)
        self._init_probes(emitter_factory, probes)
        self.step = 0
        """The next step to run."""
        self.data_pos = 0
        """The data position of the next step (it equals the step until a guard rollback replays data)."""
        self.left: dict[int, int] = {}
        """Ranks whose replica left the quorum (``on_evict="leave"``) -> the step after which it left."""
        self.guard: Guard | None = None if guard is None else self._new_guard(guard, control)
        """The guard, when the run has one (``guard=GuardConfig(...)``): it decides every update."""
        self._deltas: dict[int, list[torch.Tensor | None]] = {}
        self._grads = torch.empty(world, sum(self._sizes))
        self.history: list[float] = []
        """Mean loss over ranks of each step run so far."""

    def _init_model(self, seed: int) -> None:
        """The shared model, initialised from ``seed`` (the global RNG left as it was), and its optimizer."""
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.model = GPT(self.config)
        self.params = [p for p in self.model.parameters()]
        self._sizes = [p.numel() for p in self.params]
        self.optimizer = torch.optim.Adam(self.params, lr=self.lr)

    def _init_faults(self, faults: Iterable[FaultSpec], fault_bounds: bool) -> None:
        """The injector of every rank's faults, attached to the model."""
        # with fault_bounds, each one-element fault records the bound of the checksum covering its
        # tensor (testbed.fault_bounds): how a campaign tells the faults a checksum can see
        self._injector_type = BoundedInjector if fault_bounds else FaultInjector
        self.injector = self._injector_type(faults, rank=0).attach(self.model)
        for f in self.injector.faults:
            if f.rank is not None and f.rank >= self.world:
                raise ConfigError("simulated.faults", f"fault on rank {f.rank} but world is {self.world}")

    def _init_probes(self, emitter_factory: Callable[..., Any] | None, probes: ProbeConfig | None) -> None:
        """Each virtual rank's emitter and watch, the per-product canary and the canary input."""
        factory = emitter_factory or (lambda rank: NullEmitter())
        takes_host = "host" in inspect.signature(factory).parameters
        self.emitters = [factory(r, host=self.hosts[r]) if takes_host else factory(r) for r in range(self.world)]
        # a demo and test instrument: attention on every step, fingerprints every 10 (cost is not the point)
        probe_config = probes or ProbeConfig(
            attention_every=1, activations_every=1, fingerprint_every=10, canary_every=10
        )
        self._gemm_canary = GemmCanary.of(self.model, probe_config)
        # records are built on this thread: sender threads would run during the next rank's pass and
        # bias its measured step time (rank 0 would look like a straggler); the run computes the
        # canary itself: its watches name its products
        canary_names = self._gemm_canary.names if self._gemm_canary is not None else ()
        self.watches = [
            Watch(self.model, e, config=probe_config, external=True, background=False, canary_names=canary_names)
            for e in self.emitters
        ]
        # the canary input: fixed, the same for every rank and every run (like a golden test vector)
        self._canary = torch.randint(
            0, self.config.vocab, (2, self.config.seq_len), generator=torch.Generator().manual_seed(0x5DC)
        )

    def _new_guard(self, guard: GuardConfig, control: Any) -> Guard:
        """The run's guard: one guard over every virtual rank, their replicas and their checksums."""
        return Guard(
            self.model,
            self.optimizer,
            guard,
            place=GuardPlace(0, self.world, self.hosts[0], range(self.world), self.host_of, distributed=False),
            control=control,
            peer=self._peer_loss,
            resync=lambda suspects: self._deltas.clear(),
            checksums=lambda: {
                r
                for r, w in enumerate(self.watches)
                if r not in self.left and w.checksums is not None and w.checksums.violated()
            },
            elastic=SimulatedMembership(self) if guard.on_evict == "leave" else None,
        )

    def _host_names(self, hosts: int | Sequence[str] | None, ranks_per_host: int) -> list[str]:
        if hosts is None:
            if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) or ranks_per_host < 1:
                raise ConfigError("simulated.ranks_per_host", f"must be an integer >= 1, got {ranks_per_host!r}")
            return [f"node{r // ranks_per_host}" for r in range(self.world)]
        if isinstance(hosts, int) and not isinstance(hosts, bool):
            if not 1 <= hosts <= self.world:
                raise ConfigError("simulated.hosts", f"must be in 1..{self.world}, got {hosts}")
            per = -(-self.world // hosts)
            return [f"node{r // per}" for r in range(self.world)]
        names = list(hosts)
        if len(names) != self.world or not all(isinstance(h, str) and h for h in names):
            raise ConfigError("simulated.hosts", f"needs {self.world} non-empty host names, got {names!r}")
        return names

    # -- replicas ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _replica(self, rank: int):
        """Temporarily make the shared parameters those of ``rank``'s replica."""
        deltas = self._deltas.get(rank)
        if not deltas:
            yield
            return
        saved = []
        with torch.no_grad():
            for p, d in zip(self.params, deltas):
                if d is not None:
                    saved.append((p, p.detach().clone()))
                    p.add_(d)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, original in saved:
                    p.copy_(original)

    def _add_delta(self, rank: int, index: int, delta: torch.Tensor) -> None:
        deltas = self._deltas.setdefault(rank, [None] * len(self.params))
        deltas[index] = delta if deltas[index] is None else deltas[index] + delta

    def replica_parameters(self, rank: int) -> list[torch.Tensor]:
        """Copies of ``rank``'s replica parameters (the shared ones plus its divergence)."""
        with self._replica(rank):
            return [p.detach().clone() for p in self.params]

    # -- training --------------------------------------------------------------------------------------
    def train(self, steps: int, on_step: Callable[[int, "SimulatedRun"], Any] | None = None) -> list[float]:
        """Run ``steps`` steps from :attr:`step`; ``on_step(step, run)`` after each. Returns mean losses."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError("simulated.steps", f"must be an integer >= 0, got {steps!r}")
        out = []
        for _ in range(steps):
            out.append(self._step())
            if on_step is not None:
                on_step(self.step - 1, self)
        return out

    def _step(self) -> float:
        s, d = self.step, self.data_pos
        inj = self.injector
        inj.step = s
        self._cur_data = d
        losses: list[torch.Tensor | None] = [None] * self.world
        times = [0.0] * self.world
        cfg = self.watches[0].config
        shared: dict[str, Any] = {}
        compute = self._step_computation(s, d, cfg, inj, losses, times, shared)
        factors = self._lr_factors(self.world)
        d, evicted, guard_scalars = self._update_step(s, d, compute, factors, shared)
        for r, w in enumerate(self.watches):  # each replica's weights as its optimizer left them
            if w.checksums is not None:
                with self._replica(r):
                    w.checksums.seal()
        loss_global = self._record_step(s, cfg, losses, times, shared, factors, guard_scalars)
        self.step = s + 1
        self.data_pos = d + 1
        value = float(loss_global)
        self.history.append(value)
        if evicted is not None:
            raise evicted
        return value

    def _step_computation(
        self, s: int, d: int, cfg: ProbeConfig, inj: Any, losses: list, times: list[float], shared: dict[str, Any]
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Step ``s``'s computation on data step ``d``, repeatable (a guard reruns it): every virtual
        rank's forward and backward into ``losses`` and ``times``, then the all-reduce into ``shared``;
        it returns the ranks' losses, the global and the local gradient norms."""
        fingerprint_step = s % cfg.fingerprint_every == 0
        # Ranks run one after the other: a fixed order would give the first the cold caches after the
        # optimizer step (a straggler); a per-step shuffle spreads that (thread CPU time ignores others).
        order = torch.randperm(self.world, generator=torch.Generator().manual_seed(self.seed * 7919 + s)).tolist()

        def compute() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            self._forward_ranks(order, s, d, inj, losses, times)
            self._all_reduce(cfg.grad_fingerprint and fingerprint_step, shared)
            return torch.stack(losses), shared["global_sq"].sqrt(), shared["local_sq"].sqrt()

        return compute

    def _forward_ranks(self, order: list[int], s: int, d: int, inj: Any, losses: list, times: list[float]) -> None:
        """Every virtual rank's forward and backward in ``order``, only its own watch on; a rank's time
        is its CPU time less its faults' own."""
        for r in (r for r in order if r not in self.left):  # a replica that left computes nothing
            t0 = time.thread_time()
            injecting = inj.cpu_seconds
            inj.rank = r
            for i, w in enumerate(self.watches):
                w.enabled = i == r
            watch = self.watches[r]
            watch.begin_step(s)
            losses[r] = self._forward_backward(r, d, inj)
            times[r] = time.thread_time() - t0 - (inj.cpu_seconds - injecting)  # the fault's own cost is not the rank's
        for w in self.watches:
            w.enabled = True
        stand_in_losses(losses, self.left)

    def _all_reduce(self, grad_fingerprint: Any, shared: dict[str, Any]) -> None:
        """The all-reduce (average) of the ranks' gradients, installed for the update; into ``shared``
        the gradient statistics every rank's probes report and the reduction's CPU time."""
        t0 = time.thread_time()
        g_all = self._grads
        g = quorum_mean(g_all, self.left)  # the all-reduce (average) over the replicas in the quorum
        shared["local_sq"] = (g_all * g_all).sum(1)
        shared["dot"] = g_all @ g
        shared["global_sq"] = g @ g
        shared["grad_fp"] = fp.fingerprint_device([g]) if grad_fingerprint else None
        self._set_gradient(g)
        shared["seconds"] = time.thread_time() - t0

    def _set_gradient(self, g: torch.Tensor) -> None:
        """The flat all-reduced gradient ``g`` as every parameter's gradient, clipped (``clip``)."""
        offset = 0
        for p, n in zip(self.params, self._sizes):
            p.grad = g[offset : offset + n].view_as(p).clone()
            offset += n
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)

    def _lr_factors(self, replicas: int) -> list[float]:
        """Each replica's learning-rate factor at this step (an ``lr_spike`` on its ranks)."""
        inj = self.injector
        factors = []
        for r in range(replicas):
            inj.rank = r
            factors.append(inj.lr_factor())
        return factors

    def _update_step(
        self, s: int, d: int, compute: Callable[[], Any], factors: list[float], shared: dict[str, Any]
    ) -> tuple[int, BaseException | None, dict[str, float]]:
        """Compute step ``s`` and update: as the guard decides when there is one, else skipping a
        non-finite gradient when asked. Returns the data position (a rollback replays data), the
        guard's eviction (raised once the step's records are out) and its scalars for the records."""

        def update() -> None:
            self._update(factors)

        evicted: BaseException | None = None
        guard_scalars: dict[str, float] = {}
        if self.guard is None:
            compute()
            if self.skip_nonfinite and not bool(torch.isfinite(shared["global_sq"])):
                self.skipped.append(s)
            else:
                update()
            return d, evicted, guard_scalars
        try:
            outcome = self.guard.step(s, compute, update=update, data_pos=d)
        except GuardEviction as exc:  # the step's records still go out, with the eviction in them
            evicted, outcome = exc, self.guard.actions[-1]
        guard_scalars = outcome.telemetry()
        if not outcome.applied:
            self.skipped.append(s)
        if outcome.resume_from is not None:
            d = outcome.resume_from - 1  # replay the data from the snapshot on
        return d, evicted, guard_scalars

    def _record_step(
        self,
        s: int,
        cfg: ProbeConfig,
        losses: list,
        times: list[float],
        shared: dict,
        factors: list,
        guard_scalars: dict,
    ) -> torch.Tensor:
        """Every rank's watch observes the step (gradients, fingerprints, canaries) and records it;
        returns the global loss."""
        t0 = time.thread_time()
        fps = self._param_fingerprints(s)
        canaries = self._canary_fingerprints(s, probe_cfg=cfg)
        products = self._gemm_canary_fingerprints(s)
        checked = canary_product(self._gemm_canary, s) if products is not None else {}  # which product
        seconds = shared["seconds"] + time.thread_time() - t0
        loss_global = torch.stack(losses).mean()
        for r, w in enumerate(self.watches):
            if self.left.get(r, s) < s:  # its process is gone
                continue
            w.observe_gradients(
                local_sq=shared["local_sq"][r],
                global_sq=shared["global_sq"],
                dot=shared["dot"][r],
                grad_fp=shared["grad_fp"],
            )
            if fps is not None:
                w.observe_fingerprint("param_fp", fps[r])
            if canaries is not None:
                w.observe_fingerprint("canary_fp", canaries[r])
            if products is not None:
                w.observe_fingerprint("gemm_canary_fp", products[r])
            w.step(
                s,
                loss=losses[r],
                loss_global=loss_global,
                step_time=times[r] + seconds,
                lr=self.lr * factors[r],
                **guard_scalars,
                **(checked if products is not None and products[r] is not None else {}),
            )
        close_departed(self.left, s, self.watches, self.emitters)
        return loss_global

    def _update(self, factors: Sequence[float]) -> None:
        """The optimizer step with each replica's learning-rate factor (an ``lr_spike`` on some
        ranks): the shared update takes the common factor, a replica with its own drifts from it."""
        common = factors[0] if all(f == factors[0] for f in factors) else 1.0
        before = [p.detach().clone() for p in self.params] if any(f != common for f in factors) else None
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * common
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, saved):
            group["lr"] = lr
        if before is not None:  # a rank with its own learning rate drifts from the shared update
            with torch.no_grad():
                for r, f in enumerate(factors):
                    if f != common:
                        for i, (p, b) in enumerate(zip(self.params, before)):
                            self._add_delta(r, i, (p.detach() - b) * (f / common - 1.0))

    def _peer_loss(self, suspect: int, on: int) -> torch.Tensor:
        """``suspect``'s micro-batch of this step (its data, bad data included) through ``on``'s replica
        and hardware: what the guard compares to tell a persistent fault from the data."""
        inj = self.injector
        inj.rank = suspect
        batch = inj.corrupt_batch(
            self.corpus.batch(
                seed=self.seed,
                step=self._cur_data,
                rank=suspect,
                batch_size=self.batch_size,
                seq_len=self.config.seq_len,
            )
        )
        inj.rank = on
        for w in self.watches:
            w.enabled = False
        try:
            with torch.no_grad(), self._replica(on):
                return self.model.loss(batch)
        finally:
            for w in self.watches:
                w.enabled = True

    def replace_ranks(self, ranks: Iterable[int]) -> None:
        """What a launcher does after an eviction: ``ranks`` get healthy hardware (their faults are
        gone) and a fresh copy of the replica; the caller rolls back (``guard.restore``) and goes on."""
        gone = set(ranks)
        keep = [f for f in self.injector.faults if f.rank is None or f.rank not in gone]
        self.injector.detach()
        self.injector = self._injector_type(keep, rank=0).attach(self.model)
        for r in gone:
            self._deltas.pop(r, None)

    def _canary_fingerprints(self, step: int, probe_cfg: ProbeConfig) -> list[torch.Tensor] | None:
        """Each rank's canary fingerprint: the fixed canary input through its replica, with its
        faults active (a faulty unit corrupts the canary as it corrupts training)."""
        if not probe_cfg.canary_every or step % probe_cfg.canary_every:
            return None
        return self._each_replica(lambda: canary_fingerprint(self.model, self._canary))

    def _gemm_canary_fingerprints(self, step: int) -> list[torch.Tensor] | None:
        """Each rank's per-product canary (:mod:`~sdcwatch.telemetry.probes.gemm_canary`), its faults active."""
        canary = self._gemm_canary
        if canary is None or step % canary.stride:
            return None
        return self._each_replica(lambda: canary.fingerprint(step))

    def _each_replica(self, compute: Callable[[], Any]) -> list[Any]:
        """``compute()`` once per rank, on its replica's parameters with its faults active."""
        out = []
        inj = self.injector
        for r in range(self.world):
            inj.rank = r
            with self._replica(r):
                out.append(compute())
        return out

    def _forward_backward(self, r: int, d: int, inj: Any, before: Any = None) -> torch.Tensor:
        """Virtual rank ``r``'s forward and backward on its batch of data step ``d`` (its faults
        applied; ``before()`` runs just ahead of the forward): the loss, detached; the rank's flat
        gradient lands in ``self._grads[r]``."""
        batch = self.corpus.batch(
            seed=self.seed, step=d, rank=r, batch_size=self.batch_size, seq_len=self.config.seq_len
        )
        batch = inj.corrupt_batch(batch)
        self._apply_param_faults(r)
        if before is not None:
            before()
        with self._replica(r):
            self.model.zero_grad(set_to_none=True)
            loss = self.model.loss(batch)
            loss.backward()
        torch.cat(
            [p.grad.reshape(-1) if p.grad is not None else torch.zeros(n) for p, n in zip(self.params, self._sizes)],
            out=self._grads[r],
        )
        return loss.detach()

    def _param_fault_starts(self, rank: int) -> bool:
        """Whether a ``where: "param"`` fault starts at this step on ``rank``."""
        inj = self.injector
        return any(f.where == "param" and f.step == inj.step and f.hits(inj.step, rank) for f in inj.faults)

    def _apply_param_faults(self, rank: int) -> None:
        """A ``where: "param"`` fault starting now on ``rank`` becomes that replica's delta."""
        if not self._param_fault_starts(rank):
            return
        inj = self.injector
        with self._replica(rank):  # the fault hits the replica as it is now
            before = [p.detach().clone() for p in self.params]
            inj.apply_param_faults()
            changed = [
                (i, p.detach() - b) for i, (p, b) in enumerate(zip(self.params, before)) if not torch.equal(p, b)
            ]
            with torch.no_grad():
                for p, b in zip(self.params, before):
                    p.copy_(b)
        for i, delta in changed:  # the shared copy stays clean; the delta is this replica's from now on
            self._add_delta(rank, i, delta)

    def _param_fingerprints(self, step: int) -> list[torch.Tensor] | None:
        cfg = self.watches[0].config
        if step % cfg.fingerprint_every != 0:
            return None
        clean = fp.flat_fingerprint_device(self.params)
        out = []
        for r in range(self.world):
            if self._deltas.get(r):
                with self._replica(r):
                    out.append(fp.flat_fingerprint_device(self.params))
            else:
                out.append(clean)
        return out

    # -- checkpoints -------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path) -> None:
        """Save model, optimizer, replica divergence and the step, so a twin run can branch here."""
        for w in self.watches:
            w.flush()
        torch.save(
            {
                "step": self.step,
                "data_pos": self.data_pos,
                "seed": self.seed,
                "world": self.world,
                "model_config": self.config.__dict__,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "deltas": self._deltas,
                "history": self.history,
                "guard": self.guard.state_dict() if self.guard is not None else None,
            },
            Path(path),
        )

    def load_checkpoint(self, path: str | Path) -> None:
        """Continue from a checkpoint of a run with the same world size, seed and model shape."""
        state = torch.load(Path(path), weights_only=False)
        for key, mine in (("world", self.world), ("seed", self.seed), ("model_config", self.config.__dict__)):
            if state.get(key) != mine:
                raise ConfigError(
                    f"simulated.checkpoint.{key}", f"checkpoint has {state.get(key)!r}, this run {mine!r}"
                )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._deltas = state["deltas"]
        self.history = list(state["history"])
        self.step = int(state["step"])
        self.data_pos = int(state.get("data_pos", self.step))
        if self.guard is not None and state.get("guard") is not None:
            self.guard.load_state_dict(state["guard"])

    def host_of(self, rank: int) -> str:
        """The host name of a virtual rank."""
        return self.hosts[rank]

    def close(self) -> None:
        """Emit the last records and detach probes and faults (emitters are closed too)."""
        for w in self.watches:
            w.close()
        self.injector.detach()
        for e in self.emitters:
            close = getattr(e, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> "SimulatedRun":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
