"""A replica divergence on the per-product canary names the product the canary checked at that step
(``gemm_canary_product``, sent with ``gemm_canary_fp``): as the incident's layer and in its message;
the index is a bounded counter at ingest on every wire, and records without it read as before."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sdcwatch.core.columnar import PackedRecord, encode_items
from sdcwatch.core.limits import LimitError, RecordLimits
from sdcwatch.core.names import CANARY_PRODUCT
from sdcwatch.core.record import Record, decode_message, encode_batch, record_key
from sdcwatch.core.record_json import from_json, to_json
from sdcwatch.detectors import DetectionPipeline, StepFrame
from sdcwatch.detectors.ingest import IngestDecoder, as_records
from sdcwatch.detectors.offline import ReplayError, read_records
from sdcwatch.detectors.replica import ReplicaDivergenceDetector


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


def test_a_training_job_with_an_unhealthy_rank_names_the_product_its_canary_checked():
    """Relative noise of 1e-4 on rank 3's MLP input products from step 2 on (an unhealthy node, far
    under the checksums' bound): the canary checks blocks.0.mlp.fc at step 2, the incident says so."""
    pytest.importorskip("torch")
    import torch

    from sdcwatch.telemetry.faults import FaultSpec
    from sdcwatch.testbed.campaign import RecordCollector
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


# -- the wire ------------------------------------------------------------------------------------


def _record(value: float) -> Record:
    return Record("r", 1, 0, 4, "h", 1.0, 0, {"loss": 1.0, CANARY_PRODUCT: value}, {"gemm_canary_fp": 7}, {})


def test_the_index_travels_on_every_wire():
    rec = _record(12.0)
    [v1] = decode_message(encode_batch([rec]), RecordLimits())
    [(key, v2, _)] = encode_items([PackedRecord.from_record(rec)], record_key, 16, set())
    items, rejected = IngestDecoder().decode([("t/0/0", key, v2)])
    assert not rejected
    [v2rec] = as_records(items)
    assert v1.scalars[CANARY_PRODUCT] == v2rec.scalars[CANARY_PRODUCT] == 12.0
    assert from_json(to_json(rec)).scalars[CANARY_PRODUCT] == 12.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, -math.inf, 2.0**60])
def test_a_forged_index_is_dead_lettered_on_every_wire(bad, tmp_path):
    rec = _record(bad)
    with pytest.raises(LimitError, match=f"scalars.{CANARY_PRODUCT}") as err:
        decode_message(encode_batch([rec]), RecordLimits())
    assert err.value.reason == "counter"
    good = PackedRecord.from_record(dataclasses.replace(rec, rank=1, scalars={**rec.scalars, CANARY_PRODUCT: 3.0}))
    [(k1, ok, _)] = encode_items([good], record_key, 16, set())
    [(k2, forged, _)] = encode_items([PackedRecord.from_record(rec)], record_key, 16, set())
    items, rejected = IngestDecoder().decode([("t/0/0", k1, ok), ("t/0/1", k2, forged)])
    assert [r.rank for r in as_records(items)] == [1]  # the forged message only is dead-lettered
    [rj] = rejected
    assert rj.code == "counter" and CANARY_PRODUCT in rj.reason
    path = tmp_path / "capture.jsonl"
    path.write_text(to_json(rec) + "\n")
    with pytest.raises(ReplayError, match=CANARY_PRODUCT):
        list(read_records(path))
