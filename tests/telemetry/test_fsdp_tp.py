"""FSDP2 combined with tensor parallelism on real gloo processes: 4 ranks on a 2-D mesh
``(dp_shard=2, tp=2)``, ``parallelize_module`` (column- and row-parallel linears) then ``fully_shard``
on ``dp_shard``, records through the real broker. What each probe gives there, and a NaN made in one
rank's attention heads named on that rank at its step although its tensor-parallel peer's residual
stream goes bad in the same forward."""

from __future__ import annotations

import math
import uuid

import pytest
from installed import needs

torch = pytest.importorskip("torch")
needs("torch.distributed.tensor")  # not .parallel: finding that imports this package, a second per worker

from sdcwatch.service.pipeline import DetectionPipeline  # noqa: E402
from sdcwatch.telemetry import is_end_marker  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402

pytestmark = pytest.mark.integration

STEPS, NAN_STEP, NAN_RANK, WORLD, TP = 8, 4, 1, 4, 2
FC_STEP, FC_RANK = 6, 2  # a NaN in a column-parallel product (blocks.1.mlp.fc) of rank 2


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory, broker, consume):
    """dp_shard=2 x tp=2, a NaN in rank 1's attention logits (its own heads) of block 0 at step 4
    (the update is skipped: step 5 is clean), a NaN in rank 2's column-parallel ``blocks.1.mlp.fc``
    output at step 6 (the injector corrupts the rank's own product); every probe on every step."""
    from sdcwatch.testbed.fsdp_tp import FSDPTPSettings, launch  # torch.distributed.tensor: not at collection

    if not broker.running:
        broker.start()
    topic = f"fsdp-tp.{uuid.uuid4().hex[:8]}"
    nan = FaultSpec(kind="nan", rank=NAN_RANK, step=NAN_STEP, target="blocks.0.attn.scores", where="output", seed=1)
    settings = FSDPTPSettings(
        world=WORLD,
        tp=TP,
        steps=STEPS,
        seed=0,
        run="fsdp-tp-it",
        bootstrap=broker.bootstrap,
        topic=topic,
        corpus_bytes=1 << 18,
        ranks_per_host=1,
        clip=1.0,
        skip_nonfinite=True,
        faults=(nan, FaultSpec(kind="nan", rank=FC_RANK, step=FC_STEP, target="blocks.1.mlp.fc", seed=1)),
        probes={"fingerprint_every": 1, "attention_every": 1, "checksum_every": 1},
    )
    launch(settings)
    records, src = consume(broker.bootstrap, topic, WORLD * (STEPS + 1))
    assert src.dead_letters == 0
    assert sorted((r.step, r.rank) for r in records if is_end_marker(r)) == [(STEPS - 1, r) for r in range(WORLD)]
    table = {(r.step, r.rank): r for r in records if not is_end_marker(r)}
    assert set(table) == {(s, r) for s in range(STEPS) for r in range(WORLD)}
    return settings, table


def _incidents(records) -> list:
    pipe = DetectionPipeline()
    pipe.book.history = []
    pipe.process(sorted(records, key=lambda r: (r.step, r.rank)))
    pipe.flush()
    return list(pipe.book.history)


