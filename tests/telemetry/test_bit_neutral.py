"""Attaching sdcwatch never changes the training: with every helper the docs offer at the default
(``watch.clip_grad_norm_``, the DDP communication hook, the FSDP2 hooks, the guard in report mode,
with ``MicroBatches`` under gradient accumulation),
a watched job's parameters are bit for bit an unwatched twin's after every step, and two watched
runs are bit for bit each other's. One process, three gloo ranks under DDP, two under FSDP2; the
Hugging Face and Lightning callbacks are in test_bit_neutral_frameworks.py. Each rank runs the twins
one after another, and reports the SHA-256 of its parameters after each step.
"""

from __future__ import annotations

import hashlib
import json

import pytest

torch = pytest.importorskip("torch")

from tiny_llama import launch  # noqa: E402

STEPS = 6
CLIP = 0.05  # below every step's gradient norm: the clipping scales every step's update


class Records:
    """An emitter that keeps nothing: the records are not what these tests compare."""

    def emit(self, step: int, **fields) -> None:
        pass


def digest(tensors) -> str:
    """SHA-256 of the tensors' bytes, in order (a DTensor: this rank's shard)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def first_difference(runs: dict[str, list[str]], reference: str = "unwatched") -> str:
    """'' when every run's parameters equal the reference's after every step, else which run first
    differs, at which step."""
    base = runs[reference]
    for name, digests in runs.items():
        for step, (a, b) in enumerate(zip(base, digests)):
            if a != b:
                return f"{name} differs from {reference} from step {step} on ({b[:8]} != {a[:8]})"
        if len(digests) != len(base):
            return f"{name} ran {len(digests)} steps, {reference} {len(base)}"
    return ""


def gpt(seed: int = 0):
    from sdcwatch.testbed.model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=2))


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (4, 17), generator=g)


def train(how: str, rank: int = 0, *, parallel: str = "none", scaled: bool = False) -> list[str]:
    """``STEPS`` steps of the tiny GPT clipped at ``CLIP``; the parameters' digest after each.

    ``how``: "unwatched" (torch's clipping), "watched" (``attach`` and ``watch.clip_grad_norm_``),
    "guarded" (the same under ``Guard`` in its default report mode). ``parallel``: "none", "ddp"
    (the watch's communication hook) or "fsdp" (``fully_shard`` on each block and the root).
    ``scaled``: the loss scaled by a ``GradScaler``, the gradient unscaled before the clipping."""
    from sdcwatch.telemetry import Guard, attach
    from sdcwatch.testbed.model import next_byte_loss

    model = gpt()
    forward, ddp = model, None
    if parallel == "ddp":
        forward = ddp = torch.nn.parallel.DistributedDataParallel(model)
    elif parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    watch = None if how == "unwatched" else attach(model, Records(), optimizer=opt, ddp=ddp)
    guard = Guard(model, opt, watch=watch) if how == "guarded" else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None

    def compute(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = batch(step, rank)
        loss = next_byte_loss(forward(tokens[:, :-1]), tokens)
        if scaler is None:
            loss.backward()
        else:  # the watch reads the scaled gradient in the backward; the clipping must see the unscaled
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        if watch is None:
            return loss.detach(), torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        return loss.detach(), watch.clip_grad_norm_(CLIP)

    digests = []
    for step in range(STEPS):
        if guard is not None:
            outcome = guard.step(step, lambda: compute(step))
            assert outcome.applied, outcome  # report mode: the update always goes through
        else:
            opt.zero_grad(set_to_none=True)
            compute(step)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
        if watch is not None:
            watch.step(step)
        digests.append(digest(model.parameters()))
    if watch is not None:
        watch.close()
    return digests


TWINS = ("unwatched", "watched", "watched-again", "guarded")


def test_one_process_watched_and_guarded_runs_are_bit_identical_to_the_unwatched():
    runs = {name: train(name.removesuffix("-again")) for name in TWINS}
    assert len(set(runs["unwatched"])) == STEPS  # the parameters move at every step
    assert first_difference(runs) == "", first_difference(runs)


def test_one_process_under_a_grad_scaler_the_watched_runs_are_bit_identical_to_the_unwatched():
    runs = {name: train(name.removesuffix("-again"), scaled=True) for name in TWINS[:3]}
    assert len(set(runs["unwatched"])) == STEPS
    assert first_difference(runs) == "", first_difference(runs)


def train_accumulating(how: str, accum: int = 3) -> list[str]:
    """``train`` with gradient accumulation as nanoGPT writes it: the next micro-batch drawn from
    torch's generator between a micro-batch's forward and its backward. Guarded ("guarded"), the
    loop reads each step's micro-batches through ``MicroBatches`` instead, with the watch."""
    from sdcwatch.telemetry import Guard, MicroBatches, attach
    from sdcwatch.testbed.model import next_byte_loss

    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(7)  # the batches' draws

    def get_batch() -> torch.Tensor:
        return torch.randint(0, 256, (4, 17))

    def micro_step(tokens: torch.Tensor) -> torch.Tensor:
        return next_byte_loss(model(tokens[:, :-1]), tokens) / accum

    digests = []
    if how == "unwatched":
        tokens = get_batch()
        for _ in range(STEPS):
            for _ in range(accum):
                loss = micro_step(tokens)
                tokens = get_batch()  # the prefetch
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            digests.append(digest(model.parameters()))
        return digests
    watch = attach(model, Records(), optimizer=opt)
    guard = Guard(model, opt, watch=watch)
    batches = MicroBatches(get_batch, per_step=accum)
    for step in range(STEPS):
        micro = batches.of(step)

        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            total = torch.zeros(())
            for tokens in micro:
                loss = micro_step(tokens)
                loss.backward()
                total += loss.detach()
            return total, torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)

        assert guard.step(step, compute).applied
        watch.step(step)
        digests.append(digest(model.parameters()))
    watch.close()
    return digests


def test_one_process_accumulating_through_micro_batches_the_guarded_run_is_bit_identical_to_nanogpts_loop():
    runs = {name: train_accumulating(name) for name in ("unwatched", "guarded")}
    assert len(set(runs["unwatched"])) == STEPS
    assert first_difference(runs) == "", first_difference(runs)


def _parallel_rank(rank: int, parallel: str, twins: tuple[str, ...], out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        runs = {name: train(name.removesuffix("-again"), rank, parallel=parallel) for name in twins}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(runs, f)
        dist.barrier()  # no rank leaves the group while another still talks to it
    finally:
        dist.destroy_process_group()


def parallel_runs(tmp_path, parallel: str, twins: tuple[str, ...], world: int) -> list[dict[str, list[str]]]:
    """Each rank's digests of each twin, the twins run one after another in one set of processes."""
    launch(_parallel_rank, parallel, twins, str(tmp_path / "digests"), world=world)
    return [json.loads((tmp_path / f"digests.{rank}").read_text()) for rank in range(world)]


@pytest.mark.integration
def test_ddp_watched_and_guarded_runs_are_bit_identical_to_the_unwatched(tmp_path):
    # three ranks: averaging by dividing by two and by multiplying by a half give the same bits,
    # by three and by a third do not (DDP's own reducer multiplies)
    ranks = parallel_runs(tmp_path, "ddp", TWINS, world=3)
    assert ranks[0]["unwatched"] == ranks[2]["unwatched"]  # DDP keeps the replicas equal
    assert len(set(ranks[0]["unwatched"])) == STEPS
    for rank, runs in enumerate(ranks):
        assert first_difference(runs) == "", f"rank {rank}: {first_difference(runs)}"


@pytest.mark.integration
def test_fsdp2_watched_runs_are_bit_identical_to_the_unwatched(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    ranks = parallel_runs(tmp_path, "fsdp", ("unwatched", "watched", "watched-again"), world=2)
    assert len(set(ranks[0]["unwatched"])) == STEPS
    for rank, runs in enumerate(ranks):
        assert first_difference(runs) == "", f"rank {rank}: {first_difference(runs)}"
