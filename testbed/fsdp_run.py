"""Real sharded data parallelism: the reference GPT under FSDP2 (``fully_shard``) or HSDP, gloo on CPU.

The integration tests' driver and the example to copy for a sharded model: one process per rank,
a device mesh ``(dp_replicate, dp_shard)``, ``fully_shard`` on every block and on the root, the
probes attached with the mesh (records carry the rank's coordinates), faults through the injector::

    python -m sdcwatch.testbed.fsdp_run --world 4 --replicate 2 --steps 20 --jsonl out/

``replicate=1`` is plain FSDP (every rank holds a different shard); ``replicate=R`` is HSDP: R
replicas of a model sharded over ``world // R`` ranks each.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from sdcwatch.core.errors import ConfigError
from sdcwatch.testbed.ddp import DDPSettings, add_run_arguments, rank_emitter, run_settings
from sdcwatch.testbed.ddp import launch as _launch

__all__ = [
    "FSDPSettings",
    "check_sharded",
    "by_mesh",
    "total_grad_norm",
    "train_steps",
    "run_rank",
    "launch",
    "train_rank",
    "sharded_main",
    "main",
]


@dataclass(frozen=True)
class FSDPSettings(DDPSettings):
    """One sharded reference run; the fields are :class:`~sdcwatch.testbed.ddp.DDPSettings`' and:"""

    replicate: int = 1
    """Replicas of the sharded model (HSDP when > 1); each is sharded over ``world // replicate`` ranks."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sharded(self, "fsdp", "replicate")

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(dp_replicate, dp_shard)."""
        return (self.replicate, self.world // self.replicate)


def check_sharded(settings: DDPSettings, driver: str, dim: str) -> None:
    """What the settings of every sharded run must hold (a ConfigError naming ``driver``'s field
    otherwise): the size of its mesh dimension ``dim`` divides the world; no guard and no
    checkpoints, which only the DDP driver has."""
    n = getattr(settings, dim)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or settings.world % n:
        raise ConfigError(f"{driver}.{dim}", f"must be a positive divisor of world {settings.world}, got {n!r}")
    for key in ("guard", "load", "save"):
        if getattr(settings, key) is not None:
            raise ConfigError(f"{driver}.{key}", "is not supported by the sharded drivers (use the DDP one)")


def by_mesh(params) -> dict:
    """The parameters that have a gradient, grouped by the device mesh their gradient lives on."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups


def total_grad_norm(params):
    """The norm of the whole model's gradient, the same on every rank. ``clip_grad_norm_`` cannot
    take it when parameters live on different meshes (under tensor parallelism the tensor-parallel
    ones on the 2-D mesh, the others on ``dp_shard`` alone: "All operands in aten.stack.default
    must have the same mesh"), so it is taken per mesh (one all-reduce each) and combined."""
    import torch

    norms = []
    for group in by_mesh(params).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor: over every shard
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def train_steps(settings, model, optimizer, injector, watch, corpus, data_rank: int) -> None:
    """The steps of a sharded reference run (FSDP2, HSDP, FSDP2 + tensor parallel): the batch of
    ``data_rank``, forward and backward, the gradient's norm (clipped to ``settings.clip``), the
    optimizer step unless the norm is non-finite and ``skip_nonfinite`` is set (every rank holds
    the same norm, so every rank skips alike), the probes' step with the global loss."""
    import torch
    import torch.distributed as dist
    from sdcwatch.testbed.model import next_byte_loss

    for step in range(settings.steps):
        watch.begin_step(step)
        injector.begin_step(step)
        batch = corpus.batch(
            seed=settings.seed, step=step, rank=data_rank, batch_size=settings.batch_size, seq_len=model.cfg.seq_len
        )
        batch = injector.corrupt_batch(batch)
        loss = next_byte_loss(model(batch[:, :-1]), batch)
        loss.backward()
        grad_norm = total_grad_norm(model.parameters())
        if settings.clip:
            for params in by_mesh(model.parameters()).values():  # one mesh per foreach call
                torch.nn.utils.clip_grads_with_norm_(params, settings.clip, grad_norm)
        if not (settings.skip_nonfinite and not bool(torch.isfinite(grad_norm))):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_global = loss.detach().clone()
        dist.all_reduce(loss_global)
        watch.step(step, loss=loss, loss_global=loss_global / settings.world)
        injector.end_step()


def run_rank(rank: int, settings, dims: tuple[str, str], build) -> None:
    """Everything one rank of a sharded reference run does: join the gloo group, build the device
    mesh with ``dims``, the model with ``build(mesh)`` (the same initial weights on every rank,
    sharded or split from there; it returns the model and the rank whose data this rank reads),
    train with probes and faults, report, leave."""
    import torch
    import torch.distributed as dist
    from sdcwatch.telemetry.probes.watch import attach
    from sdcwatch.testbed.faults import FaultInjector
    from sdcwatch.testbed.simulated import shared_corpus
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # several ranks share the CPU: more threads per rank run ~10x slower
    dist.init_process_group("gloo", init_method=settings.init_method, rank=rank, world_size=settings.world)
    emitter = watch = None
    try:
        mesh = init_device_mesh("cpu", settings.mesh_shape, mesh_dim_names=dims)
        torch.manual_seed(settings.seed)
        model, data_rank = build(mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
        injector = FaultInjector(settings.faults, rank=rank).attach(model, optimizer)
        emitter = rank_emitter(settings, rank)
        watch = attach(model, emitter, optimizer=optimizer, mesh=mesh, **settings.probes)
        train_steps(settings, model, optimizer, injector, watch, shared_corpus(settings.corpus_bytes), data_rank)
        watch.close()
        dist.barrier()
    finally:
        if watch is not None:
            watch.close()
        if emitter is not None:
            emitter.close(timeout=30.0)
        dist.destroy_process_group()


def train_rank(rank: int, settings: FSDPSettings) -> None:
    """One rank of the FSDP2/HSDP run: the reference model, ``fully_shard`` on every block and the root."""

    def build(mesh):
        from sdcwatch.testbed.model import GPT
        from torch.distributed.fsdp import fully_shard

        fsdp_mesh = mesh if settings.replicate > 1 else mesh["dp_shard"]
        model = GPT()
        for block in model.blocks:
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
        return model, rank

    run_rank(rank, settings, ("dp_replicate", "dp_shard"), build)


def launch(settings: FSDPSettings) -> None:
    """Spawn ``settings.world`` processes running :func:`train_rank`; raises if any rank failed."""
    _launch(settings, train_rank)


def sharded_main(
    argv: Sequence[str] | None, settings_type: type, launch, *, driver: str, description: str, option: str, **flag
) -> int:
    """The command line of sharded reference run ``driver`` (``fsdp_tp``: ``python -m
    sdcwatch.testbed.fsdp_tp``, run ``fsdp-tp-reference``, errors ``fsdp_tp.<key>``): the options every
    run takes (:func:`add_run_arguments`) and ``--{option}``, its mesh dimension (``flag``: its
    ``default`` and ``help``); hands the run's settings to ``launch``."""
    module = f"sdcwatch.testbed.{'fsdp_run' if driver == 'fsdp' else driver}"
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    add_run_arguments(ap, f"{driver.replace('_', '-')}-reference")
    ap.add_argument(f"--{option}", type=int, **flag)
    args = ap.parse_args(argv)
    launch(settings_type(**run_settings(args, driver), **{option: getattr(args, option)}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the reference model under FSDP2/HSDP with probes, optionally with faults."""
    return sharded_main(
        argv,
        FSDPSettings,
        launch,
        driver="fsdp",
        description=main.__doc__,
        option="replicate",
        default=1,
        help="HSDP replicas (1: plain FSDP)",
    )


if __name__ == "__main__":
    raise SystemExit(main())
