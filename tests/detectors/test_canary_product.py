"""A replica divergence on the per-product canary names the product the canary checked at that step
(``gemm_canary_product``, sent with ``gemm_canary_fp``): as the incident's layer and in its message;
the index is a bounded counter at ingest on every wire, and records without it read as before."""

from __future__ import annotations

import pytest
from counter_wire import FORGED, assert_forged_is_dead_lettered, assert_travels_on_every_wire
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import CANARY_PRODUCT
from sdcwatch.detectors import StepFrame
from sdcwatch.detectors.replica import ReplicaDivergenceDetector
from sdcwatch.service.pipeline import DetectionPipeline


def canary_step(product: float | None, odd: int = 3, world: int = 4, step: int = 7) -> StepFrame:
    """Step ``step`` of ``world`` ranks whose canary checked ``product`` (None: not sent, as older
    probes); rank ``odd``'s canary result differs."""
    records = []
    for r in range(world):
        scalars = {"loss": 2.0} if product is None else {"loss": 2.0, CANARY_PRODUCT: product}
        fps = {"gemm_canary_fp": 0xBAD if r == odd else 0x600D}
        records.append(Record.make(run="r", step=step, rank=r, world=world, scalars=scalars, fingerprints=fps))
    return StepFrame.from_records("r", step, world, records)


def test_the_finding_names_the_product_as_its_layer():
    (f,) = ReplicaDivergenceDetector().update(canary_step(5.0))
    assert (f.ranks, f.metric, f.layer, f.evidence["gemm_canary_product"]) == ((3,), "gemm_canary_fp", 5, 5)
    assert f.message.endswith("disagree(s) with the majority on gemm_canary_fp (product 5)")


@pytest.mark.parametrize("product", [None, 2.5], ids=["not-sent", "not-a-whole-number"])
def test_without_a_usable_index_the_finding_reads_as_before(product):
    (f,) = ReplicaDivergenceDetector().update(canary_step(product))
    assert (f.ranks, f.metric, f.layer) == ((3,), "gemm_canary_fp", None)
    assert "gemm_canary_product" not in f.evidence
    assert f.message.endswith("disagree(s) with the majority on gemm_canary_fp")


def test_a_split_vote_names_the_product_too():
    records = [
        Record.make(
            run="r", step=4, rank=r, world=4, scalars={CANARY_PRODUCT: 1.0}, fingerprints={"gemm_canary_fp": r % 2}
        )
        for r in range(4)
    ]
    (f,) = ReplicaDivergenceDetector().update(StepFrame.from_records("r", 4, 4, records))
    assert (f.ranks, f.layer) == ((), 1) and "no majority on gemm_canary_fp (product 1)" in f.message


def test_under_pipeline_parallelism_the_product_is_the_one_the_named_rank_stage_checked():
    """Two stages rotate over their own products: at this step the 4 ranks of stage 0 checked their
    product 0, the 4 of stage 1 their product 4; stage 1's rank 6 disagrees with its replicas. The
    finding names stage 1's product (a count over every rank would tie and could name stage 0's)."""
    records = []
    for r in range(8):
        coords = {"pp": r // 4, "dp_replicate": r % 4}
        product = 0.0 if coords["pp"] == 0 else 4.0
        fps = {"gemm_canary_fp": 0xBAD if r == 6 else 0x600D + coords["pp"]}
        records.append(
            Record.make(
                run="r", step=4, rank=r, world=8, scalars={CANARY_PRODUCT: product}, fingerprints=fps, coords=coords
            )
        )
    (f,) = ReplicaDivergenceDetector().update(StepFrame.from_records("r", 4, 8, records))
    assert (f.ranks, f.metric, f.layer, f.evidence["gemm_canary_product"]) == ((6,), "gemm_canary_fp", 4, 4)
    assert f.message.endswith("on gemm_canary_fp (product 4)")


def test_a_training_job_with_an_unhealthy_rank_names_the_product_its_canary_checked():
    """Relative noise of 1e-4 on rank 3's MLP input products from step 2 on (an unhealthy node, far
    under the checksums' bound): the canary checks blocks.0.mlp.fc at step 2, the incident says so."""
    pytest.importorskip("torch")
    import torch
    from sdcwatch.testbed.campaign.branches import RecordCollector
    from sdcwatch.testbed.faultspec import FaultSpec
    from sdcwatch.testbed.model import GPTConfig
    from sdcwatch.testbed.simulated import SimulatedRun, shared_corpus

    torch.set_num_threads(1)
    records: list = []
    noise = FaultSpec(kind="noise", rank=3, step=2, duration=0, target="blocks.*.mlp.fc", magnitude=1e-4, seed=3)
    run = SimulatedRun(
        world=4,
        seed=0,
        faults=[noise],
        model=GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4),
        batch_size=2,
        corpus=shared_corpus(1 << 18),
        emitter_factory=lambda rank, host: RecordCollector(records, run="job", rank=rank, world=4, host=host),
    )
    try:
        run.train(4)
    finally:
        run.close()
    products = [name for name, _ in run._gemm_canary.products]
    sent = {(r.step, r.scalars.get(CANARY_PRODUCT)) for r in records if "gemm_canary_fp" in r.fingerprints}
    assert sent == {(s, float(products.index(run._gemm_canary.product_at(s)[0]))) for s in range(4)}
    pipe = DetectionPipeline()
    pipe.process(records)
    pipe.flush()
    (inc,) = [i for i in pipe.incidents() if i.kind == "replica_divergence"]
    assert (inc.first_step, inc.ranks, inc.metric) == (2, (3,), "gemm_canary_fp")
    assert products[inc.layer] == "blocks.0.mlp.fc"
    assert f"gemm_canary_fp (product {inc.layer})" in inc.message
    # the run computes the canary outside its watches: they still hand the service its products' names
    from sdcwatch.telemetry.probes.name_handoff import watch_names

    assert all(watch_names(w)["canary_products"] == products for w in run.watches)


# -- the wire ------------------------------------------------------------------------------------


def _record(value: float) -> Record:
    return Record("r", 1, 0, 4, "h", 1.0, 0, {"loss": 1.0, CANARY_PRODUCT: value}, {"gemm_canary_fp": 7}, {})


def test_the_index_travels_on_every_wire():
    assert_travels_on_every_wire(_record(12.0), CANARY_PRODUCT)


@pytest.mark.parametrize("bad", FORGED)
def test_a_forged_index_is_dead_lettered_on_every_wire(bad, tmp_path):
    assert_forged_is_dead_lettered(_record(bad), CANARY_PRODUCT, 3.0, tmp_path)