def test_records_carry_the_mesh_coordinates(fsdp_tp):
    _, table = fsdp_tp
    for (step, rank), rec in table.items():  # torchtitan's layout: tensor parallel fastest
        assert rec.coords == {"dp_shard": rank // TP, "tp": rank % TP}, (step, rank)


def test_what_each_probe_gives_under_fsdp_and_tensor_parallelism(fsdp_tp):
    settings, table = fsdp_tp
    for step in range(NAN_STEP):
        recs = [table[step, r] for r in range(WORLD)]
        s = [r.scalars for r in recs]
        # a tensor-parallel group reads one batch: one loss; the data-parallel shards differ
        assert s[0]["loss"] == s[1]["loss"] != s[2]["loss"] == s[3]["loss"]
        assert all(math.isfinite(x["loss"]) and x["nonfinite"] == 0 for x in s)
        # gradient norms of the rank's tensor-parallel piece: the global one is the all-reduce over
        # dp_shard (equal within a peer group, differs across tp), the local one and the cosine its own
        for t in range(TP):
            assert s[t]["grad_norm_global"] == s[TP + t]["grad_norm_global"], step
            assert 0.5 < s[t]["grad_cosine"] < 1.0 and 0.5 < s[TP + t]["grad_cosine"] < 1.0
        assert s[0]["grad_norm_global"] != s[1]["grad_norm_global"]
        # every rank holds a different piece of the parameters: fingerprints all differ
        assert len({r.fingerprints["param_fp"] for r in recs}) == WORLD
        assert len({r.fingerprints["grad_fp"] for r in recs}) == WORLD
        # attention of the rank's own heads: two layers, different across the tensor-parallel group
        for r in recs:
            assert len(r.layers["attn_entropy"]) == len(r.layers["attn_logit_max"]) == 2
        assert recs[0].layers["q_norm_mean"] != recs[1].layers["q_norm_mean"]
        # the residual stream is all-reduced: equal within a tensor-parallel group
        assert recs[0].layers["stream_max"] == recs[1].layers["stream_max"]
        if step == 0:
            assert math.isfinite(s[0]["act_max"]) and math.isfinite(s[3]["act_max"])
        # checksums: each column-parallel linear's own product holds its bound; a row-parallel
        # one's output is seen after its all-reduce (gemm_out only, no forward check); after the
        # linears, each block's probs @ v (attn.mix) of the rank's own heads holds its bound too
        from sdcwatch.testbed.fsdp_tp import TP_PLAN

        products = 6 * 2 + 1 + 2  # wq wk wv proj fc proj per block, the head, each block's mix
        plan = [TP_PLAN[n] for n in ("attn.wq", "attn.wk", "attn.wv", "attn.proj", "mlp.fc", "mlp.proj")] * 2
        plan.append("replicated")  # the head
        plan += ["own heads"] * 2  # blocks.{0,1}.attn.mix
        for r in recs:
            fwd, out = r.layers["gemm_fwd"], r.layers["gemm_out"]
            assert len(fwd) == len(out) == products
            for i, style in enumerate(plan):
                assert out[i] > 0, (step, r.rank, i)
                if style == "rowwise":
                    assert fwd[i] == 0, (step, r.rank, i)
                else:
                    assert 0 < fwd[i] < 1, (step, r.rank, i, fwd[i])
            assert max(r.layers["gemm_weight"]) < 1  # the rank's own shard, as the optimizer wrote it


def _piece(name: str, grad: torch.Tensor, t: int) -> torch.Tensor:
    """Tensor-parallel rank ``t``'s piece of a parameter's gradient: its rows of a column-parallel
    weight or bias, its columns of a row-parallel weight, the whole of anything replicated."""
    from sdcwatch.testbed.fsdp_tp import TP_PLAN

    module, _, kind = name.rpartition(".")
    style = next((s for suffix, s in TP_PLAN.items() if module.endswith(suffix)), None)
    if style == "colwise":
        return torch.chunk(grad, TP, dim=0)[t]
    if style == "rowwise" and kind == "weight":
        return torch.chunk(grad, TP, dim=1)[t]
    return grad


def test_gradient_norms_are_those_of_the_ranks_tensor_parallel_piece(fsdp_tp):
    """Against an unsharded copy of the model on each data-parallel batch of step 0: the local norm is
    the rank's piece of its own batch's gradient, the global norm its piece of the mean gradient."""
    from sdcwatch.testbed.fsdp_tp import tp_gpt
    from sdcwatch.testbed.model import next_byte_loss
    from sdcwatch.testbed.simulated import shared_corpus

    settings, table = fsdp_tp
    torch.manual_seed(settings.seed)
    model = tp_gpt()
    corpus = shared_corpus(settings.corpus_bytes)
    local = []
    for d in range(WORLD // TP):
        model.zero_grad()
        batch = corpus.batch(seed=settings.seed, step=0, rank=d, batch_size=settings.batch_size, seq_len=64)
        next_byte_loss(model(batch[:, :-1]), batch).backward()
        local.append({n: p.grad.clone() for n, p in model.named_parameters()})
    mean = {n: (local[0][n] + local[1][n]) / 2 for n in local[0]}

    def norm(grads: dict, t: int) -> float:
        return float(torch.cat([_piece(n, g, t).reshape(-1) for n, g in grads.items()]).norm())

    for rank in range(WORLD):
        d, t = divmod(rank, TP)
        s = table[0, rank].scalars
        assert s["grad_norm_local"] == pytest.approx(norm(local[d], t), rel=1e-4), rank
        assert s["grad_norm_global"] == pytest.approx(norm(mean, t), rel=1e-4), rank


def test_a_clean_run_raises_nothing_and_a_nan_in_one_ranks_heads_names_that_rank_at_its_step(fsdp_tp):
    _, table = fsdp_tp
    clean = [rec for (step, _), rec in table.items() if step < NAN_STEP]
    assert _incidents(clean) == []  # the steps before the fault: a clean 2-D run
    # the NaN is made in rank 1's heads; its tensor-parallel peer's stream goes bad in the same forward
    nan = [table[NAN_STEP, r] for r in range(WORLD)]
    assert math.isnan(nan[NAN_RANK].layers["attn_logit_max"][0])
    assert math.isfinite(nan[0].layers["attn_logit_max"][0]) and math.isnan(nan[0].layers["stream_max"][0])
    before_fc = [rec for (step, _), rec in table.items() if step < FC_STEP]  # one incident merges both faults
    found = [i for i in _incidents(before_fc) if i.kind == "nonfinite"]
    assert found, "no non-finite incident"
    first = min(found, key=lambda i: i.first_step)
    assert first.first_step == NAN_STEP and first.ranks == (NAN_RANK,), (first.first_step, first.ranks, first.message)
    assert "dp_shard=0,tp=1" in first.message and "tensor-parallel group received it" in first.message


def test_a_nan_in_a_column_parallel_product_is_named_on_its_rank_by_the_order_of_the_products(fsdp_tp):
    _, table = fsdp_tp
    assert all(table[FC_STEP - 1, r].scalars["nonfinite"] == 0 for r in range(WORLD))  # the skipped update
    fc = [table[FC_STEP, r] for r in range(WORLD)]
    # block 1's stream goes bad on both ranks of the group; rank 2's fc output (product 10) first
    assert math.isnan(fc[2].layers["gemm_out"][10]) and math.isfinite(fc[3].layers["gemm_out"][10])
    assert math.isnan(fc[2].layers["stream_max"][1]) and math.isnan(fc[3].layers["stream_max"][1])
    later = [rec for (step, _), rec in table.items() if step >= FC_STEP - 1]
    found = [i for i in _incidents(later) if i.kind == "nonfinite"]
    first = min(found, key=lambda i: i.first_step)
    assert first.first_step == FC_STEP and first.ranks == (FC_RANK,), (first.first_step, first.ranks, first.message)
