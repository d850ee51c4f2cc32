"""A fault's detectability is its own: the bound of the checksum covering the tensor it hit, taken
when it is injected, on a step the probes check or not (testbed.fault_bounds, campaign.fault_visibility)."""

from __future__ import annotations

import pytest
import torch
from sdcwatch.telemetry.probes.checksum_bounds import check_linear, check_matmul, check_weight_grad
from sdcwatch.telemetry.probes.config import ProbeConfig
from sdcwatch.testbed.campaign.run import CampaignConfig, run_campaign
from sdcwatch.testbed.fault_bounds import CoveredInjection, linear_bound, matmul_bound, weight_grad_bound
from sdcwatch.testbed.faultspec import FaultSpec
from sdcwatch.testbed.simulated import SimulatedRun

STEP = 3


def _fault(**kw) -> FaultSpec:
    return FaultSpec.from_dict({"kind": "bitflip", "step": STEP, "bit": 25, **kw})


def test_an_element_changed_by_twice_the_bound_breaks_the_check_it_bounds():
    """The bound functions are the checks' own: a change of 2x the bound leaves a residual above it."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(64, 32, generator=g), torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    y = torch.nn.functional.linear(x, w, b)
    assert float(check_linear(x, w, y, b)) <= 1
    bad = y.clone()
    bad[5, 7] += 2 * linear_bound(x, w, b, y.dtype)
    assert float(check_linear(x, w, bad, b)) > 1
    a, v = torch.softmax(torch.randn(2, 16, 16, generator=g), -1), torch.randn(2, 16, 8, generator=g)
    c = a @ v
    bad = c.clone()
    bad[1, 3, 2] -= 2 * matmul_bound(a, v, c.dtype)
    assert float(check_matmul(a, v, c)) <= 1 < float(check_matmul(a, v, bad))
    dy = torch.randn(64, 48, generator=g)
    dw = dy.T @ x
    bad = dw.clone()
    bad[3, 4] += 2 * weight_grad_bound(x, dy, dw)
    assert float(check_weight_grad(x, dy, dw)) <= 1 < float(check_weight_grad(x, dy, bad))


def test_the_bound_taken_at_injection_is_the_one_the_check_holds_the_tensor_to():
    """Every check a fault can meet, on a checked step: the injection's bound equals the bound the
    probes' own check used for that tensor at that step, on that rank."""
    torch.set_num_threads(1)
    faults = [
        _fault(rank=1, seed=1, where="output", target="blocks.0.mlp.fc"),  # a linear layer's output
        _fault(rank=0, seed=2, where="output", target="blocks.1.attn.mix"),  # probs @ v
        _fault(rank=1, seed=3, where="grad", target="blocks.0.attn.proj"),
        _fault(rank=1, seed=1, where="grad", target="blocks.1.mlp.fc"),
        _fault(rank=0, seed=1, where="param", target="blocks.1.mlp.proj"),
        _fault(rank=1, seed=2, where="param", target="blocks.1.mlp.fc"),
        _fault(rank=0, seed=6, where="output", target="blocks.1"),  # a block's output: no checksum
    ]
    run = SimulatedRun(2, seed=0, faults=faults, batch_size=2, probes=ProbeConfig(checksum_every=1), fault_bounds=True)
    for w in run.watches:
        w.checksums.keep_bounds = True
    kept: dict[int, dict] = {}

    def keep(step: int, run: SimulatedRun) -> None:
        for r, w in enumerate(run.watches):
            if step == STEP:
                kept[r] = {k: float(v) for k, v in w.checksums.bounds.items()}
            w.checksums.bounds.clear()

    try:
        run.train(STEP + 1, on_step=keep)
        injections = list(run.injector.injections)
    finally:
        run.close()
    assert len(injections) == len(faults)
    assert all(isinstance(i, CoveredInjection) for i in injections)
    checks = {}
    for inj in injections:
        if inj.target == "blocks.1":
            assert inj.check is None and inj.bound is None
            continue
        checks[(inj.where, inj.target)] = inj.check
        assert inj.bound > 0
        assert inj.bound == pytest.approx(kept[inj.rank][(inj.check, inj.target)], rel=1e-6), inj
    assert checks == {  # the seeds above hit a weight's and a bias's gradient, a weight and a bias
        ("output", "blocks.0.mlp.fc"): "gemm_fwd",
        ("output", "blocks.1.attn.mix"): "gemm_fwd",
        ("grad", "blocks.0.attn.proj.weight"): "gemm_bwd",
        ("grad", "blocks.1.mlp.fc.bias"): "gemm_bwd",
        ("param", "blocks.1.mlp.proj.weight"): "gemm_weight",
        ("param", "blocks.1.mlp.fc.bias"): "gemm_weight",
    }


