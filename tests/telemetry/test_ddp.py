"""Real torch.distributed DDP (gloo, world 4) with probes, a fault, and records through a real broker."""

from __future__ import annotations

import uuid

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.vocabulary import GEMM_METRICS, STREAM_METRICS  # noqa: E402
from sdcwatch.telemetry import FINGERPRINTS, LAYER_METRICS, is_end_marker  # noqa: E402
from sdcwatch.testbed.ddp import DDPSettings, launch  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from reference_loop import step0_gradients  # noqa: E402

pytestmark = pytest.mark.integration

WORLD, STEPS, FLIP_RANK, FLIP_STEP = 4, 6, 2, 3
EXPECTED_SCALARS = {
    "loss",
    "loss_global",
    "grad_norm_local",
    "grad_norm_global",
    "grad_cosine",
    "nonfinite",
    "step_time",
    "lr",
    "emitter_dropped",
}


@pytest.fixture(scope="module")
def ddp_records(broker, consume):
    if not broker.running:
        broker.start()
    topic = f"ddp.{uuid.uuid4().hex[:8]}"
    settings = DDPSettings(
        world=WORLD,
        steps=STEPS,
        seed=0,
        run="ddp-it",
        bootstrap=broker.bootstrap,
        topic=topic,
        probes={"fingerprint_every": 1, "attention_every": 1},
        ranks_per_host=2,
        corpus_bytes=1 << 18,
        faults=(
            FaultSpec(
                kind="bitflip",
                rank=FLIP_RANK,
                step=FLIP_STEP,
                target="blocks.0.attn.qkv",
                where="param",
                bit=12,
                seed=1,
            ),
        ),
    )
    launch(settings)
    got, src = consume(broker.bootstrap, topic, WORLD * STEPS + WORLD)
    assert src.dead_letters == 0
    # each rank's close() ends its part of the run with an end-of-run marker at its last step
    assert sorted((r.step, r.rank) for r in got if is_end_marker(r)) == [(STEPS - 1, r) for r in range(WORLD)]
    return settings, [r for r in got if not is_end_marker(r)]


def _by_step_rank(records):
    return {(r.step, r.rank): r for r in records}


def test_every_rank_reports_every_step_with_all_fields(ddp_records):
    settings, records = ddp_records
    table = _by_step_rank(records)
    assert len(records) == len(table) == WORLD * STEPS
    assert set(table) == {(s, r) for s in range(STEPS) for r in range(WORLD)}
    for (step, rank), rec in table.items():
        assert rec.run == "ddp-it" and rec.world == WORLD and rec.host == f"node{rank // 2}"
        assert EXPECTED_SCALARS <= set(rec.scalars), (step, rank, set(rec.scalars))
        # attention statistics, the residual stream and the products' outputs every step, the
        # checksums on every 16th step
        checked = step % 16 == 0
        assert set(rec.layers) == set(LAYER_METRICS) | set(STREAM_METRICS) | {"gemm_out"} | (
            set(GEMM_METRICS) if checked else set()
        )
        assert all(len(rec.layers[m]) == 2 for m in LAYER_METRICS + STREAM_METRICS)
        if checked:  # the forward, weight-gradient and weight checks hold under DDP's bucketed all-reduce
            assert max(max(rec.layers[m]) for m in ("gemm_fwd", "gemm_bwd", "gemm_weight")) < 1
        assert set(rec.fingerprints) == set(FINGERPRINTS)
        assert rec.scalars["nonfinite"] == 0


def test_fingerprints_agree_on_clean_replicas_and_name_exactly_the_flipped_rank(ddp_records):
    _, records = ddp_records
    table = _by_step_rank(records)
    for step in range(STEPS):
        params = [table[step, r].fingerprints["param_fp"] for r in range(WORLD)]
        grads = {table[step, r].fingerprints["grad_fp"] for r in range(WORLD)}
        assert len(grads) == 1, step  # the all-reduced gradient is bit-identical everywhere
        if step < FLIP_STEP:
            assert len(set(params)) == 1, step
        else:
            odd = [r for r in range(WORLD) if params.count(params[r]) == 1]
            assert odd == [FLIP_RANK], step
        norms = {table[step, r].scalars["grad_norm_global"] for r in range(WORLD)}
        assert len(norms) == 1


def test_comm_hook_norms_and_cosine_match_brute_force(ddp_records):
    settings, records = ddp_records
    table = _by_step_rank(records)
    local = [torch.cat([g.reshape(-1) for g in grads]) for grads in step0_gradients(settings, WORLD)]
    mean = torch.stack(local).mean(0)
    for r in range(WORLD):
        s = table[0, r].scalars
        cos = float(local[r] @ mean / (local[r].norm() * mean.norm()))
        assert s["grad_norm_local"] == pytest.approx(float(local[r].norm()), rel=1e-4)
        assert s["grad_norm_global"] == pytest.approx(float(mean.norm()), rel=1e-4)
        assert s["grad_cosine"] == pytest.approx(cos, rel=1e-4)
    assert {round(table[0, r].scalars["loss_global"], 5) for r in range(WORLD)} == {
        round(sum(table[0, r].scalars["loss"] for r in range(WORLD)) / WORLD, 5)
    }


