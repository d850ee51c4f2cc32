"""Real FSDP2 (``fully_shard``) and HSDP over gloo processes: the probes' gradient statistics against
a brute-force computation, shard-wise fingerprints, and faults named through the detectors."""

from __future__ import annotations

import math
import uuid

import pytest
from installed import needs

torch = pytest.importorskip("torch")
needs("torch.distributed.fsdp")

from reference_loop import step0_gradients  # noqa: E402
from sdcwatch.core.vocabulary import FIRST_BAD  # noqa: E402
from sdcwatch.service.offline import read_records  # noqa: E402
from sdcwatch.service.pipeline import DetectionPipeline  # noqa: E402
from sdcwatch.telemetry import is_end_marker  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from sdcwatch.testbed.fsdp_run import FSDPSettings, launch  # noqa: E402
from sdcwatch.testbed.model import GPT  # noqa: E402
from sdcwatch.testbed.simulated import shared_corpus  # noqa: E402

pytestmark = pytest.mark.integration

STEPS, NAN_STEP = 6, 3


def _nan(rank: int) -> FaultSpec:
    return FaultSpec(kind="nan", rank=rank, step=NAN_STEP, target="blocks.0.attn.scores", where="output", seed=1)


def _run(
    tmp_path, probes: dict | None = None, steps: int = STEPS, bus: tuple | None = None, **kw
) -> tuple[FSDPSettings, dict]:
    """Run the sharded testbed; records from one JSON-lines file per rank, or with ``bus``
    (bootstrap, consume) through the real broker on the default wire."""
    topic = f"fsdp.{uuid.uuid4().hex[:8]}"
    settings = FSDPSettings(
        steps=steps,
        seed=0,
        run="fsdp-it",
        jsonl_dir=None if bus else str(tmp_path),
        bootstrap=bus[0] if bus else None,
        topic=topic,
        corpus_bytes=1 << 18,
        ranks_per_host=1,
        clip=None,
        probes=probes or {"fingerprint_every": 1, "attention_every": 1},
        **kw,
    )
    launch(settings)
    if bus:
        records, src = bus[1](bus[0], topic, settings.world * (steps + 1))
        assert src.dead_letters == 0
    else:
        records = [r for rank in range(settings.world) for r in read_records(tmp_path / f"rank{rank}.jsonl")]
    assert sorted((r.step, r.rank) for r in records if is_end_marker(r)) == [
        (steps - 1, r) for r in range(settings.world)
    ]
    table = {(r.step, r.rank): r for r in records if not is_end_marker(r)}
    assert set(table) == {(s, r) for s in range(steps) for r in range(settings.world)}
    shards = settings.world // settings.replicate
    for (step, rank), rec in table.items():  # the mesh's coordinates, on every record
        assert rec.coords == {"dp_replicate": rank // shards, "dp_shard": rank % shards}, (step, rank)
    return settings, table


def _incidents(table: dict) -> list:
    pipe = DetectionPipeline()
    pipe.book.history = []
    pipe.process(sorted(table.values(), key=lambda r: (r.step, r.rank)))
    pipe.flush()
    return list(pipe.book.history)


def _nan_named(table: dict, rank: int) -> None:
    """The records show the NaN where it happened, and the detectors name its rank at its step."""
    assert table[NAN_STEP, rank].scalars["nonfinite"] > 0
    assert all(table[s, r].scalars["nonfinite"] == 0 for s in range(NAN_STEP) for r in range(len(table) // STEPS))
    # where in its forward pass the rank saw it: the first attention layer's logits, after one product
    # (qkv); the other ranks' forward passes were clean (without tensor parallelism nothing else changes)
    assert table[NAN_STEP, rank].scalars[FIRST_BAD] == 1.0
    world = len(table) // STEPS
    assert all(FIRST_BAD not in table[s, r].scalars for s in range(NAN_STEP + 1) for r in range(world) if r != rank)
    found = [i for i in _incidents(table) if i.kind == "nonfinite"]
    assert found, "no non-finite incident"
    first = min(found, key=lambda i: i.first_step)
    assert first.first_step == NAN_STEP and first.ranks == (rank,), (first.first_step, first.ranks, first.message)


@pytest.fixture(scope="module")
def fsdp3(tmp_path_factory):
    """Plain FSDP over 3 ranks (uneven shards: FSDP pads them), a NaN on rank 1 at step 3."""
    return _run(tmp_path_factory.mktemp("fsdp3"), world=3, faults=(_nan(1),))


def _shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s FSDP2 shard of ``t``: its dim-0 chunk (``torch.chunk``; the last may be short)."""
    chunks = torch.chunk(t, world, dim=0)
    return chunks[rank] if rank < len(chunks) else t[:0]


def test_fsdp_gradient_statistics_match_brute_force(fsdp3):
    """Local norm (the whole unsharded local gradient), global norm and the cosine over the rank's own
    shard, against the gradients of an unsharded copy of the model on each rank's batch at step 0."""
    settings, table = fsdp3
    world = settings.world
    local = step0_gradients(settings, world)
    mean = [torch.stack(gs).mean(0) for gs in zip(*local)]
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    global_norm = float(flat(mean).norm())
    for r in range(world):
        s = table[0, r].scalars
        own = flat([_shard(g, r, world) for g in local[r]])
        avg = flat([_shard(g, r, world) for g in mean])
        assert s["grad_norm_local"] == pytest.approx(float(flat(local[r]).norm()), rel=1e-4)
        assert s["grad_norm_global"] == pytest.approx(global_norm, rel=1e-4)
        assert s["grad_cosine"] == pytest.approx(float(own @ avg / (own.norm() * avg.norm())), rel=1e-4)
        assert 0.5 < s["grad_cosine"] < 1.0  # a healthy rank's gradient points with the mean, not equal to it
    for step in range(NAN_STEP):  # one global norm, the same bits on every rank
        assert len({table[step, r].scalars["grad_norm_global"] for r in range(world)}) == 1


def test_fsdp_records_carry_activation_and_attention_statistics_and_shard_fingerprints(fsdp3):
    settings, table = fsdp3
    for (step, rank), rec in table.items():
        assert {"loss", "loss_global", "grad_norm_local", "grad_norm_global", "grad_cosine"} <= set(rec.scalars)
        assert {"param_fp", "grad_fp"} <= set(rec.fingerprints)
        assert len(rec.layers["attn_entropy"]) == 2 and len(rec.layers["stream_max"]) == 2
        if step == 0:  # sampled every 16th step: measured on the unsharded compute of the forward
            assert math.isfinite(rec.scalars["act_max"]) and len(rec.layers["gemm_fwd"]) > 0
            assert max(rec.layers["gemm_fwd"]) < 1  # the forward checksums hold on the all-gathered weights
    for step in range(STEPS):  # every rank holds a different shard: its fingerprints are its own
        assert len({table[step, r].fingerprints["param_fp"] for r in range(settings.world)}) == settings.world


def test_fsdp_nan_on_one_rank_is_named_at_its_step(fsdp3):
    _nan_named(fsdp3[1], rank=1)


SHARD_FLIP_RANK, SHARD_FLIP_STEP = 3, 4


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory, broker, consume):
    """HSDP: 2 replicas x 2 shards (ranks 0, 1 are replica 0), a NaN on rank 2 at step 3 (the update
    skipped), then the lowest exponent bit of one weight flipped in rank 3's shard at step 4. Records
    through the real broker (wire v2, coordinates in the record layout)."""
    if not broker.running:
        broker.start()
    flip = FaultSpec(
        kind="bitflip", rank=SHARD_FLIP_RANK, step=SHARD_FLIP_STEP, target="blocks.0.attn.qkv", where="param", bit=23
    )
    return _run(
        tmp_path_factory.mktemp("hsdp"),
        world=4,
        replicate=2,
        faults=(_nan(2), flip),
        skip_nonfinite=True,
        probes={"fingerprint_every": 1, "attention_every": 1, "checksum_every": 1},
        bus=(broker.bootstrap, consume),
    )


def test_hsdp_replicas_of_a_shard_agree_bit_for_bit(hsdp):
    settings, table = hsdp
    for step in range(NAN_STEP):
        for name in ("param_fp", "grad_fp"):
            by_rank = [table[step, r].fingerprints[name] for r in range(4)]
            # ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1
            assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3], (step, name)
            assert by_rank[0] != by_rank[1], (step, name)
        assert len({table[step, r].scalars["grad_norm_global"] for r in range(4)}) == 1


def test_hsdp_nan_on_one_rank_is_named_at_its_step(hsdp):
    _nan_named(hsdp[1], rank=2)


FLIP_RANK, FLIP_STEP = 4, 2


@pytest.fixture(scope="module")
def hsdp3(tmp_path_factory):
    """HSDP: 3 replicas x 2 shards, one flipped bit in rank 4's parameter shard at step 2 (it persists);
    4 steps and the fingerprints only (6 processes on a small machine)."""
    flip = FaultSpec(
        kind="bitflip", rank=FLIP_RANK, step=FLIP_STEP, target="blocks.0.attn.qkv", where="param", bit=12, seed=1
    )
    return _run(
        tmp_path_factory.mktemp("hsdp3"),
        steps=4,
        probes={"fingerprint_every": 1, "attention": "none", "checksum_every": 0},
        world=6,
        replicate=3,
        faults=(flip,),
    )


def test_hsdp_flipped_shard_is_the_odd_one_among_its_replicas(hsdp3):
    """Rank 4 holds shard 0 with ranks 0 and 2: from the flip on, it alone disagrees with them; the
    other shard's replicas agree throughout."""
    settings, table = hsdp3
    for step in range(settings.steps):
        shard0 = [table[step, r].fingerprints["param_fp"] for r in (0, 2, 4)]
        shard1 = [table[step, r].fingerprints["param_fp"] for r in (1, 3, 5)]
        assert len(set(shard1)) == 1, step
        if step < FLIP_STEP:
            assert len(set(shard0)) == 1, step
        else:
            assert shard0[0] == shard0[1] != shard0[2], step


def test_hsdp_shard_changed_in_memory_is_named_by_its_own_rank_where_no_vote_can(hsdp):
    """Two replicas of a shard cannot outvote each other; the weights-in-memory check compares the
    rank's own shard with what the optimizer wrote, and names the rank, the layer and the step."""
    settings, table = hsdp
    step, rank = SHARD_FLIP_STEP, SHARD_FLIP_RANK
    fps = [table[step, r].fingerprints["param_fp"] for r in range(4)]
    assert fps[0] == fps[2] and fps[1] != fps[3]  # shard 1's two replicas now disagree: a tie
    for s in range(STEPS):
        for r in range(4):
            odd = s == step and r == rank
            assert (max(table[s, r].layers["gemm_weight"]) > 1) == odd, (s, r)
    incidents = _incidents(table)
    votes = [i for i in incidents if i.kind == "replica_divergence"]
    assert votes and min(i.first_step for i in votes) == step  # the disagreement is seen ...
    assert all(i.ranks == () for i in votes), [i.message for i in votes]  # ... and pinned on no one
    found = [i for i in incidents if i.kind == "checksum_mismatch"]
    assert found and min(i.first_step for i in found) == step
    first = min(found, key=lambda i: i.first_step)
    assert first.ranks == (rank,) and first.metric == "gemm_weight", first.message
    assert first.layer == 0  # product 0: blocks.0.attn.qkv, the model's first linear layer


def test_one_process_fsdp_reports_its_gradient_as_local_and_global_and_records_only_sampled_steps(tmp_path):
    """A shard group of one runs no reduce-scatter: the statistics come from the gradient itself;
    with ``every=2`` the odd steps measure nothing and send nothing."""
    import torch.distributed as dist
    from sdcwatch.telemetry.probes.watch import attach
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Emitter:
        def __init__(self):
            self.records = []

        def emit(self, step, **kw):
            self.records.append((step, kw))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rv'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        torch.manual_seed(0)
        model = GPT()
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        emitter = Emitter()
        watch = attach(model, emitter, optimizer=opt, every=2, mesh=mesh)
        assert watch.coords == {"dp_shard": 0}  # sharded: the dp dim holds shards
        corpus = shared_corpus(1 << 18)
        norms = []
        for step in range(4):
            batch = corpus.batch(seed=0, step=step, rank=0, batch_size=2, seq_len=model.cfg.seq_len)
            model.loss(batch).backward()
            norms.append(float(torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()]).norm()))
            opt.step()
            opt.zero_grad()
            watch.step(step)
        watch.close()
        assert [s for s, _ in emitter.records] == [0, 2]
        # a gradient fault cannot reach a shard (outside the autograd graph): refused, not silently idle
        from sdcwatch.core.errors import FaultSpecError
        from sdcwatch.testbed.faults import FaultInjector

        grad_fault = FaultSpec(kind="scale", step=0, target="head", where="grad", magnitude=2.0)
        with pytest.raises(FaultSpecError, match=r"where.*'grad' cannot reach 'head.weight': an FSDP2 shard"):
            FaultInjector([grad_fault]).attach(model)
        for step, kw in emitter.records:
            assert kw["grad_norm_local"] == kw["grad_norm_global"] == pytest.approx(norms[step], rel=1e-5)
            assert kw["grad_cosine"] == 1.0
            assert watch.errors == 0
    finally:
        dist.destroy_process_group()


def test_hsdp_flipped_shard_is_named_by_the_replica_vote_at_its_step(hsdp3):
    """Through the detectors: the vote runs among the replicas of each shard (the records'
    coordinates say which ranks those are), names rank 4 at the flip, and blames no other rank."""
    settings, table = hsdp3
    found = [i for i in _incidents(table) if i.kind == "replica_divergence"]
    assert found, "no replica divergence"
    first = min(found, key=lambda i: i.first_step)
    assert first.first_step == FLIP_STEP and first.ranks == (FLIP_RANK,), (first.first_step, first.ranks, first.message)
    assert all(i.ranks == (FLIP_RANK,) for i in found), [(i.first_step, i.ranks, i.message) for i in found]
