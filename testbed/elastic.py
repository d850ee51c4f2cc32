"""Elastic eviction, for real and simulated: replica groups of the reference GPT under torchft
(one process each, gloo on the CPU) whose guard lets a faulty group leave the quorum, and the
simulated run's membership (:class:`SimulatedMembership`)::

    python -m sdcwatch.testbed.elastic --replicas 4 --steps 120 --fault-step 40 --decide-at 52 --json out.json

A ``leave`` run injects the ``unhealthy-node`` noise on ``--fault-rank`` from ``--fault-step``; the
service's evict decision for that rank (a :class:`~sdcwatch.core.control.Decision` on the wire, read
at ``--decide-at``) makes its group leave; ``clean`` is the same job with neither.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch

__all__ = [
    "ElasticSettings",
    "ScheduledControl",
    "SimulatedMembership",
    "close_departed",
    "main",
    "quorum_mean",
    "run_elastic",
    "stand_in_losses",
]

# -- the simulated run's membership -------------------------------------------------------------


class SimulatedMembership:
    """The virtual ranks of a :class:`~sdcwatch.testbed.simulated.SimulatedRun` as replica groups of
    one rank each: leaving marks them in ``run.left``; the run computes and averages without them."""

    min_replicas = 1

    def __init__(self, run: Any) -> None:
        self.run = run

    def replica_of(self, rank: int) -> int:
        return int(rank)

    def replicas(self) -> int:
        return self.run.world - len(self.run.left)

    def agreement(self) -> None:
        return None  # one process: the guard's local agreement

    def leave(self, step: int, replicas: Sequence[int]) -> bool:
        for r in replicas:
            self.run.left.setdefault(int(r), int(step))
        return True  # this process holds the other ranks too


def quorum_mean(grads: torch.Tensor, left: dict[int, int]) -> torch.Tensor:
    """The average of the rows of ``grads`` (one per rank) still in the quorum; a row that left is
    set to it, so the per-rank gradient statistics stay neutral for it."""
    if not left:
        return grads.mean(0)
    g = grads[[r for r in range(grads.shape[0]) if r not in left]].mean(0)
    grads[list(left)] = g
    return g


def stand_in_losses(losses: list, left: dict[int, int]) -> None:
    """A rank that left reports the others' mean loss (neutral to the guard's checks)."""
    if left:
        mean = torch.stack([x for i, x in enumerate(losses) if i not in left]).mean()
        for r in left:
            losses[r] = mean


def close_departed(left: dict[int, int], step: int, watches: Sequence[Any], emitters: Sequence[Any]) -> None:
    """At the step a rank left: its last record goes out and its emitter ends the rank's run."""
    for r in [r for r, at in left.items() if at == step]:
        watches[r].close()
        getattr(emitters[r], "close", lambda: None)()


# -- real replica groups under torchft ------------------------------------------------------------


@dataclass(frozen=True)
class ElasticSettings:
    """One elastic run: ``replicas`` groups of one process; ``mode`` "leave" (fault + decision) or "clean"."""

    replicas: int = 4
    steps: int = 120
    seed: int = 0
    fault_rank: int = 2
    fault_step: int = 40
    decide_at: int = 52
    """The step at which rank 0's guard reads the service's evict decision."""
    mode: str = "leave"
    batch_size: int = 8
    lr: float = 3e-3
    heartbeat_timeout_ms: int = 500
    eval_batches: int = 8


class ScheduledControl:
    """A control reader that hands the guard ``decision`` (decoded from its wire form, as the
    service publishes it) at its ``at``-th poll: the guard polls once a step."""

    def __init__(self, decision: Any, at: int) -> None:
        from sdcwatch.core.control import decode_decision

        self.decision, self.at, self._polls = decode_decision(decision.encode()), int(at), 0

    def poll(self) -> list[Any]:
        self._polls += 1
        return [self.decision] if self._polls == self.at + 1 else []


def _manager(replica: int, settings: ElasticSettings, lighthouse: str, model: Any, opt: Any) -> tuple[Any, Any]:
    """The group's torchft Manager and the store it serves (kept alive: peers rendezvous on it)."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    return store, Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=1,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"replica{replica}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
    )


def _guard(replica: int, settings: ElasticSettings, model: Any, opt: Any, manager: Any) -> tuple[Any, Any]:
    from sdcwatch.core.control import Decision
    from sdcwatch.telemetry.guard import Guard, GuardConfig, GuardPlace
    from sdcwatch.telemetry.guard.elastic import TorchFTMembership

    membership = TorchFTMembership(manager, replica=replica, replicas=settings.replicas)
    control = None
    if replica == 0 and settings.mode == "leave":
        decision = Decision(
            run="elastic",
            action="evict",
            reason=f"sdc_suspected: rank {settings.fault_rank} deviates from its peers since step {settings.fault_step}",
            ranks=(settings.fault_rank,),
            hosts=(f"node{settings.fault_rank}",),
            since_step=settings.fault_step,
            seq=1,
        )
        control = ScheduledControl(decision, settings.decide_at)
    config = GuardConfig(mode="act", on_evict="leave", on_checksum="none")
    guard = Guard(
        model,
        opt,
        config,
        place=GuardPlace(
            rank=replica,
            world=settings.replicas,
            host=f"node{replica}",
            host_of=lambda r: f"node{r}",
            distributed=False,
        ),
        control=control,
        elastic=membership,
    )
    return guard, membership


def _faults(settings: ElasticSettings) -> list[Any]:
    from sdcwatch.testbed.faultspec import FaultSpec

    if settings.mode != "leave":
        return []
    spec = dict(kind="noise", step=settings.fault_step, rank=settings.fault_rank, duration=0)
    return [FaultSpec.from_dict({**spec, "target": "blocks.*", "where": "output", "magnitude": 1e-2})]


def _compute(model: Any, manager: Any, batch: Any) -> Any:
    """Forward, backward, the gradient all-reduce across the quorum's groups, clipping."""
    loss = model.loss(batch)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    torch.nn.utils.vector_to_parameters(flat, grads)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return loss.detach()


