"""The per-product canary of the simulated 3D ranks names its product as the data-parallel ranks'
does: each rank sends which product of its stage it checked (``gemm_canary_product``) beside
``gemm_canary_fp`` and hands the service its stage's product names, so an unhealthy rank's canary
incident says ``gemm_canary_fp of blocks.N.... (product K)``, on that rank, at the fault's onset."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.rank_notes import LayerNames  # noqa: E402
from sdcwatch.core.vocabulary import CANARY_PRODUCT  # noqa: E402
from sdcwatch.service.pipeline import DetectionPipeline  # noqa: E402
from sdcwatch.testbed.campaign.branches import RecordCollector  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from sdcwatch.testbed.model import GPTConfig  # noqa: E402
from sdcwatch.testbed.parallel3d import ParallelSimulatedRun  # noqa: E402
from sdcwatch.testbed.shard_plan import parse_layout, rank_at  # noqa: E402
from sdcwatch.testbed.simulated import shared_corpus  # noqa: E402

torch.set_num_threads(1)
SMALL = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4)
LAYOUT = "tp=2,pp=2,dp=4"
ONSET, STEPS = 8, 10  # at step 8 stage 0 checks its product 0, stage 1 its product 3 (blocks.1.mlp.proj)


class NamedCollector(RecordCollector):
    """A collector that also keeps the layer names its rank hands over, as the emitter sends them."""

    def set_names(self, names):
        self.sink.append(LayerNames.build(self.run, self.rank, self.world, 0, names))


@pytest.fixture(scope="module")
def unhealthy_rank():
    """Relative noise of 1e-2 on every block output of the rank at (replica 1, last stage, tensor
    shard 1) from step ONSET on: the demo's unhealthy node."""
    layout = parse_layout(LAYOUT)
    culprit = rank_at(layout, 1, 1, 1)
    sink: list = []
    noise = FaultSpec(kind="noise", rank=culprit, step=ONSET, duration=0, target="blocks.*", magnitude=1e-2, seed=3)
    run = ParallelSimulatedRun(
        layout,
        seed=0,
        faults=[noise],
        model=SMALL,
        batch_size=2,
        corpus=shared_corpus(1 << 18),
        emitter_factory=lambda rank, host, coords: NamedCollector(
            sink, run="job", rank=rank, world=layout.world, host=host, coords=coords
        ),
    )
    try:
        run.train(STEPS)
    finally:
        run.close()
    return run, culprit, sink


def test_each_rank_sends_which_product_of_its_stage_its_canary_checked(unhealthy_rank):
    run, _, sink = unhealthy_rank
    records = [x for x in sink if not isinstance(x, LayerNames)]
    canaries = run.stage_canaries
    # each stage rotates over its own linear layers, in the model's order
    linear = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    assert [c.names for c in canaries] == [
        [f"blocks.0.{n}" for n in linear],
        [f"blocks.1.{n}" for n in linear] + ["head"],
    ]
    sent = {(r.rank, r.step): r.scalars.get(CANARY_PRODUCT) for r in records if "gemm_canary_fp" in r.fingerprints}
    assert len(sent) == run.world * STEPS  # a canary on every step at the demo's probes
    for (rank, step), index in sent.items():
        stage = run.layout.coords(rank)["pp"]
        assert index == float(canaries[stage].index_at(step))
    # the index comes only with the fingerprint it describes
    assert all(CANARY_PRODUCT not in r.scalars for r in records if "gemm_canary_fp" not in r.fingerprints)


def test_each_rank_names_its_stage_canary_products(unhealthy_rank):
    run, _, sink = unhealthy_rank
    names = {x.rank: x.names for x in sink if isinstance(x, LayerNames)}
    assert set(names) == set(range(run.world))
    for rank, lists in names.items():
        stage = run.layout.coords(rank)["pp"]
        assert lists == {"canary_products": tuple(run.stage_canaries[stage].names)}


def test_the_unhealthy_rank_canary_incident_names_its_product_at_onset(unhealthy_rank):
    run, culprit, sink = unhealthy_rank
    pipe = DetectionPipeline()
    pipe.process(sink)
    pipe.flush()
    canary = [i for i in pipe.incidents() if i.kind == "replica_divergence" and i.metric == "gemm_canary_fp"]
    assert canary, [(i.kind, i.metric, i.message) for i in pipe.incidents()]
    inc = min(canary, key=lambda i: i.first_step)
    assert (inc.first_step, inc.ranks) == (ONSET, (culprit,))
    last = run.stage_canaries[run.layout.coords(culprit)["pp"]]
    product = last.index_at(ONSET)
    assert inc.layer == product
    assert f"gemm_canary_fp of {last.names[product]} (product {product})" in inc.message, inc.message
