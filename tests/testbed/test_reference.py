"""The reference run: model, corpus, and the simulated data-parallel driver."""

from __future__ import annotations

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.core.vocabulary import GEMM_METRICS, STREAM_METRICS  # noqa: E402
from sdcwatch.telemetry import LAYER_METRICS, Emitter, MemoryBus, MemoryTransport, is_end_marker  # noqa: E402
from sdcwatch.telemetry.probes.fingerprint import fingerprint  # noqa: E402
from sdcwatch.testbed.corpus import Corpus  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402
from sdcwatch.testbed.simulated import SimulatedRun, shared_corpus  # noqa: E402

torch.set_num_threads(1)
SMALL = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4)


class Recorder:
    def __init__(self):
        self.records = {}

    def emit(self, step, *, layers=None, fingerprints=None, time=None, **scalars):
        self.records[step] = {"layers": layers, "fingerprints": fingerprints, "scalars": scalars}


def _run(world=4, faults=(), *, batch_size=4, emitter_factory=lambda r: Recorder(), **kw):
    """The small reference model on ``world`` simulated ranks, each recording into a Recorder unless
    ``emitter_factory`` says otherwise."""
    return SimulatedRun(
        world=world,
        seed=0,
        faults=faults,
        emitter_factory=emitter_factory,
        model=SMALL,
        batch_size=batch_size,
        corpus=shared_corpus(1 << 18),
        **kw,
    )


def _trained_into(bus: MemoryBus, run: str, fault: FaultSpec, steps: int) -> None:
    """``steps`` steps of 4 ranks at batch 2 with ``fault``, their records sent to ``bus`` as run ``run``."""
    sim = _run(
        faults=[fault],
        batch_size=2,
        emitter_factory=lambda rank: Emitter(MemoryTransport(bus), run=run, rank=rank, world=4),
    )
    sim.train(steps)
    sim.close()


def test_model_has_the_documented_module_names_and_bad_shapes_are_config_errors():
    names = dict(GPT(SMALL).named_modules())
    for n in ("blocks.1.attn.qkv", "blocks.1.attn.scores", "blocks.1.attn.mix", "blocks.0.mlp.fc", "head"):
        assert n in names
    with pytest.raises(ConfigError, match="model.n_head"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ConfigError, match="model.seq_len"):
        GPT(SMALL)(torch.zeros(1, 40, dtype=torch.long))