def run_with_a_nan(tmp_path, world, steps, nan_step, **settings):
    """Real DDP ranks (fingerprints every step) writing JSON lines to ``tmp_path``, with a NaN in
    rank 1's attention scores at ``nan_step``; every rank's records, end markers included."""
    from sdcwatch.service.offline import read_records

    launch(
        DDPSettings(
            world=world,
            steps=steps,
            seed=0,
            jsonl_dir=str(tmp_path),
            corpus_bytes=1 << 18,
            probes={"fingerprint_every": 1},
            faults=(
                FaultSpec(
                    kind="nan", rank=1, step=nan_step, duration=1, target="blocks.0.attn.scores", where="output", seed=1
                ),
            ),
            **settings,
        )
    )
    return [r for rank in range(world) for r in read_records(tmp_path / f"rank{rank}.jsonl")]


@pytest.mark.parametrize("skip", [False, True], ids=["plain", "skip_nonfinite"])
def test_skip_nonfinite_keeps_every_replica_finite_after_a_nan(tmp_path, skip):
    """A NaN in one rank's attention reaches every replica through the all-reduce; skipping that
    update keeps the replicas finite and identical, and the next steps train on."""
    world, steps, nan_step = 2, 5, 2
    records = run_with_a_nan(tmp_path, world, steps, nan_step, run="ddp-skip", skip_nonfinite=skip)
    # each rank's file ends with its end-of-run marker at its last step
    assert sorted((r.step, r.rank) for r in records if is_end_marker(r)) == [(steps - 1, r) for r in range(world)]
    table = {(r.step, r.rank): r for r in records if not is_end_marker(r)}
    assert set(table) == {(s, r) for s in range(steps) for r in range(world)}
    assert table[nan_step, 1].scalars["nonfinite"] > 0  # the fault happened
    later = [table[s, r] for s in range(nan_step + 1, steps) for r in range(world)]
    finite = [bool(torch.isfinite(torch.tensor(rec.scalars["loss"]))) for rec in later]
    if skip:
        assert all(finite) and all(rec.scalars["nonfinite"] == 0 for rec in later)
        for s in range(steps):
            assert table[s, 0].fingerprints["param_fp"] == table[s, 1].fingerprints["param_fp"], s
    else:
        assert not any(finite)  # without the skip, every replica is poisoned from the next step on


@pytest.mark.parametrize("on_nonfinite,action", [("skip", 1.0), ("rerun", 2.0)])
def test_guard_nan_on_one_rank_is_handled_on_every_rank_and_replicas_agree(tmp_path, on_nonfinite, action):
    """The guard over real gloo processes: a NaN on rank 1 at step 3 is skipped (or rerun as the
    transient fault it is) on every rank at that step, training continues, the replicas agree."""
    world, steps, nan_step = 3, 6, 3
    records = run_with_a_nan(
        tmp_path, world, steps, nan_step, run="ddp-guard", guard={"mode": "act", "on_nonfinite": on_nonfinite}
    )
    table = {(r.step, r.rank): r for r in records if not is_end_marker(r)}
    assert set(table) == {(s, r) for s in range(steps) for r in range(world)}
    for r in range(world):  # every rank took the same action at the same step, and only there
        acted = [s for s in range(steps) if "guard_action" in table[s, r].scalars]
        assert acted == [nan_step], (r, acted)
        rec = table[nan_step, r].scalars
        assert (rec["guard_action"], rec["guard_reason"], rec["guard_rank"]) == (action, 1.0, 1.0)
    for s in range(nan_step + 1, steps):
        assert all(torch.isfinite(torch.tensor(table[s, r].scalars["loss"])) for r in range(world))
    for s in range(steps):
        assert len({table[s, r].fingerprints["param_fp"] for r in range(world)}) == 1, s


def test_guard_evicts_a_rank_whose_fault_persists_with_the_documented_exit_code(tmp_path, capfd):
    from torch.multiprocessing import ProcessExitedException

    settings = DDPSettings(
        world=2,
        steps=30,
        seed=0,
        run="ddp-evict",
        jsonl_dir=str(tmp_path),
        corpus_bytes=1 << 18,
        ranks_per_host=1,
        guard={"mode": "act"},
        faults=(FaultSpec(kind="scale", rank=1, step=25, duration=0, target="head", magnitude=30.0, seed=0),),
    )
    with pytest.raises(ProcessExitedException) as info:
        launch(settings)
    assert info.value.exit_code == 16
    err = capfd.readouterr().err
    assert "evicting rank 1 (host node1) at step 25" in err