def test_the_training_injector_keeps_no_bound():
    """The bound costs the campaign only: a run without ``fault_bounds`` records plain injections."""
    run = SimulatedRun(
        2, seed=0, faults=[_fault(rank=0, seed=1, where="output", target="blocks.0.mlp.fc")], batch_size=1
    )
    try:
        run.train(STEP + 1)
        (inj,) = run.injector.injections
    finally:
        run.close()
    assert not isinstance(inj, CoveredInjection) and not hasattr(inj, "bound")


def _two_flips(rank: int) -> list[FaultSpec]:
    """Two one-off flips in ``blocks.0.mlp.fc``'s output on ``rank`` at branch step 1: a x2 or /2
    change of one element (above the checksum's bound), and its lowest mantissa bit (below)."""
    return [
        FaultSpec.from_dict(
            {
                "kind": "bitflip",
                "rank": rank,
                "step": 1,
                "seed": seed,
                "bit": bit,
                "where": "output",
                "target": "blocks.0.mlp.fc",
            }
        )
        for seed, bit in ((6, 23), (2, 0))
    ]


def _campaign(probes: str) -> dict:
    # branch step 1 after 4 steps: step 5, which the default's checksums (every 16th step) skip
    faults = _two_flips(rank=1)
    config = CampaignConfig(
        world=2, pretrain_steps=4, branch_steps=4, batch_size=2, window=4, fault_offset=(0, 1), probes=probes
    )
    return run_campaign(config, faults, detectors=["sdcwatch"], progress=None)


@pytest.fixture(scope="module")
def flips_at_default_and_checksums() -> tuple[dict, dict]:
    torch.set_num_threads(1)
    return _campaign("default"), _campaign("checksums")


def test_a_flip_on_an_unchecked_step_is_detectable_when_its_change_exceeds_the_bound(flips_at_default_and_checksums):
    default, checksums = flips_at_default_and_checksums
    step = default["trials"][0]["fault_step"]
    assert step % ProbeConfig().checksum_every != 0  # the default does not check the fault's step
    above, below = (t["visibility"] for t in default["trials"])
    assert above["check"] == below["check"] == "gemm_fwd"
    assert above["change"] > above["bound"] and above["detectable"] is True
    assert below["change"] < below["bound"] and below["detectable"] is False
    # a property of the fault alone: the same under another probe configuration
    assert [t["visibility"] for t in checksums["trials"]] == [above, below]


def test_recall_over_detectable_flips_counts_the_one_the_default_misses_at_its_step(flips_at_default_and_checksums):
    default, checksums = flips_at_default_and_checksums
    missed = default["trials"][0]["detectors"]["sdcwatch"]
    assert missed["delay"] != 0  # a x2 change of one element on an unchecked step: nothing sees it then
    at_default = default["summary"]["all"]["sdcwatch"]
    assert (at_default["detectable"], at_default["recall_detectable"]) == (1, 0.0)
    row = next(t for t in default["targets"] if t["target"].startswith("detectable flips"))
    assert (row["count"], row["met"]) == ("0/1", False)
    # the checksums on every step catch it at its step, on its rank: the same denominator, comparable
    caught = checksums["trials"][0]["detectors"]["sdcwatch"]
    assert (caught["delay"], caught["localized_rank"]) == (0, 1)
    at_checksums = checksums["summary"]["all"]["sdcwatch"]
    assert (at_checksums["detectable"], at_checksums["recall_detectable"]) == (1, 1.0)


# -- under a tensor x pipeline x data parallel layout ---------------------------------------------


def test_a_campaign_under_a_layout_counts_the_flips_above_the_bound_of_the_culprit_share():
    """The same definition under ``tp x pp x dp``: a flip is detectable when its change exceeds the
    bound of the check of the culprit's share of the tensor; the campaign counts them, and with the
    checksums on every step the one above its bound is caught at its step on its rank."""
    from sdcwatch.testbed.shard_plan import parse_layout, rank_at

    torch.set_num_threads(1)
    layout = parse_layout("tp=2,pp=2,dp=2")
    culprit = rank_at(layout, 1, 0, 1)  # replica 1, first stage, tensor shard 1
    faults = _two_flips(rank=culprit)
    config = CampaignConfig(
        parallel=str(layout),
        pretrain_steps=4,
        branch_steps=4,
        batch_size=2,
        window=4,
        fault_offset=(0, 1),
        probes="checksums",
    )
    result = run_campaign(config, faults, detectors=["sdcwatch"], progress=None)
    above, below = (t["visibility"] for t in result["trials"])
    assert above["check"] == below["check"] == "gemm_fwd"
    assert above["change"] > above["bound"] and above["detectable"] is True
    assert below["change"] < below["bound"] and below["detectable"] is False
    summary = result["summary"]["all"]["sdcwatch"]
    assert summary["detectable"] == 1
    caught = result["trials"][0]["detectors"]["sdcwatch"]
    assert (caught["delay"], caught["localized_rank"]) == (0, culprit)
    assert summary["recall_detectable"] == 1.0