def _replica_main(replica: int, settings: ElasticSettings, lighthouse: str, ready: Any, out: Any) -> None:
    t_start = time.monotonic()
    torch.set_num_threads(1)
    from sdcwatch.testbed.faults import FaultInjector
    from sdcwatch.testbed.corpus import Corpus
    from sdcwatch.testbed.model import GPT

    torch.manual_seed(settings.seed)
    model = GPT()
    opt = torch.optim.Adam(model.parameters(), lr=settings.lr)
    corpus = Corpus(4 << 20)  # the simulated runs' corpus (testbed.simulated.shared_corpus)
    store, manager = _manager(replica, settings, lighthouse, model, opt)
    guard, membership = _guard(replica, settings, model, opt, manager)
    injector = FaultInjector(_faults(settings), rank=replica).attach(model)
    ready.wait()  # every group up before the first quorum
    t_ready, losses, quorum, step_seconds, commits = time.monotonic() - t_start, [], [], [], []
    for step in range(settings.steps):
        t0 = time.monotonic()
        manager.start_quorum()
        quorum.append(manager.num_participants())
        injector.begin_step(step)
        batch = corpus.batch(
            seed=settings.seed, step=step, rank=replica, batch_size=settings.batch_size, seq_len=model.cfg.seq_len
        )
        box: dict[str, Any] = {}
        guard.step(
            step,
            lambda: box.setdefault("loss", _compute(model, manager, batch)),
            update=lambda: _commit(manager, opt, box),
        )
        if membership.left_at is None and "commit" not in box:
            manager.should_commit()  # a step the guard did not apply: the group stays in step
        losses.append(float(box["loss"]))
        commits.append(bool(box.get("commit")))
        step_seconds.append(time.monotonic() - t0)
        if membership.left_at is not None:
            break
    injector.detach()
    if membership.left_at is None:
        manager.shutdown(wait=False)
    del store
    report = _report(replica, settings, model, corpus, guard, membership, t_ready, losses, quorum, step_seconds)
    out.put({**report, "commits": commits})


def _commit(manager: Any, opt: Any, box: dict) -> None:
    box["commit"] = manager.should_commit()
    if box["commit"]:
        opt.step()


def _report(
    replica: int,
    settings: ElasticSettings,
    model: Any,
    corpus: Any,
    guard: Any,
    membership: Any,
    t_ready: float,
    losses: list[float],
    quorum: list[int],
    step_seconds: list[float],
) -> dict[str, Any]:
    with torch.no_grad():  # a fixed held-out set: far data steps no run trains on
        evals = [
            float(
                model.loss(
                    corpus.batch(
                        seed=settings.seed + 1, step=10_000 + i, rank=0, batch_size=8, seq_len=model.cfg.seq_len
                    )
                )
            )
            for i in range(settings.eval_batches)
        ]
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {
        "replica": replica,
        "left_at": membership.left_at,
        "steps_run": len(losses),
        "losses": losses,
        "quorum": quorum,
        "step_seconds": step_seconds,
        "startup_seconds": t_ready,
        "eval_loss": sum(evals) / len(evals),
        "param_sha256": digest,
        "actions": [a.to_dict() for a in guard.actions],
    }


def run_elastic(settings: ElasticSettings) -> dict[str, Any]:
    """Start the lighthouse and one process per replica group, train, and gather each group's report."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=settings.heartbeat_timeout_ms
    )
    ctx = mp.get_context("spawn")
    ready, out = ctx.Barrier(settings.replicas), ctx.Queue()
    t0 = time.monotonic()
    procs = [
        ctx.Process(target=_replica_main, args=(r, settings, lighthouse.address(), ready, out), daemon=True)
        for r in range(settings.replicas)
    ]
    for p in procs:
        p.start()
    try:
        reports = sorted((out.get(timeout=600) for _ in procs), key=lambda x: x["replica"])
    finally:
        for p in procs:
            p.join(timeout=30)
        lighthouse.shutdown()
    return {"settings": asdict(settings), "wall_seconds": time.monotonic() - t0, "replicas": reports}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sdcwatch.testbed.elastic", description=__doc__.split("\n\n")[0])
    for f in ElasticSettings.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ap.add_argument("--json", help="write the reports here (default: stdout)")
    args = vars(ap.parse_args(argv))
    path = args.pop("json")
    result = run_elastic(ElasticSettings(**args))
    text = json.dumps(result, indent=1)
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
