"""Real data parallelism: the reference GPT under ``torch.distributed`` DDP with gloo on CPU.

This is the integration test's driver and the example users copy: one process per rank, one
thread per process, probes attached through a DDP communication hook, faults through the
injector, records to Kafka (or to one JSON-lines file per rank)::

    python -m sdcwatch.testbed.ddp --world 4 --steps 50 --bootstrap 127.0.0.1:9092
    python -m sdcwatch.testbed.ddp --world 4 --steps 50 --jsonl out/ --faults faults.jsonl

The per-rank loop, in :func:`train_rank`, is what goes into a user's own script.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.vocabulary import CONTROL_TOPIC, TELEMETRY_TOPIC
from sdcwatch.testbed.faultspec import FaultSpec, load_faults

__all__ = ["DDPSettings", "launch", "train_rank", "main", "add_run_arguments", "run_settings", "json_setting"]


@dataclass(frozen=True)
class DDPSettings:
    """One distributed reference run (picklable: it travels to every spawned rank)."""

    world: int = 4
    """Number of processes (ranks)."""
    steps: int = 20
    """Steps to run from ``start`` (or from the loaded checkpoint's step)."""
    seed: int = 0
    """Model initialisation and data sampling seed."""
    run: str = "ddp-reference"
    """Run id in every record."""
    bootstrap: str | None = None
    """Kafka address; records go there when set."""
    topic: str = TELEMETRY_TOPIC
    """Kafka topic of the records."""
    jsonl_dir: str | None = None
    """Folder for one ``rank{r}.jsonl`` per rank (used when ``bootstrap`` is not set)."""
    faults: tuple[FaultSpec, ...] = ()
    """Faults to inject."""
    batch_size: int = 8
    """Micro-batch per rank, in sequences."""
    lr: float = 3e-3
    """Adam learning rate."""
    clip: float | None = 1.0
    """Gradient-norm clipping, as large runs do (None: off)."""
    skip_nonfinite: bool = False
    """Skip the optimizer step when the all-reduced gradient is not finite, as Megatron-LM and fp16
    loss scalers do; otherwise one NaN poisons every replica at the next step. Every rank holds the
    same all-reduced gradient, so every rank makes the same choice without talking to the others."""
    probes: dict[str, Any] = field(default_factory=dict)
    """ProbeConfig settings for :func:`sdcwatch.telemetry.probes.watch.attach`."""
    guard: dict[str, Any] | None = None
    """:class:`~sdcwatch.telemetry.guard.guard.GuardConfig` settings (``{"mode": "act"}``); None: no guard.
    With a guard, rank 0 also reads the control topic of the run when ``bootstrap`` is set."""
    control_topic: str = CONTROL_TOPIC
    """Topic rank 0's guard reads decisions from."""
    ranks_per_host: int | None = None
    """Name hosts ``node{rank // ranks_per_host}`` (a simulated cluster); None: the real host name."""
    corpus_bytes: int = 1 << 20
    """Bytes of stdlib source to train on."""
    load: str | None = None
    """Checkpoint to start from."""
    save: str | None = None
    """Where rank 0 writes a checkpoint at the end."""
    init_method: str | None = None
    """torch.distributed rendezvous URL; default a fresh file store."""

    def __post_init__(self) -> None:
        for key, lo in (("world", 1), ("steps", 0), ("batch_size", 1), ("corpus_bytes", 1024)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"ddp.{key}", f"must be an integer >= {lo}, got {v!r}")
        if self.bootstrap is None and self.jsonl_dir is None:
            raise ConfigError("ddp.bootstrap", "set bootstrap (Kafka) or jsonl_dir: records need somewhere to go")
        for f in self.faults:
            if f.rank is not None and f.rank >= self.world:
                raise ConfigError("ddp.faults", f"fault on rank {f.rank} but world is {self.world}")
        if self.guard is not None:
            from sdcwatch.telemetry.guard.config import GuardConfig

            GuardConfig.from_dict(self.guard)  # fail here, not in every spawned rank


def rank_emitter(settings: DDPSettings, rank: int) -> Any:
    from sdcwatch.telemetry.wire.emitter import Emitter
    from sdcwatch.telemetry.wire.transports import FileTransport, KafkaTransport

    if settings.bootstrap:
        transport = KafkaTransport(settings.bootstrap, settings.topic)
    else:
        transport = FileTransport(Path(settings.jsonl_dir) / f"rank{rank}.jsonl")
    host = socket.gethostname() if settings.ranks_per_host is None else f"node{rank // settings.ranks_per_host}"
    return Emitter(transport, run=settings.run, rank=rank, world=settings.world, local_rank=rank, host=host)


def train_rank(rank: int, settings: DDPSettings) -> None:
    """Everything one rank does: join the group, train with probes and faults, report, leave."""
    import torch
    import torch.distributed as dist
    from sdcwatch.telemetry.probes.watch import attach
    from sdcwatch.testbed.faults import FaultInjector
    from sdcwatch.testbed.simulated import shared_corpus
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # several ranks share the CPU: more threads per rank run ~10x slower
    dist.init_process_group("gloo", init_method=settings.init_method, rank=rank, world_size=settings.world)
    emitter = None
    watch = None
    guard = None
    try:
        model, optimizer, start = _model_and_optimizer(settings)
        ddp = DDP(model)  # broadcasts rank 0's parameters: every replica starts identical
        injector = FaultInjector(settings.faults, rank=rank).attach(model, optimizer)
        emitter = rank_emitter(settings, rank)
        # the wrapper as the model: attach takes it as its own ddp= (the README's loop passes ddp= explicitly)
        watch = attach(ddp, emitter, optimizer=optimizer, **settings.probes)
        corpus = shared_corpus(settings.corpus_bytes)
        if settings.guard is not None:
            guard = _guard(settings, rank, model, optimizer, corpus, injector, watch, emitter.host)
        rank_step = _RankStep(settings, rank, model, ddp, optimizer, corpus, injector, watch, guard)
        skipped = [step for step in range(start, start + settings.steps) if not rank_step(step)]
        watch.close()
        if skipped and rank == 0:
            print(f"sdcwatch ddp: skipped the update at steps {skipped}", flush=True)
        if settings.save and rank == 0:
            torch.save(
                {"step": start + settings.steps, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
                settings.save,
            )
        dist.barrier()
    finally:
        if guard is not None:
            guard.close()
        if watch is not None:
            watch.close()
        if emitter is not None:
            emitter.close(timeout=30.0)
        dist.destroy_process_group()


def _model_and_optimizer(settings: DDPSettings) -> tuple[Any, Any, int]:
    """The rank's model and optimizer, fresh from the seed or loaded from ``settings.load``, and the first step."""
    import torch
    from sdcwatch.testbed.model import GPT

    torch.manual_seed(settings.seed)
    model = GPT()
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    start = 0
    if settings.load:
        state = torch.load(settings.load, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    return model, optimizer, start


@dataclass
class _RankStep:
    """One training step of one rank: its batch (faults applied), forward and backward, the update
    (decided by the guard when there is one) and the step's record."""

    settings: DDPSettings
    rank: int
    model: Any
    ddp: Any
    optimizer: Any
    corpus: Any
    injector: Any
    watch: Any
    guard: Any

    def __call__(self, step: int) -> bool:
        """Run ``step``; whether the update was applied (False: skipped)."""
        import torch.distributed as dist

        settings, model, injector, watch = self.settings, self.model, self.injector, self.watch
        watch.begin_step(step)
        injector.begin_step(step)
        batch = self.corpus.batch(
            seed=settings.seed, step=step, rank=self.rank, batch_size=settings.batch_size, seq_len=model.cfg.seq_len
        )
        batch = injector.corrupt_batch(batch)
        out: dict[str, Any] = {}
        applied, guarded = self._update(step, lambda: self._compute(batch, out))
        self.optimizer.zero_grad(set_to_none=True)
        loss = out["loss"]
        loss_global = loss.detach().clone()
        dist.all_reduce(loss_global)  # a user's loss logging does this anyway
        watch.step(step, loss=loss, loss_global=loss_global / settings.world, **guarded)
        injector.end_step()  # after watch.step, so the record shows a spiked learning rate
        return applied

    def _compute(self, batch: Any, out: dict[str, Any]) -> tuple[Any, Any]:
        """This step's forward and backward (the guard may run it twice: same batch, same RNG)."""
        import torch
        from sdcwatch.testbed.model import next_byte_loss

        model = self.model
        out["loss"] = loss = next_byte_loss(self.ddp(batch[:, :-1]), batch)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if self.settings.clip:
            return loss.detach(), torch.nn.utils.clip_grad_norm_(model.parameters(), self.settings.clip)
        return loss.detach(), torch.nn.utils.get_total_norm(grads)

    def _update(self, step: int, compute: Any) -> tuple[bool, dict[str, float]]:
        """Compute the step and update, as the guard decides or skipping a non-finite gradient when
        asked; whether the update was applied, and the guard's scalars for the record."""
        import torch

        if self.guard is not None:
            outcome = self.guard.step(step, compute)
            return outcome.applied, outcome.telemetry()
        _, grad_norm = compute()
        if self.settings.skip_nonfinite and not bool(torch.isfinite(grad_norm)):
            return False, {}
        self.optimizer.step()
        return True, {}


def _guard(
    settings: DDPSettings, rank: int, model: Any, optimizer: Any, corpus: Any, injector: Any, watch: Any, host: str
) -> Any:
    """The rank's guard: local checks, agreement over the process group, rank 0 reads the control topic.

    Its ``peer`` recomputes another rank's micro-batch on this replica: the data is a function of
    (seed, step, rank), so any rank can rebuild any other's batch (bad data included) without sending it.
    """
    import torch
    from sdcwatch.telemetry.guard.config import GuardConfig, GuardPlace
    from sdcwatch.telemetry.guard.control_topic import KafkaControl
    from sdcwatch.telemetry.guard.guard import Guard
    from sdcwatch.testbed.model import next_byte_loss

    def peer(suspect: int, on: int) -> Any:
        if on != rank:
            return None
        own = injector.rank
        injector.rank = suspect  # the suspect's data faults are in its data, whoever reads it
        try:
            batch = injector.corrupt_batch(
                corpus.batch(
                    seed=settings.seed,
                    step=injector.step,
                    rank=suspect,
                    batch_size=settings.batch_size,
                    seq_len=model.cfg.seq_len,
                )
            )
        finally:
            injector.rank = own
        watch.enabled = False
        try:
            with torch.no_grad():
                return next_byte_loss(model(batch[:, :-1]), batch)
        finally:
            watch.enabled = True

    control = None
    if rank == 0 and settings.bootstrap:
        control = KafkaControl(settings.bootstrap, settings.run, settings.control_topic, telemetry_topic=settings.topic)
    return Guard(
        model,
        optimizer,
        GuardConfig.from_dict(settings.guard),
        place=GuardPlace(host=host),
        control=control,
        peer=peer,
        watch=watch,
    )


def launch(settings: DDPSettings, target: Any = None) -> None:
    """Spawn ``settings.world`` processes running :func:`train_rank` (or ``target``, called as
    ``target(rank, settings)``); raises if any rank failed."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="sdcwatch-ddp-") as tmp:
        if settings.init_method is None:
            settings = replace(settings, init_method=f"file://{Path(tmp) / 'rendezvous'}")
        if settings.jsonl_dir:
            Path(settings.jsonl_dir).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(target or train_rank, args=(settings,), nprocs=settings.world, join=True)


def add_run_arguments(ap: argparse.ArgumentParser, run: str) -> None:
    """The options every multi-process reference run takes (this module's and the sharded ones'),
    which :func:`run_settings` reads."""
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run", default=run)
    ap.add_argument("--bootstrap", help="Kafka address host:port")
    ap.add_argument("--topic", default=TELEMETRY_TOPIC)
    ap.add_argument("--jsonl", dest="jsonl_dir", help="folder for rank{r}.jsonl files instead of Kafka")
    ap.add_argument("--faults", help="fault specs (.jsonl or .json array)")
    ap.add_argument("--ranks-per-host", type=int)
    ap.add_argument("--probes", default="{}", help='ProbeConfig settings as JSON, e.g. {"every": 2}')


def run_settings(args: argparse.Namespace, driver: str) -> dict[str, Any]:
    """The settings every multi-process reference run takes, from the options of
    :func:`add_run_arguments`: keyword arguments of :class:`DDPSettings` or a driver's subclass of
    it; ``driver`` names the driver in errors (``fsdp.probes``)."""
    return dict(
        world=args.world,
        steps=args.steps,
        seed=args.seed,
        run=args.run,
        bootstrap=args.bootstrap,
        topic=args.topic,
        jsonl_dir=args.jsonl_dir,
        probes=json_setting(args.probes, f"{driver}.probes"),
        faults=tuple(load_faults(args.faults)) if args.faults else (),
        ranks_per_host=args.ranks_per_host,
    )


def json_setting(text: str, key: str) -> Any:
    """A command-line option given as JSON; ConfigError naming ``key`` when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(key, f"not valid JSON: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the reference model under DDP with probes, optionally with faults."""
    ap = argparse.ArgumentParser(prog="python -m sdcwatch.testbed.ddp", description=main.__doc__)
    add_run_arguments(ap, "ddp-reference")
    ap.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip the optimizer step when the all-reduced gradient is not finite",
    )
    ap.add_argument(
        "--guard",
        default=None,
        metavar="JSON",
        help='run with a guard, GuardConfig settings as JSON, e.g. {"mode": "act"}',
    )
    ap.add_argument("--load")
    ap.add_argument("--save")
    args = ap.parse_args(argv)
    shared = run_settings(args, "ddp")
    guard = None if args.guard is None else json_setting(args.guard, "ddp.guard")
    settings = DDPSettings(**shared, load=args.load, save=args.save, skip_nonfinite=args.skip_nonfinite, guard=guard)
    launch(settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
