"""The clean-steps measurement: long fault-free runs through the campaign's detectors, alarms counted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.testbed.campaign.clean_run import (  # noqa: E402
    LISTED,
    WARMUP_REGION,
    CleanRunConfig,
    listed_alarms,
    run_clean,
    run_one_seed,
    summarise_clean,
)
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402

from sdcwatch.testbed.campaign.cli import clean_main  # noqa: E402


@pytest.mark.slow
@pytest.mark.bench
def test_clean_runs_over_two_workers_count_every_step_and_raise_nothing(tmp_path, capfd):
    out = tmp_path / "clean.json"
    result = clean_main(
        "--steps 301 --runs 2 --workers 2 --ranks 4 --detectors sdcwatch megatron --out".split() + [str(out)]
    )
    written = json.loads(out.read_text())
    assert written["summary"] == result["summary"] and written["complete"] is True
    runs = {r["seed"]: r for r in result["runs"]}
    assert set(runs) == {0, 1} and runs[0]["steps"] == 151 and runs[1]["steps"] == 150
    for r in runs.values():  # every step of every run became one complete frame, from step 0
        assert r["clean_steps"] == r["steps"] and r["incomplete_frames"] == 0
        assert r["loss_last"] < r["loss_first"]  # it trained
    assert result["summary"]["sdcwatch"]["clean_steps"] == 301
    assert set(result["summary"]) == {"sdcwatch", "megatron"}
    for name, s in result["summary"].items():
        assert s["false_alarms"] == 0 and s["by_kind"] == {}, (name, [r["alarms"] for r in result["runs"]])
    assert result["target"]["met"] is False  # 301 steps are not the 10,000 the target asks for
    captured = capfd.readouterr()
    assert "| sdcwatch | 301 | 0 |" in captured.out
    assert "clean: seed 1: 150 steps in" in captured.err  # the workers' progress


@pytest.mark.slow
def test_an_injected_fault_is_counted_with_its_step_rank_and_region():
    """The positive control: the same run with a NaN on rank 2 at step 60 is one alarm, counted there."""
    config = CleanRunConfig(steps=80, runs=1, workers=1, world=4, detectors=("sdcwatch",))
    nan = FaultSpec(kind="nan", rank=2, step=60, target="blocks.0.mlp.fc")
    run = run_one_seed(config, 0, 80, None, faults=[nan])
    assert run["clean_steps"] == 80
    first = min(run["alarms"], key=lambda a: a["step"])
    assert first["step"] == 60 and first["ranks"] == [2] and first["attribution"] == "sdc"
    assert len(first["loss_by_rank"]) == 4 and first["frame_step"] >= 60 and "loss_excess" in first
    summary = summarise_clean([run], ["sdcwatch"])["sdcwatch"]
    assert summary["false_alarms"] == len(run["alarms"]) >= 1
    assert summary["in_warmup_region"] == summary["false_alarms"]  # step 60 < WARMUP_REGION
    assert summary["blamed_a_rank"] >= 1 and sum(summary["by_kind"].values()) == summary["false_alarms"]


def test_each_finished_run_is_handed_over_with_the_counts_so_far():
    seen = []
    config = CleanRunConfig(steps=41, runs=2, workers=1, world=2, detectors=("sdcwatch",))
    result = run_clean(config, progress=None, on_run=lambda r: seen.append(r))
    assert [(r["complete"], [x["seed"] for x in r["runs"]]) for r in seen] == [(False, [0]), (True, [0, 1])]
    assert [r["summary"]["sdcwatch"]["clean_steps"] for r in seen] == [21, 41]
    assert result == seen[-1] and result["target"]["count"] == "0 in 41"


def test_counting_by_kind_region_and_blame():
    def alarm(step, kind, attribution):
        return {"detector": "sdcwatch", "step": step, "kind": kind, "attribution": attribution}

    noisy = [{**alarm(s, "grad_spike", None), "detector": "zclip"} for s in range(200, 200 + LISTED + 5)]
    runs = [
        {"clean_steps": 1500, **listed_alarms([alarm(10, "loss_spike", "optimisation_data")])},
        {
            "clean_steps": 500,
            **listed_alarms([alarm(WARMUP_REGION, "loss_spike", None), *noisy, alarm(400, "checksum", "sdc")]),
        },
    ]
    assert len(runs[1]["alarms"]) == 2 + LISTED  # every sdcwatch alarm listed, the baseline's first LISTED
    s = summarise_clean(runs, ["sdcwatch", "zclip"])
    assert s["sdcwatch"] == {
        "clean_steps": 2000,
        "false_alarms": 3,
        "by_kind": {"loss_spike": 2, "checksum": 1},
        "in_warmup_region": 1,
        "blamed_a_rank": 1,
        "per_1k_clean_steps": 1.5,
    }
    assert s["zclip"]["false_alarms"] == LISTED + 5 and s["zclip"]["by_kind"] == {"grad_spike": LISTED + 5}
    assert summarise_clean(runs, ["megatron"])["megatron"]["false_alarms"] == 0


@pytest.mark.parametrize(
    "options, said",
    [
        (dict(steps=3, runs=4), "clean.runs"),
        (dict(workers=0), "clean.workers"),
        (dict(probes="no-such-preset"), "probes"),
        (dict(parallel="tp=2,ep=2"), "ep"),
        (dict(detectors=("sdcwatch", "nope")), "nope"),
    ],
)
def test_bad_settings_are_refused_by_name(options, said):
    with pytest.raises(ConfigError, match=said):
        CleanRunConfig(**options)


def test_plan_splits_the_steps_over_consecutive_seeds():
    assert CleanRunConfig(steps=10, runs=3, seed=5).plan() == [(5, 4), (6, 3), (7, 3)]


@pytest.mark.slow
@pytest.mark.bench
def test_a_3d_layout_runs_clean_with_every_rank_in_every_frame():
    config = CleanRunConfig(steps=80, runs=1, workers=1, parallel="tp=2,pp=2,dp=2", detectors=("sdcwatch",))
    run = run_one_seed(config, 3, 80, None)
    assert config.campaign_config(3).world == 8
    assert run["clean_steps"] == 80 and run["incomplete_frames"] == 0
    assert run["alarms"] == []
