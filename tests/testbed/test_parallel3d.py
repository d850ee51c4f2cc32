"""Simulated tensor x pipeline x data parallel layouts: who reports what, and where a fault shows."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.errors import ConfigError, FaultSpecError  # noqa: E402
from sdcwatch.core.vocabulary import FIRST_BAD  # noqa: E402
from sdcwatch.testbed.campaign.run import CampaignConfig  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from sdcwatch.testbed.model import GPTConfig  # noqa: E402
from sdcwatch.testbed.parallel3d import ParallelSimulatedRun  # noqa: E402
from sdcwatch.testbed.shard_plan import parse_layout, place_fault, place_of, rank_at, sizes, stage_blocks  # noqa: E402
from sdcwatch.testbed.simulated import shared_corpus  # noqa: E402
from sdcwatch.testbed.campaign.trials import generate_trials  # noqa: E402

torch.set_num_threads(1)
SMALL = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4)
LAYOUT = "tp=2,pp=2,dp=2"


class Recorder:
    def __init__(self, rank, coords):
        self.rank, self.coords, self.records = rank, coords, {}

    def emit(self, step, *, layers=None, fingerprints=None, time=None, **scalars):
        self.records[step] = {"layers": layers or {}, "fingerprints": fingerprints or {}, "scalars": scalars}


def _run(steps, faults=(), layout=LAYOUT):
    recorders = []

    def factory(rank, host="", coords=None):
        recorders.append(Recorder(rank, coords))
        return recorders[-1]

    run = ParallelSimulatedRun(
        layout,
        seed=0,
        faults=[FaultSpec.from_dict(f) for f in faults],
        emitter_factory=factory,
        model=SMALL,
        batch_size=4,
        corpus=shared_corpus(1 << 18),
    )
    run.train(steps)
    run.close()
    return run, recorders


def test_layouts_parse_and_bad_ones_say_what_is_wrong():
    layout = parse_layout("tp=2, pp=2, dp=4")
    assert sizes(layout) == (2, 2, 4) and layout.world == 16
    assert sizes(parse_layout("dp=4")) == (1, 1, 4) and parse_layout("dp=4").world == 4
    seen = set()
    for rank in range(layout.world):
        d, p, t = place_of(layout, rank)
        assert rank_at(layout, d, p, t) == rank and layout.coords(rank) == {"pp": p, "dp_replicate": d, "tp": t}
        seen.add((d, p, t))
    assert len(seen) == 16
    assert place_of(layout, 1) == (0, 0, 1) and place_of(layout, 8) == (0, 1, 0)  # tp fastest, pp outermost
    for bad, match in (
        ("tp=0,dp=2", "parallel.tp"),
        ("xx=2", "unknown mesh dim"),
        ("tp=2,tp=2", "twice"),
        ("tp=a", "not a whole number"),
        ("", "dim=number"),
        ("tp=2,cp=2,dp=2", "cp is not simulated"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_layout(bad)
    with pytest.raises(ConfigError, match="parallel.tp"):
        ParallelSimulatedRun("tp=3,dp=2", model=SMALL)
    with pytest.raises(ConfigError, match="parallel.pp"):
        ParallelSimulatedRun("pp=3,dp=2", model=SMALL)


def test_each_rank_reports_what_it_holds_and_peers_agree_where_they_must():
    run, recs = _run(12)
    layout = run.layout
    assert run.world == 8 and run.replicas == 2 and len(recs) == 8
    assert [r.coords for r in recs] == [layout.coords(r) for r in range(8)]
    by = {place_of(layout, r): recs[r] for r in range(8)}
    for step in (0, 10):
        for (d, p, t), rec in by.items():
            s = rec.records[step]["scalars"]
            layers = rec.records[step]["layers"]
            # the loss lives on the last stage only, the same on its tensor shards
            assert ("loss" in s) == (p == 1) and ("loss_global" in s) == (p == 1)
            if p == 1:
                assert s["loss"] == by[(d, 1, 1 - t)].records[step]["scalars"]["loss"]
            # one value per block of the rank's stage
            assert len(layers["stream_max"]) == len(layers["attn_logit_max"]) == len(layers["attn_logit_min"]) == 1
            # the residual stream is replicated over the tensor shards; the logits are per head
            assert layers["stream_max"] == by[(d, p, 1 - t)].records[step]["layers"]["stream_max"]
            assert layers["attn_logit_max"] != by[(d, p, 1 - t)].records[step]["layers"]["attn_logit_max"]
            # every step, the largest row sum of the rank's share of each product
            assert len(layers["gemm_out"]) == (5 if p == 0 else 6)
            assert layers["gemm_out"] != by[(d, p, 1 - t)].records[step]["layers"]["gemm_out"]
            # the all-reduced gradient of a shard: equal across replicas, different across shards
            peer = by[(1 - d, p, t)].records[step]
            assert s["grad_norm_global"] == peer["scalars"]["grad_norm_global"]
            assert s["grad_norm_local"] != peer["scalars"]["grad_norm_local"]
            assert s["grad_norm_global"] != by[(d, p, 1 - t)].records[step]["scalars"]["grad_norm_global"]
            assert s["grad_norm_global"] != by[(d, 1 - p, t)].records[step]["scalars"]["grad_norm_global"]
            assert s["nonfinite"] == 0 and 0 < s["grad_cosine"] <= 1
    fps = {k: rec.records[10]["fingerprints"] for k, rec in by.items()}
    assert all(set(f) == {"param_fp", "grad_fp", "gemm_canary_fp"} for f in fps.values())
    for d, p, t in by:
        assert fps[(d, p, t)] == fps[(1 - d, p, t)]  # replicas of one shard: bit-identical
        for name in ("param_fp", "gemm_canary_fp"):  # the canary: the rank's share of one product
            assert fps[(d, p, t)][name] != fps[(d, p, 1 - t)][name]
            assert fps[(d, p, t)][name] != fps[(d, 1 - p, t)][name]
    # products checked on the checksum steps: the stage's linear layers (+ the head) and attention mixes
    assert len(by[(0, 0, 0)].records[0]["layers"]["gemm_fwd"]) == 5
    assert len(by[(0, 1, 0)].records[0]["layers"]["gemm_fwd"]) == 6
    assert "gemm_fwd" not in by[(0, 0, 0)].records[1]["layers"]
    # the stage with the head does more work and says so
    assert run.stage_time[1] > run.stage_time[0] and math.isclose(sum(run.stage_time), 2)


def test_a_nan_in_one_tensor_shard_spreads_as_the_collectives_carry_it():
    layout = parse_layout(LAYOUT)
    culprit = rank_at(layout, 1, 0, 1)  # replica 1, first stage, second tensor shard
    run, recs = _run(4, [{"kind": "nan", "rank": culprit, "step": 2, "target": "blocks.0.attn.scores", "seed": 3}])
    by = {place_of(layout, r): recs[r] for r in range(8)}

    def at(d, p, t, step=2):
        return by[(d, p, t)].records[step]

    assert all(math.isfinite(v) for rec in recs for v in rec.records[1]["scalars"].values())
    # the culprit's own heads hold the NaN; its tensor peer's heads do not
    assert math.isnan(at(1, 0, 1)["layers"]["attn_logit_max"][0])
    assert math.isfinite(at(1, 0, 0)["layers"]["attn_logit_max"][0])
    # and the product of its heads' attention (probs @ v, the last of the stage's products)
    assert math.isnan(at(1, 0, 1)["layers"]["gemm_out"][4]) and math.isfinite(at(1, 0, 0)["layers"]["gemm_out"][4])
    # the row-parallel all-reduce hands it to the peer's residual stream, the pipeline to the next stage
    assert math.isnan(at(1, 0, 0)["layers"]["stream_max"][0]) and math.isnan(at(1, 1, 0)["layers"]["stream_max"][0])
    assert math.isnan(at(1, 1, 0)["scalars"]["loss"]) and math.isnan(at(1, 1, 1)["scalars"]["loss"])
    # the other replica computed a clean forward pass; the gradient all-reduce brings it the NaN
    assert math.isfinite(at(0, 1, 0)["scalars"]["loss"]) and math.isfinite(at(0, 0, 1)["layers"]["stream_max"][0])
    assert math.isfinite(at(0, 0, 1)["scalars"]["grad_norm_local"])
    assert all(math.isnan(at(d, p, t)["scalars"]["grad_norm_global"]) for d, p, t in by)
    assert at(1, 0, 1)["scalars"]["nonfinite"] > 0 and at(0, 0, 1)["scalars"]["nonfinite"] > 0
    assert [i.rank for i in run.injector.injections] == [culprit]


@pytest.mark.parametrize(
    "target, kind",
    [
        ("blocks.0.attn.scores", "nan"),  # its heads' logits
        ("blocks.0.attn.qkv", "inf"),  # its share of a column-parallel product
        ("blocks.0.attn.proj", "nan"),  # its partial sum of a row-parallel product
        ("blocks.0.mlp", "near_inf"),  # its copy of a replicated output
        ("blocks.0", "nan"),  # its copy of the residual stream
        ("blocks.0.attn", "near_inf"),  # its copy of an all-reduced output: the next LayerNorm absorbs it
    ],
)
def test_the_culprit_sees_a_bad_value_earlier_in_its_forward_pass_than_its_tensor_peer(target, kind):
    """``nonfinite_first``: the rank whose shard made it first, its tensor peer after the all-reduce
    (or not at all in this stage); nothing on a clean step or in a replica that computed cleanly."""
    layout = parse_layout(LAYOUT)
    culprit, peer = rank_at(layout, 1, 0, 1), rank_at(layout, 1, 0, 0)
    _, recs = _run(4, [{"kind": kind, "rank": culprit, "step": 2, "target": target, "seed": 3}])
    first = {r: recs[r].records[2]["scalars"].get(FIRST_BAD) for r in range(layout.world)}
    assert first[culprit] is not None
    assert first[peer] is None or first[peer] > first[culprit], first
    assert all(first[rank_at(layout, 0, p, t)] is None for p in range(2) for t in range(2))  # the clean replica
    assert all(FIRST_BAD not in rec.records[1]["scalars"] for rec in recs)  # a clean step sends none


def test_an_unhealthy_rank_breaks_only_its_own_checksums():
    layout = parse_layout(LAYOUT)
    culprit = rank_at(layout, 0, 1, 1)
    fault = {
        "kind": "noise",
        "rank": culprit,
        "step": 0,
        "duration": 0,
        "target": "blocks.*",
        "magnitude": 1e-2,
        "seed": 1,
    }
    run, recs = _run(17, [fault])
    for step in (0, 16):
        ratios = {r: max(rec.records[step]["layers"]["gemm_fwd"]) for r, rec in enumerate(recs)}
        assert ratios[culprit] > 1.0, ratios  # off by more than rounding can explain
        assert all(v <= 1.0 for r, v in ratios.items() if r != culprit), ratios


def test_faults_go_where_their_rank_can_have_them():
    layout = parse_layout("tp=2,pp=2,dp=4")
    assert stage_blocks(2, 2) == [[0], [1]] and stage_blocks(5, 2) == [[0, 1, 2], [3, 4]]
    first = rank_at(layout, 2, 0, 1)
    moved = place_fault({"kind": "nan", "rank": first, "step": 1, "target": "blocks.1.mlp.fc"}, layout, 2)
    assert moved["target"] == "blocks.0.mlp.fc" and moved["rank"] == first
    head = place_fault({"kind": "nan", "rank": first, "step": 1, "target": "head"}, layout, 2)
    assert place_of(layout, head["rank"]) == (2, 1, 1)
    with pytest.raises(FaultSpecError, match="matches no module"):
        ParallelSimulatedRun(
            LAYOUT, model=SMALL, faults=[FaultSpec.from_dict({"kind": "nan", "rank": 0, "step": 1, "target": "head"})]
        )
    with pytest.raises(ConfigError, match="8 ranks"):
        ParallelSimulatedRun(
            LAYOUT, model=SMALL, faults=[FaultSpec.from_dict({"kind": "nan", "rank": 8, "step": 1, "target": "head"})]
        )
    config = CampaignConfig(parallel="dp=4,pp=2,tp=2", trials=26)
    assert config.world == 16 and config.parallel == "pp=2,dp_replicate=4,tp=2"
    for trial in generate_trials(config):
        f = trial.fault
        if f.rank is not None and f.target.split(".")[:2][-1].isdigit():
            assert int(f.target.split(".")[1]) in stage_blocks(2, 2)[layout.coords(f.rank)["pp"]]


def test_the_public_names_stay_importable_from_the_run_module():
    """The simulation's parts live in their own modules; the run's module still offers every name."""
    from sdcwatch.testbed import parallel3d, shard_injector, shard_plan, shard_probe

    parts = {**vars(shard_plan), **vars(shard_injector), **vars(shard_probe)}
    for name in parallel3d.__all__:
        assert hasattr(parallel3d, name), name
        if name != "ParallelSimulatedRun":
            assert getattr(parallel3d, name) is parts[name], name
