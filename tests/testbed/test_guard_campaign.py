"""The guard campaign's spike-mitigation arm and its long clean guarded run (the whole loop closed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.core.spike_baseline import SeriesSettings  # noqa: E402
from sdcwatch.telemetry.guard.config import GuardConfig  # noqa: E402
from sdcwatch.testbed.campaign.branches import frames_of, new_run  # noqa: E402
from sdcwatch.testbed.campaign.run import CampaignConfig, run_campaign  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from sdcwatch.testbed.campaign.fault_classes import FAULT_CLASSES  # noqa: E402
from sdcwatch.testbed.campaign.guarded import (  # noqa: E402
    EXPECTED_VERDICT,
    campaign_guard_config,
    guard_table,
    run_clean_guarded,
)
from sdcwatch.testbed.campaign.scoring import SdcwatchRunner, alarms_of  # noqa: E402

SMALL = CampaignConfig(world=2, trials=1, pretrain_steps=40, branch_steps=14, fault_offset=(3, 3))


def test_every_fault_class_has_the_verdict_a_rerun_should_reach():
    assert set(EXPECTED_VERDICT) == set(FAULT_CLASSES)  # a class without one scores its right verdict as wrong
    assert EXPECTED_VERDICT["nonfinite_stream"] == "transient" and EXPECTED_VERDICT["bitflip_container"] == "transient"
    assert EXPECTED_VERDICT["param_bitflip_mantissa"] == "persistent"  # a flipped weight stays flipped


def test_the_mitigation_arm_reruns_a_spike_guarded_with_the_mitigation_on_and_summarises_it():
    bad = FaultSpec(kind="bad_batch", step=6, rank=None, duration=1, seed=3)
    result = run_campaign(SMALL, [bad], detectors=["sdcwatch"], progress=None, guard=True, mitigations=("lr+clip",))
    g = result["trials"][0]["guard"]
    assert [a["action"] for a in g["actions"]] == ["skip"] and "mitigation" not in g["actions"][0]  # default: none
    arm = g["mitigated"]["lr+clip"]
    assert arm["mitigations"] == 1 and arm["finished"]
    (act,) = [a for a in arm["actions"] if a.get("mitigation")]
    assert act["mitigation"] == "lr+clip" and act["lr_factor"] == 0.5 and act["action"] == "skip"
    assert isinstance(arm["final_excess"], float) and arm["final_excess"] != g["final_excess"]["guarded"]
    s = result["guard_summary"]["bad_batch_all"]["mitigated"]["lr+clip"]
    assert s["trials"] == 1 and s["mitigations"] == 1 and s["rollbacks_evictions"] == 0
    assert s["better"] + s["worse"] == 1
    assert result["config"]["guard_mitigations"] == ["lr+clip"]
    assert "| bad_batch_all | lr+clip | 1 |" in guard_table(result)


def test_the_mitigation_arm_needs_the_guard_and_a_known_mitigation():
    with pytest.raises(ConfigError, match="campaign.mitigations"):
        run_campaign(SMALL, [], progress=None, mitigations=("lr",))
    with pytest.raises(ConfigError, match="campaign.mitigations"):
        run_campaign(SMALL, [], progress=None, guard=True, mitigations=("halve",))


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """The campaign's checkpoint (the guard's baselines learnt in report mode) and a warmed-up loop."""
    path = Path(tmp_path_factory.mktemp("guard-clean")) / "checkpoint.pt"
    records: list = []
    run = new_run(SMALL, (), records, "campaign", guard=GuardConfig())
    try:
        run.train(SMALL.pretrain_steps)
        run.save_checkpoint(path)
    finally:
        run.close()
    runner = SdcwatchRunner()
    alarms_of(runner, frames_of(records, SMALL.world))
    return path, runner


def test_a_long_clean_guarded_run_detects_every_step_and_counts_no_action(warm):
    path, runner = warm
    seen = []
    state = run_clean_guarded(SMALL, path, 7, runner, 30, chunk=10, progress=seen.append)
    assert [s["steps"] for s in seen] == [10, 20, 30]
    assert state["steps"] == 30 and state["frames_detected"] == 30  # every step went through the pipeline
    assert state["actions"] == 0 and state["reported_only"] == 0 and state["evictions"] == []
    assert state["last_loss"] < state["checkpoint_loss"] * 1.5


def test_a_clean_guarded_run_counts_the_actions_of_a_guard_that_acts(warm):
    path, runner = warm
    every = SeriesSettings(z_on=1e-6, min_ratio=1 + 1e-6, z_off=1e-7)
    jumpy = replace(campaign_guard_config(), loss=every, grad_norm=every, window=2, warmup=1)
    state = run_clean_guarded(SMALL, path, 7, runner, 12, guard=jumpy)
    assert state["actions"] > 0 and state["action_list"][0]["reason"] == "spike"
