"""The benchmark runners stay runnable: quick campaign and quick end-to-end run, plus the baselines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sdcwatch.core.errors import ConfigError, FaultSpecError
from sdcwatch.core.record_type import Record
from sdcwatch.testbed.campaign.baselines import MegatronRules, NanLossCheck, ZClipDetector
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.testbed.campaign.run import CampaignConfig
from sdcwatch.testbed.campaign.fault_classes import BENIGN_CLASSES, FAULT_CLASSES
from sdcwatch.testbed.faultspec import parse_faults
from sdcwatch.testbed.campaign.impact import IMPACT_CLASSES
from sdcwatch.testbed.campaign.trials import generate_trials, trials_from_faults

from sdcwatch.testbed.campaign.cli import bench_main, campaign_main, e2e_main, write_markdown

DETECTORS = {"sdcwatch", "megatron", "zclip", "nan_check", "river_hst"}


def frame(step: int, loss, grad_local=None, grad_global: float = 1.0) -> StepFrame:
    loss = np.asarray(loss, float)
    grad_local = np.ones_like(loss) if grad_local is None else np.asarray(grad_local, float)
    recs = [
        Record(
            "r",
            step,
            i,
            loss.size,
            f"h{i}",
            0.0,
            0,
            {"loss": float(loss[i]), "grad_norm_local": float(grad_local[i]), "grad_norm_global": grad_global},
        )
        for i in range(loss.size)
    ]
    return StepFrame.from_records("r", step, loss.size, recs)


# -- baselines -------------------------------------------------------------------------------------


def test_megatron_fires_on_the_rank_whose_loss_reaches_ten_times_its_early_max():
    rng = np.random.default_rng(0)
    det = MegatronRules(first_n=20)
    early = [det.update(frame(s, 2 + 0.1 * rng.random(4))) for s in range(20)]
    assert not any(early)
    assert det.update(frame(20, [2.0, 2.1, 2.0, 2.05])) == []
    peak = 2.1  # every early value is below it
    found = det.update(frame(21, [2.0, 10 * peak + 1, 2.0, 2.0]))
    assert [(f.kind, f.ranks) for f in found] == [("loss_spike", (1,))]
    nan = det.update(frame(22, [2.0, 2.0, float("nan"), 2.0]))
    assert [(f.kind, f.ranks) for f in nan] == [("nonfinite", (2,))]


def test_zclip_flags_a_gradient_norm_far_above_its_ema_after_warmup_only():
    rng = np.random.default_rng(1)
    det = ZClipDetector()
    quiet = [det.update(frame(s, [2.0] * 4, grad_global=1.0 + 0.05 * rng.standard_normal())) for s in range(60)]
    assert sum(len(q) for q in quiet[:25]) == 0  # warm-up is silent
    found = det.update(frame(60, [2.0] * 4, grad_global=3.0))
    assert len(found) == 1 and found[0].kind == "grad_spike" and found[0].ranks == ()
    assert det.update(frame(61, [2.0] * 4, grad_global=float("nan"))) == []  # NaN compares false: missed


def test_nan_check_names_only_ranks_whose_loss_is_nan():
    det = NanLossCheck()
    assert det.update(frame(0, [1.0, float("inf"), 1.0])) == []
    found = det.update(frame(1, [1.0, float("nan"), 1.0]))
    assert found[0].ranks == (1,)


# -- campaign pieces -------------------------------------------------------------------------------


def test_generator_is_seeded_and_covers_the_classes_round_robin():
    cfg = CampaignConfig(world=8, trials=2 * len(FAULT_CLASSES), seed=3)
    a, b = generate_trials(cfg), generate_trials(cfg)
    assert [t.fault.to_dict() for t in a] == [t.fault.to_dict() for t in b]
    assert [t.fault.to_dict() for t in a] != [
        t.fault.to_dict() for t in generate_trials(CampaignConfig(seed=4, trials=cfg.trials))
    ]
    assert {t.fault_class for t in a} == set(FAULT_CLASSES)
    lo, hi = cfg.fault_offset
    for t in a:
        assert lo <= t.fault.step <= hi
        assert t.fault.rank is None or 0 <= t.fault.rank < cfg.world
        if t.fault_class in BENIGN_CLASSES:
            assert t.culprit is None
        else:
            assert t.culprit == t.fault.rank


def test_faults_from_a_file_count_from_the_checkpoint_and_are_checked():
    cfg = CampaignConfig(world=4, branch_steps=20, fault_offset=(1, 2))
    faults = parse_faults(
        '{"kind": "nan", "rank": 1, "step": 3, "target": "blocks.0.attn.scores"}\n'
        '{"kind": "lr_spike", "rank": null, "step": 5, "magnitude": 50}\n'
    )
    trials = trials_from_faults(faults, cfg)
    assert [t.fault_class for t in trials] == ["nan_attn", "lr_spike"]
    late = parse_faults('{"kind": "nan", "rank": 1, "step": 20, "target": "head"}')
    with pytest.raises(FaultSpecError, match="step"):
        trials_from_faults(late, cfg)
    with pytest.raises(FaultSpecError, match="rank"):
        trials_from_faults(parse_faults('{"kind": "nan", "rank": 4, "step": 2, "target": "head"}'), cfg)
    with pytest.raises(ConfigError, match="campaign.fault_offset"):
        CampaignConfig(branch_steps=10, fault_offset=(5, 10))


def test_probe_presets_are_shared_by_the_campaign_and_the_overhead_benchmark(tmp_path):
    from sdcwatch.telemetry.probes.config import ProbeConfig
    from sdcwatch.telemetry.probes.presets import PROBE_PRESETS, probe_config

    assert probe_config("default") == ("default", ProbeConfig())
    assert set(PROBE_PRESETS) >= {"default", "every-step", "scalars-only"}
    spec = tmp_path / "light.json"
    spec.write_text('{"checksum_every": 4, "attention_every": 32}')
    name, cfg = probe_config(str(spec))
    assert name == "light" and cfg.checksum_every == 4 and cfg.attention_every == 32
    assert CampaignConfig(probes=str(spec)).probes == str(spec)
    with pytest.raises(ConfigError, match="neither a preset"):
        CampaignConfig(probes="fastest")
    spec.write_text('{"checksum_evry": 4}')
    with pytest.raises(ConfigError, match="probes.checksum_evry"):
        probe_config(str(spec))
    overhead = (Path(__file__).resolve().parents[2] / "bench" / "bench_overhead.py").read_text()
    assert "PROBE_PRESETS" in overhead  # the overhead benchmark measures the same named configurations


def test_masked_fault_classes_from_a_file():
    from sdcwatch.testbed.campaign.fault_classes import fault_class

    faults = parse_faults(
        '{"kind": "near_inf", "rank": 6, "step": 7, "target": "*att*", "where": "output", "magnitude": 1e12}\n'
        '{"kind": "near_inf", "rank": 6, "step": 7, "target": "blocks.1.attn", "magnitude": 1e12}\n'
        '{"kind": "bitflip", "rank": 1, "step": 3, "target": "blocks.0", "bit": 3}\n'
        '{"kind": "bitflip", "rank": 1, "step": 3, "target": "head", "where": "param", "bit": 3}\n'
    )
    assert [fault_class(f) for f in faults] == [
        "near_inf_other",
        "nonfinite_stream",
        "bitflip_container",
        "param_bitflip_mantissa",
    ]


# -- the runners -----------------------------------------------------------------------------------


def test_quick_campaign_scores_every_detector_and_catches_the_nonfinite_fault(tmp_path, capsys):
    out = tmp_path / "campaign.json"
    # branches of 16 steps, not the quick size's 24: both faults come 2-4 steps after the checkpoint and
    # every detector's verdict is the same as over 24 steps (detected at the step or the next)
    result = campaign_main(["--quick", "--steps", "90", "16", "--trials", "2", "--out", str(out)])
    assert json.loads(out.read_text())["trials"] == json.loads(json.dumps(result["trials"]))
    assert len(result["trials"]) == 2
    for t in result["trials"]:
        assert t["impact"]["class"] in IMPACT_CLASSES
        assert set(t["detectors"]) == DETECTORS
        for verdict in t["detectors"].values():
            assert {"detected", "first_detection_step", "localized_rank", "attribution"} <= set(verdict)
    assert set(result["summary"]) >= {"all", *(t["class"] for t in result["trials"])}
    assert "| class | detector |" in capsys.readouterr().out
    assert result["config"]["probes"] == "default" and result["config"]["probe_settings"]["checksum_every"] == 16
    assert len(result["targets"]) == 8 and all({"target", "value", "met"} <= set(t) for t in result["targets"])

    nan = next(t for t in result["trials"] if t["class"] == "nan_attn")
    assert nan["impact"]["class"] == "nonfinite"
    sw = nan["detectors"]["sdcwatch"]
    assert sw["detected"] and sw["first_detection_step"] == nan["fault_step"] and sw["delay"] == 0
    rank = nan["culprit_rank"]
    assert rank in sw["named_ranks"] and f"rank {rank}" in sw["message"]
    assert sw["false_alarms"] == 0

    bad_batch = next(t for t in result["trials"] if t["class"] == "bad_batch_all")
    assert bad_batch["culprit_rank"] is None
    if bad_batch["detectors"]["sdcwatch"]["detected"]:
        assert bad_batch["detectors"]["sdcwatch"]["attribution"] != "sdc"  # benign: no rank blamed

    md = write_markdown(tmp_path, command="test")
    assert "Fault-injection campaign" in md.read_text()


@pytest.fixture(scope="module")
def campaign_3d(tmp_path_factory):
    """The quick campaign on a simulated tp=2, pp=2, dp=2 job (run once for the tests below)."""
    out = tmp_path_factory.mktemp("campaign3d") / "campaign.json"
    result = campaign_main(["--quick", "--parallel", "dp=2,tp=2,pp=2", "--detectors", "sdcwatch", "--out", str(out)])
    return result, {t["class"]: t for t in result["trials"]}


@pytest.mark.bench
def test_quick_campaign_under_a_3d_layout_detects_at_the_step_and_blames_nobody_on_the_clean_twins(campaign_3d):
    result, by_class = campaign_3d
    assert result["config"]["parallel"] == "pp=2,dp_replicate=2,tp=2" and result["config"]["world"] == 8
    assert set(by_class) == {"nan_attn", "bad_batch_all", "unhealthy_node"}
    nan = by_class["nan_attn"]
    assert nan["impact"]["class"] == "nonfinite" and 0 <= nan["culprit_rank"] < 8
    sw = nan["detectors"]["sdcwatch"]
    assert sw["detected"] and sw["delay"] == 0
    bad = by_class["bad_batch_all"]["detectors"]["sdcwatch"]
    assert bad["detected"] and bad["attribution"] != "sdc"
    assert all(t["detectors"]["sdcwatch"]["false_alarms"] == 0 for t in result["trials"]), result["trials"]
    with pytest.raises(ConfigError, match="--parallel"):
        campaign_main(["--quick", "--parallel", "tp=2,dp=2", "--ranks", "4"])


@pytest.mark.bench
def test_quick_campaign_under_a_3d_layout_names_the_nan_rank(campaign_3d):
    _, by_class = campaign_3d
    nan = by_class["nan_attn"]
    assert nan["detectors"]["sdcwatch"]["localized_rank"] == nan["culprit_rank"]


@pytest.mark.slow
def test_quick_campaign_with_the_guard_runs_three_ways_and_saves_the_damage(tmp_path, capsys):
    out = tmp_path / "campaign.json"
    # branches of 16 steps, not the quick size's 24: the faults come 2-4 steps after the checkpoint
    # and every guard action falls within 6 steps of the branch start (rerun, skips, eviction, the
    # restart's replayed steps); the clean twins run 16 guarded steps with no action
    argv = ["--quick", "--steps", "90", "16", "--guard", "--detectors", "sdcwatch", "--out", str(out)]
    result = campaign_main(argv)
    assert json.loads(out.read_text())["guard_targets"] == json.loads(json.dumps(result["guard_targets"]))
    by_class = {t["class"]: t for t in result["trials"]}
    assert set(by_class) == {"nan_attn", "bad_batch_all", "unhealthy_node"}
    for t in result["trials"]:
        g = t["guard"]
        assert g["twin_actions"] == []  # the clean twin, guarded, needs no action
        assert g["finished"] and g["final_loss"]["guarded"] is not None
    nan = by_class["nan_attn"]["guard"]
    assert nan["final_excess"]["faulted"] == "Infinity"  # unguarded, the NaN ends the run
    assert nan["final_excess"]["guarded"] == 0.0 and nan["drift"]["guarded"] == 0.0  # rerun: nothing lost
    assert [(a["action"], a["verdict"]) for a in nan["actions"]] == [("rerun", "transient")]
    assert nan["verdict_right"] is True
    bad = by_class["bad_batch_all"]["guard"]
    assert bad["actions"] and {a["action"] for a in bad["actions"]} == {"skip"} and bad["verdict"] == "data"
    assert bad["drift"]["guarded"] < bad["drift"]["faulted"]
    sick = by_class["unhealthy_node"]
    assert sick["guard"]["evicted_rank"] == sick["fault"]["rank"] and sick["guard"]["evicted_in_window"]
    assert sick["guard"]["steps_spent"] > 0  # restarted from a snapshot: replayed steps are counted
    assert {t["target"]: t["met"] for t in result["guard_targets"]}["zero actions on the clean twins"] is True
    assert set(result["guard_summary"]) == {"all", *by_class}
    assert "| target (guard) | measured | met |" in capsys.readouterr().out


def quick_e2e(bootstrap, *options):
    """The end-to-end benchmark's first scale, 128 ranks for 6 s with a fault every 6 steps; it
    must take every step and find every fault it injected (at least 3)."""
    result = e2e_main(
        [
            "--bootstrap",
            bootstrap,
            "--ranks",
            "128",
            "--duration",
            "6",
            "--rate",
            "4",
            "--fault-every",
            "6",
            *options,
        ]
    )
    s = result["scales"][0]
    assert s["steps_processed"] == s["steps"]
    assert s["faults_injected"] >= 3 and s["faults_detected"] == s["faults_injected"]
    return s


@pytest.mark.integration
def test_quick_e2e_through_the_broker_finds_every_injected_fault(bootstrap, tmp_path):
    out = tmp_path / "e2e.json"
    s = quick_e2e(bootstrap, "--out", str(out))
    assert json.loads(out.read_text())["scales"][0]["ranks"] == 128
    assert 0 < s["latency_s"]["p50"] <= s["latency_s"]["p99"]
    assert s["lag_samples"] and s["lag_at_producers_done"] is not None


def test_bench_without_a_command_prints_usage():
    assert bench_main([]) == 2
    assert bench_main(["--help"]) == 0


def test_split_benchmark_reports_costs_sizes_and_detection(tmp_path):
    out = tmp_path / "split.json"
    script = Path(__file__).resolve().parents[2] / "bench" / "bench_split.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--ranks",
            "512",
            "--steps",
            "4",
            "--detect-ranks",
            "64",
            "--seeds",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(out.read_text())
    (cost,) = res["costs"]
    assert cost["ranks"] == 512 and cost["metrics"] == 32
    assert cost["ingest"]["wire"] == "v2"  # the records as the emitter sends them by default
    assert cost["bytes_ratio"] > 20  # a summary is far smaller than the records of its step
    assert cost["cpu_ms_per_step"]["temporal"] < cost["cpu_ms_per_step"]["spatial"]
    assert cost["incidents_on_clean_stream"] == {"both": 0, "split": 0}
    six = next(r for r in res["detection"] if r["shift_sigmas"] == 6.0)
    assert six["both"]["found"] == six["split"]["found"] == 1
    # re-sending every rank's layer names over the period: every rank once, a fresh temporal
    # stage knows them all at its end, and a summary gains a small part of its size
    assert [r["layout"] for r in res["names"]] == ["one list", "4 stages, contiguous", "4 stages, interleaved"]
    for r in res["names"]:
        assert r["ranks_resent_in_one_period"] == 512 and r["fresh_temporal_knows_every_rank"]
        assert 0 < r["added_bytes_mean"] < r["first_summary_added_bytes"]


def test_ingest_benchmark_prints_one_json_object_a_line_a_format(capsys):
    rows = bench_main(["ingest", "--ranks", "300", "--metrics", "16", "--steps", "1", "--json"])
    assert rows == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["format"] for r in lines] == ["v1", "v2"]
    for r in lines:
        assert {"format", "ranks", "metrics", "decode_ms", "align_ms", "detect_ms", "us_per_record"} <= set(r)
        assert (r["ranks"], r["metrics"]) == (300, 16)
        # each field is rounded to 3 decimals: two ms roundings (0.0005 ms each, over 300 records)
        # and the us rounding itself
        rounding = 1e3 * 2 * 0.0005 / 300 + 0.0005
        assert r["us_per_record"] == pytest.approx(1e3 * (r["decode_ms"] + r["align_ms"]) / 300, abs=rounding)
        assert r["incidents"] == 0  # clean data: no alarm on either wire
    v1, v2 = lines
    assert v2["bytes_per_record"] < v1["bytes_per_record"]


def test_ingest_benchmark_refuses_bad_sizes():
    with pytest.raises(SystemExit):
        bench_main(["ingest", "--ranks", "0"])


@pytest.mark.integration
@pytest.mark.bench
@pytest.mark.parametrize("options", [["--split"], ["--wire", "v1"]])
def test_quick_e2e_split_and_v1_find_every_injected_fault(bootstrap, options):
    s = quick_e2e(bootstrap, "--per-message", "50", *options)
    assert (s["split"], s["wire"]) == ("--split" in options, "v1" if "v1" in options else "v2")
    assert s["spatial_steps_per_cpu_s"] > 0
    if s["split"]:
        assert s["temporal_steps_per_cpu_s"] > 0


def test_campaign_over_either_wire_gives_the_same_result():
    """Detection on what crosses the bus: v1 and v2 give the same verdicts on the same trials (both
    faults are detected: the NaN at its step, the unhealthy node 4 steps after it, rank named)."""
    from sdcwatch.testbed.campaign.run import run_campaign

    base = dict(
        world=4,
        trials=2,
        pretrain_steps=20,
        branch_steps=8,
        fault_offset=(2, 3),
        classes=("nan_attn", "unhealthy_node"),
    )
    results = {
        w: run_campaign(CampaignConfig(**base, wire=w), None, detectors=["sdcwatch"], progress=lambda m: None)
        for w in ("v1", "v2")
    }
    strip = lambda r: [{k: v for k, v in t.items() if k not in ("seconds",)} for t in r["trials"]]  # noqa: E731
    assert strip(results["v1"]) == strip(results["v2"])
    assert all(t["detectors"]["sdcwatch"]["detected"] for t in results["v2"]["trials"])