def test_separate_q_k_v_projections_are_the_fused_one_split_by_output():
    """``fused_qkv=False`` (the model tensor parallelism splits into heads): ``wq, wk, wv`` in place
    of ``qkv``, and the same function of the same weights."""
    torch.manual_seed(0)
    fused = GPT(SMALL)
    split = GPT(dataclasses.replace(SMALL, fused_qkv=False))
    names = dict(split.named_modules())
    assert all(f"blocks.1.attn.{w}" in names for w in ("wq", "wk", "wv")) and "blocks.1.attn.qkv" not in names
    state = {}
    for name, value in fused.state_dict().items():
        if ".attn.qkv." in name:  # the fused output is q, then k, then v
            state.update({name.replace("qkv", w): part for w, part in zip(("wq", "wk", "wv"), value.chunk(3))})
        else:
            state[name] = value
    split.load_state_dict(state)
    batch = shared_corpus(1 << 18).batch(seed=0, step=0, rank=0, batch_size=2, seq_len=SMALL.seq_len)
    torch.testing.assert_close(split(batch[:, :-1]), fused(batch[:, :-1]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="model.fused_qkv"):
        GPTConfig(fused_qkv="no")


def test_corpus_is_stdlib_source_and_batches_are_a_function_of_seed_step_rank():
    c = shared_corpus(1 << 18)
    text = bytes(c.data[:20000].to(torch.uint8).tolist()).decode("utf-8", "replace")
    assert "def " in text and "import " in text
    a = c.batch(seed=1, step=5, rank=2, batch_size=3, seq_len=16)
    assert a.shape == (3, 17) and a.dtype == torch.int64
    assert torch.equal(a, c.batch(seed=1, step=5, rank=2, batch_size=3, seq_len=16))
    assert not torch.equal(a, c.batch(seed=1, step=5, rank=3, batch_size=3, seq_len=16))
    assert not torch.equal(a, c.batch(seed=1, step=6, rank=2, batch_size=3, seq_len=16))
    with pytest.raises(ConfigError, match="corpus.max_bytes"):
        Corpus(10)


def test_canary_names_an_unhealthy_rank_that_no_statistic_shows():
    """Noise of 1e-4 on one rank's block outputs moves no statistic (see the fault-visibility
    notes) but the canary output of that replica differs bit-wise from every other's."""

    local = MemoryBus()
    fault = FaultSpec.from_dict(
        {
            "kind": "noise",
            "rank": 1,
            "step": 10,
            "duration": 0,
            "target": "blocks.*",
            "where": "output",
            "magnitude": 1e-4,
            "seed": 3,
        }
    )
    _trained_into(local, "c", fault, 21)
    canary = {(r.step, r.rank): r.fingerprints["canary_fp"] for r in local.records() if "canary_fp" in r.fingerprints}
    assert sorted({s for s, _ in canary}) == [0, 10, 20]
    assert len({canary[(0, r)] for r in range(4)}) == 1  # healthy: bit-identical on every replica
    for step in (10, 20):
        values = [canary[(step, r)] for r in range(4)]
        assert values[0] == values[2] == values[3] != values[1]


@pytest.mark.parametrize("target", ["blocks.0.mlp.fc", "blocks.1.attn.mix"])
def test_near_inf_outside_the_attention_logits_shows_in_act_max_on_its_rank_only(target):
    from sdcwatch.service.pipeline import DetectionPipeline

    local = MemoryBus()
    fault = FaultSpec.from_dict({"kind": "near_inf", "rank": 2, "step": 5, "target": target, "seed": 1})
    _trained_into(local, "ni", fault, 7)
    recs = local.records()
    at = {(r.step, r.rank): r.scalars["act_max"] for r in recs if not is_end_marker(r)}
    assert at[(5, 2)] >= 1e10
    assert all(at[(5, r)] < 1e10 for r in (0, 1, 3)) and all(at[(4, r)] < 1e10 for r in range(4))
    pipeline = DetectionPipeline()
    events = pipeline.process(recs) + pipeline.flush()
    opened = [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]
    assert [(i.first_step, i.ranks) for i in opened] == [(5, (2,))]


def test_every_virtual_rank_reports_every_step_with_all_fields_and_identity():
    run = _run(
        ranks_per_host=2,
        emitter_factory=lambda rank, host: Emitter(MemoryTransport(bus), run="sim", rank=rank, world=4, host=host),
    )
    losses = run.train(3)
    run.close()
    recs = bus.records()
    # close() ends each rank with its end-of-run marker at its last step
    assert sorted((r.step, r.rank) for r in recs if is_end_marker(r)) == [(2, r) for r in range(4)]
    recs = [r for r in recs if not is_end_marker(r)]
    assert sorted((r.step, r.rank) for r in recs) == [(s, r) for s in range(3) for r in range(4)]
    assert {r.host for r in recs if r.rank in (2, 3)} == {"node1"}
    for r in recs:
        assert {
            "loss",
            "loss_global",
            "grad_norm_local",
            "grad_norm_global",
            "grad_cosine",
            "nonfinite",
            "act_max",
            "step_time",
            "lr",
        } <= set(r.scalars)
        # attention statistics, the residual stream and the products' outputs every step, the
        # checksums on every 16th step
        assert set(r.layers) == set(LAYER_METRICS) | set(STREAM_METRICS) | {"gemm_out"} | (
            set(GEMM_METRICS) if r.step == 0 else set()
        )
        assert all(len(r.layers[m]) == SMALL.n_layer for m in LAYER_METRICS + STREAM_METRICS)
        assert set(r.fingerprints) == ({"grad_fp", "param_fp", "canary_fp"} if r.step == 0 else set()) | {
            "gemm_canary_fp"  # every step, one product in rotation
        }
    assert losses[0] == pytest.approx(sum(r.scalars["loss"] for r in recs if r.step == 0) / 4, rel=1e-6)


bus = MemoryBus()


def test_gradients_are_averaged_like_an_all_reduce_and_probes_match_brute_force():
    run = _run(world=3, clip=None)
    twin = GPT(SMALL)
    twin.load_state_dict(run.model.state_dict())
    local = []
    for r in range(3):
        twin.zero_grad()
        batch = run.corpus.batch(seed=0, step=0, rank=r, batch_size=4, seq_len=SMALL.seq_len)
        twin.loss(batch).backward()
        local.append(torch.cat([p.grad.reshape(-1) for p in twin.parameters()]))
    mean = torch.stack(local).mean(0)
    run.train(1)
    run.close()
    assert torch.allclose(torch.cat([p.grad.reshape(-1) for p in run.model.parameters()]), mean, atol=1e-7)
    for r in range(3):
        s = run.emitters[r].records[0]["scalars"]
        assert s["grad_norm_local"] == pytest.approx(float(local[r].norm()), rel=1e-5)
        assert s["grad_norm_global"] == pytest.approx(float(mean.norm()), rel=1e-5)
        cos = float(local[r] @ mean / (local[r].norm() * mean.norm()))
        assert s["grad_cosine"] == pytest.approx(cos, rel=1e-5)
    assert run.emitters[0].records[0]["fingerprints"]["grad_fp"] == fingerprint(mean)


def test_checkpoint_branches_a_faulted_run_and_its_clean_twin_from_the_same_state(tmp_path):
    base = _run()
    base.train(2)
    ck = tmp_path / "ck.pt"
    base.save_checkpoint(ck)
    base.close()
    fault = FaultSpec(kind="bitflip", rank=2, step=3, target="blocks.1.attn.qkv", bit=30, seed=6)
    clean, faulted = _run(), _run(faults=[fault])
    for run in (clean, faulted):
        run.load_checkpoint(ck)
        assert run.step == 2
        run.train(3)
        run.close()

    def scalars(run, rank, step):
        return run.emitters[rank].records[step]["scalars"]

    for r in range(4):  # step 2: identical; step 3: only rank 2's own forward differs
        assert scalars(clean, r, 2)["loss"] == scalars(faulted, r, 2)["loss"]
        same = scalars(clean, r, 3)["loss"] == scalars(faulted, r, 3)["loss"]
        assert same == (r != 2)
    (hit,) = faulted.injector.injections
    assert (hit.step, hit.rank, hit.target) == (3, 2, "blocks.1.attn.qkv")
    part = ("q", "k", "v")[(hit.index % (3 * SMALL.d_model)) // SMALL.d_model]
    layers = faulted.emitters[2].records[3]["layers"]
    if part != "v":  # exponent bit 30 of a value below 2 makes it ~1e38: q or k norm and logits explode
        assert not layers[f"{part}_norm_max"][1] < 1e30
        assert not layers["attn_logit_max"][1] < 1e30
    assert layers["attn_logit_max"][0] == clean.emitters[2].records[3]["layers"]["attn_logit_max"][0]
    assert all(scalars(faulted, r, 3)["nonfinite"] == 0 for r in (0, 1, 3))
    with pytest.raises(ConfigError, match="checkpoint.world"):
        _run(world=2).load_checkpoint(ck)


def test_param_fault_and_rank_lr_spike_make_exactly_that_replica_diverge():
    faults = [
        FaultSpec(kind="bitflip", rank=1, step=1, target="blocks.0.mlp.fc", where="param", bit=20, seed=2),
        FaultSpec(kind="lr_spike", rank=3, step=2, magnitude=10.0),
    ]
    from sdcwatch.telemetry.probes.config import ProbeConfig

    run = _run(faults=faults, probes=ProbeConfig(fingerprint_every=1))
    run.train(4)
    run.close()

    def odd(step):
        fps = [run.emitters[r].records[step]["fingerprints"]["param_fp"] for r in range(4)]
        majority = max(set(fps), key=fps.count)
        return [r for r, f in enumerate(fps) if f != majority]

    assert odd(0) == []
    assert odd(1) == [1]
    assert odd(2) == [1, 3]
    assert odd(3) == [1, 3]
    grad_fps = {run.emitters[r].records[3]["fingerprints"]["grad_fp"] for r in range(4)}
    assert len(grad_fps) == 1  # the all-reduced gradient is one for everybody
    assert run.emitters[3].records[2]["scalars"]["lr"] == pytest.approx(10 * run.lr)
    for r in (0, 1):
        flat = torch.cat([p.reshape(-1) for p in run.replica_parameters(r)])
        assert fingerprint(flat) == run.emitters[r].records[3]["fingerprints"]["param_fp"]


def test_unhealthy_rank_with_scaled_attention_stands_out_in_its_qk_norms():
    fault = FaultSpec(kind="scale", rank=1, step=0, duration=0, target="blocks.*.attn.qkv", magnitude=1.1)
    run = _run(faults=[fault])
    run.train(4)
    run.close()
    for step in range(4):
        q = [run.emitters[r].records[step]["layers"]["q_norm_mean"][0] for r in range(4)]
        others = [q[r] for r in (0, 2, 3)]
        assert q[1] > 1.05 * max(others)


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="simulated.world"):
        SimulatedRun(world=0)
    with pytest.raises(ConfigError, match="simulated.faults"):
        _run(world=2, faults=[FaultSpec(kind="nan", rank=5, step=0, target="head")])
    with pytest.raises(ConfigError, match="simulated.hosts"):
        _run(world=2, hosts=["a"])
    assert math.isfinite(_run(world=1).train(1)[0])


def test_skip_nonfinite_keeps_replicas_finite_after_a_nan():
    fault = FaultSpec(kind="nan", rank=1, step=2, target="blocks.1.attn.scores")
    poisoned, guarded = _run(faults=[fault]), _run(faults=[fault], skip_nonfinite=True)
    for run in (poisoned, guarded):
        run.train(4)
        run.close()
    assert guarded.skipped == [2] and poisoned.skipped == []
    assert math.isnan(guarded.history[2]) and math.isfinite(guarded.history[3])
    assert math.isnan(poisoned.history[3])  # the NaN update reached every replica
