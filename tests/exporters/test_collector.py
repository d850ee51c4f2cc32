"""The collector: exact exposition text, bounded cardinality, top-K choice, robustness."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sdcwatch.core.errors import ConfigError
from sdcwatch.detectors.registry import detector_metrics
from sdcwatch.exporters import SdcwatchCollector, catalogue
from sdcwatch.exporters.collector import MAX_RANKS_PER_INCIDENT


def render(view_fn, **options) -> str:
    registry = CollectorRegistry()
    registry.register(SdcwatchCollector(view_fn, clock=lambda: 1001.0, **options))
    return generate_latest(registry).decode()


#: The rank-outlier detector's per-rank evidence, in ``RunView.detector_values``.
RANK_SCORE = "sdcwatch_rank_outlier_score"


def series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


EXPECTED_SMALL = """\
# HELP sdcwatch_training_last_step Last training step the detector service completed.
# TYPE sdcwatch_training_last_step gauge
sdcwatch_training_last_step{run="r1"} 120.0
# HELP sdcwatch_training_steps_total Training steps the detector service has completed.
# TYPE sdcwatch_training_steps_total counter
sdcwatch_training_steps_total{run="r1"} 120.0
# HELP sdcwatch_training_world_size Number of ranks (world size) of the run.
# TYPE sdcwatch_training_world_size gauge
sdcwatch_training_world_size{run="r1"} 8.0
# HELP sdcwatch_training_run_finished 1 once every rank of the run sent its end-of-run marker (it ended normally: no stall alert; its series go after the end expiry), else 0.
# TYPE sdcwatch_training_run_finished gauge
sdcwatch_training_run_finished{run="r1"} 0.0
# HELP sdcwatch_training_loss Latest global training loss (mean over ranks) of the last completed step.
# TYPE sdcwatch_training_loss gauge
sdcwatch_training_loss{run="r1"} 2.5
# HELP sdcwatch_training_grad_norm Latest global gradient norm of the last completed step.
# TYPE sdcwatch_training_grad_norm gauge
sdcwatch_training_grad_norm{run="r1"} 1.25
# HELP sdcwatch_detector_spike_score Current spike score of a global metric against its robust trend-aware baseline.
# TYPE sdcwatch_detector_spike_score gauge
sdcwatch_detector_spike_score{metric="grad_norm",run="r1"} 0.5
sdcwatch_detector_spike_score{metric="loss",run="r1"} 7.5
# HELP sdcwatch_rank_outlier_score Accumulated rank-outlier evidence of a rank; exported for the top-K ranks and every rank in an open incident only.
# TYPE sdcwatch_rank_outlier_score gauge
sdcwatch_rank_outlier_score{host="h1",rank="2",run="r1"} 1.0
sdcwatch_rank_outlier_score{host="h2",rank="5",run="r1"} 9.5
# HELP sdcwatch_pipeline_missing_ranks Ranks not heard from for a long time (presumed dead).
# TYPE sdcwatch_pipeline_missing_ranks gauge
sdcwatch_pipeline_missing_ranks{run="r1"} 0.0
# HELP sdcwatch_detector_findings_total Findings produced by each detector, by kind.
# TYPE sdcwatch_detector_findings_total counter
sdcwatch_detector_findings_total{detector="guard",kind="guard_skip"} 1.0
sdcwatch_detector_findings_total{detector="rank_outlier",kind="rank_outlier"} 7.0
# HELP sdcwatch_guard_actions_total Steps at which a training job's guard acted: skip, rerun, rollback or evict.
# TYPE sdcwatch_guard_actions_total counter
sdcwatch_guard_actions_total{action="skip"} 1.0
# HELP sdcwatch_rank_metric Statistic across ranks (min, q25, median, q75, max) of a per-rank scalar at the last step; under tensor or pipeline parallelism across the ranks of one model piece (piece="pp=1,tp=0", no piece label for plain data parallel).
# TYPE sdcwatch_rank_metric gauge
sdcwatch_rank_metric{metric="loss",run="r1",stat="min"} 2.0
sdcwatch_rank_metric{metric="loss",run="r1",stat="q25"} 2.25
sdcwatch_rank_metric{metric="loss",run="r1",stat="median"} 2.5
sdcwatch_rank_metric{metric="loss",run="r1",stat="q75"} 2.75
sdcwatch_rank_metric{metric="loss",run="r1",stat="max"} 3.0
# HELP sdcwatch_layer_metric Statistic across ranks of a per-layer metric at the last step (a sampled one, such as the attention statistics: at the last step that measured it, up to 256 steps back), per model piece like sdcwatch_rank_metric (a pipeline stage numbers its own layers from 0); only at the indices the metric has, layer_name the module an index is when the ranks sent their names.
# TYPE sdcwatch_layer_metric gauge
sdcwatch_layer_metric{layer="0",metric="attn_entropy",run="r1",stat="min"} 0.0
sdcwatch_layer_metric{layer="0",metric="attn_entropy",run="r1",stat="median"} 2.0
sdcwatch_layer_metric{layer="0",metric="attn_entropy",run="r1",stat="max"} 4.0
sdcwatch_layer_metric{layer="1",metric="attn_entropy",run="r1",stat="min"} 5.0
sdcwatch_layer_metric{layer="1",metric="attn_entropy",run="r1",stat="median"} 7.0
sdcwatch_layer_metric{layer="1",metric="attn_entropy",run="r1",stat="max"} 9.0
# HELP sdcwatch_incidents_open Incidents currently open.
# TYPE sdcwatch_incidents_open gauge
sdcwatch_incidents_open{kind="loss_spike",run="r1",severity="warning"} 0.0
sdcwatch_incidents_open{kind="sdc_suspected",run="r1",severity="critical"} 1.0
# HELP sdcwatch_incidents_total Incidents opened since the service started (an escalation counts under its new kind too).
# TYPE sdcwatch_incidents_total counter
sdcwatch_incidents_total{kind="loss_spike",severity="warning"} 2.0
sdcwatch_incidents_total{kind="sdc_suspected",severity="critical"} 1.0
# HELP sdcwatch_incident_info One series per open or recently resolved incident, carrying its description as labels.
# TYPE sdcwatch_incident_info gauge
sdcwatch_incident_info{detector="attribution",host="h2",id="inc-sdc-1",kind="sdc_suspected",layer="1",layer_name="",metric="attn_entropy",rank="5",run="r1",severity="critical",state="open"} 1.0
# HELP sdcwatch_incident_first_step First training step of an open or recently resolved incident.
# TYPE sdcwatch_incident_first_step gauge
sdcwatch_incident_first_step{id="inc-sdc-1",run="r1"} 100.0
# HELP sdcwatch_incident_last_step Last training step at which an incident was seen.
# TYPE sdcwatch_incident_last_step gauge
sdcwatch_incident_last_step{id="inc-sdc-1",run="r1"} 120.0
# HELP sdcwatch_incident_score Peak detector score of an incident.
# TYPE sdcwatch_incident_score gauge
sdcwatch_incident_score{id="inc-sdc-1",run="r1"} 9.5
# HELP sdcwatch_checkpoint_newest_clean_step Step of the newest checkpoint of the run marked clean (no fault began at or before it): the one to resume from.
# TYPE sdcwatch_checkpoint_newest_clean_step gauge
sdcwatch_checkpoint_newest_clean_step{run="r1"} 40.0
# HELP sdcwatch_checkpoint_step Step of a recent checkpoint of the run (slot 0 the newest, at most 8, and the newest clean one), labelled with its marking: clean, suspect or after-fault.
# TYPE sdcwatch_checkpoint_step gauge
sdcwatch_checkpoint_step{mark="after-fault",run="r1",slot="0"} 80.0
sdcwatch_checkpoint_step{mark="clean",run="r1",slot="1"} 40.0
# HELP sdcwatch_host_verdict 1 for each host the service judges suspect or quarantine from the evidence of several runs, worst first, at most metrics.max_hosts (clean and cleared hosts have no series; `sdcwatch hosts` lists all).
# TYPE sdcwatch_host_verdict gauge
sdcwatch_host_verdict{host="h2",verdict="suspect"} 1.0
# HELP sdcwatch_hosts_tracked Hosts whose evidence across runs the service keeps.
# TYPE sdcwatch_hosts_tracked gauge
sdcwatch_hosts_tracked 2.0
# HELP sdcwatch_hosts_suspect Hosts judged suspect or quarantine.
# TYPE sdcwatch_hosts_suspect gauge
sdcwatch_hosts_suspect 1.0
# HELP sdcwatch_pipeline_records_total Telemetry records the service has consumed.
# TYPE sdcwatch_pipeline_records_total counter
sdcwatch_pipeline_records_total 960.0
# HELP sdcwatch_pipeline_records_per_second Recent rate of consumed telemetry records.
# TYPE sdcwatch_pipeline_records_per_second gauge
sdcwatch_pipeline_records_per_second 8.0
# HELP sdcwatch_pipeline_consumer_lag_records Records between the consumer position and the end of the telemetry topic.
# TYPE sdcwatch_pipeline_consumer_lag_records gauge
sdcwatch_pipeline_consumer_lag_records 4.0
# HELP sdcwatch_pipeline_dead_letters_total Malformed records routed to the dead-letter topic.
# TYPE sdcwatch_pipeline_dead_letters_total counter
sdcwatch_pipeline_dead_letters_total 2.0
# HELP sdcwatch_state_write_errors_total State snapshots that could not be written (a full or read-only disk); detection goes on, each is retried.
# TYPE sdcwatch_state_write_errors_total counter
sdcwatch_state_write_errors_total 0.0
# HELP sdcwatch_state_topic_refused_total State topic snapshots refused at start, by reason: older (the service wrote a newer one: a copy re-published), deleted (a tombstone of the manifest, which the service never writes) (see docs/service.md).
# TYPE sdcwatch_state_topic_refused_total counter
sdcwatch_state_topic_refused_total{reason="older"} 1.0
# HELP sdcwatch_auth_runs_refused_total Messages refused because their key may not speak for their run or their envelope is not fresh, by key id and reason: run_name (not issued for it), bound (another key holds it), full (no binding free), unsigned, replayed (its number taken before), stale (an older start), future (a start ahead of the clock), unfresh (no start, from a key that sends them) (see docs/service.md).
# TYPE sdcwatch_auth_runs_refused_total counter
sdcwatch_auth_runs_refused_total{key="job-b",reason="run_name"} 2.0
# HELP sdcwatch_auth_redelivered_total Signed messages read again at their place in the topic (a rebalance or a restart re-reads from the committed offset), taken again, by key id (at-least-once delivery, not refusals; see docs/service.md).
# TYPE sdcwatch_auth_redelivered_total counter
sdcwatch_auth_redelivered_total{key="job-a"} 3.0
# HELP sdcwatch_pipeline_dead_letters_by_reason_total Records routed to the dead-letter topic, by reason: malformed, unknown_version, empty, oversize, world, layers, layer_metrics, values, step_size, counter, name, step_jump, runs, unknown_schema (see docs/operating.md, Limits).
# TYPE sdcwatch_pipeline_dead_letters_by_reason_total counter
sdcwatch_pipeline_dead_letters_by_reason_total{reason="malformed"} 1.0
sdcwatch_pipeline_dead_letters_by_reason_total{reason="world"} 1.0
# HELP sdcwatch_pipeline_consumer_partitions Partitions of the telemetry topic this instance reads; 0 means evicted from its consumer group or waiting for a rebalance: nothing is processed.
# TYPE sdcwatch_pipeline_consumer_partitions gauge
sdcwatch_pipeline_consumer_partitions 4.0
# HELP sdcwatch_pipeline_consumer_rebalances_total Times the partitions this instance reads changed after it first joined its consumer group (another instance joined or left, or this one was evicted for polling too late: records may be read again).
# TYPE sdcwatch_pipeline_consumer_rebalances_total counter
sdcwatch_pipeline_consumer_rebalances_total 2.0
# HELP sdcwatch_pipeline_messages_waiting_for_schema Wire v2 messages held until the message carrying their record layout comes (at most detectors.schema_wait_s, then dead-lettered as unknown_schema).
# TYPE sdcwatch_pipeline_messages_waiting_for_schema gauge
sdcwatch_pipeline_messages_waiting_for_schema 3.0
# HELP sdcwatch_pipeline_offset_gaps_total Gaps in a telemetry partition's offsets: refetched (times the reader went back to one), filled (the missing messages came), skipped (taken as real after the gap wait; their messages were not read).
# TYPE sdcwatch_pipeline_offset_gaps_total counter
sdcwatch_pipeline_offset_gaps_total{outcome="filled"} 1.0
sdcwatch_pipeline_offset_gaps_total{outcome="refetched"} 2.0
sdcwatch_pipeline_offset_gaps_total{outcome="skipped"} 0.0
# HELP sdcwatch_pipeline_runs Runs whose detection state the service keeps (at most detectors.max_runs).
# TYPE sdcwatch_pipeline_runs gauge
sdcwatch_pipeline_runs 1.0
# HELP sdcwatch_pipeline_runs_forgotten_total Runs that gave way to new ones within detectors.max_runs (on probation and silent, training and silent run_yield_idle_s, or unsigned to a signed newcomer).
# TYPE sdcwatch_pipeline_runs_forgotten_total counter
sdcwatch_pipeline_runs_forgotten_total 0.0
# HELP sdcwatch_pipeline_duplicates_total Duplicate records (same run, step and rank) discarded.
# TYPE sdcwatch_pipeline_duplicates_total counter
sdcwatch_pipeline_duplicates_total 1.0
# HELP sdcwatch_pipeline_late_records_total Records that arrived after their step had closed, and were dropped.
# TYPE sdcwatch_pipeline_late_records_total counter
sdcwatch_pipeline_late_records_total 3.0
# HELP sdcwatch_pipeline_world_changes_total Times a run's world size changed (its open steps were closed and alignment started over).
# TYPE sdcwatch_pipeline_world_changes_total counter
sdcwatch_pipeline_world_changes_total 0.0
# HELP sdcwatch_pipeline_incomplete_steps_total Steps closed without every rank's record (late or missing ranks).
# TYPE sdcwatch_pipeline_incomplete_steps_total counter
sdcwatch_pipeline_incomplete_steps_total 5.0
# HELP sdcwatch_pipeline_summaries_total Step summaries a temporal stage received from the spatial stage (scale-out).
# TYPE sdcwatch_pipeline_summaries_total counter
sdcwatch_pipeline_summaries_total 0.0
# HELP sdcwatch_pipeline_summaries_late_total Step summaries that arrived after a later step had been judged, and were dropped.
# TYPE sdcwatch_pipeline_summaries_late_total counter
sdcwatch_pipeline_summaries_late_total 0.0
# HELP sdcwatch_pipeline_last_record_age_seconds Seconds since the service consumed its last record.
# TYPE sdcwatch_pipeline_last_record_age_seconds gauge
sdcwatch_pipeline_last_record_age_seconds 2.0
# HELP sdcwatch_pipeline_last_step_age_seconds Seconds since the service completed the last step of the run.
# TYPE sdcwatch_pipeline_last_step_age_seconds gauge
sdcwatch_pipeline_last_step_age_seconds{run="r1"} 1.0
# HELP sdcwatch_pipeline_runs_evicted_total Runs dropped from memory and /metrics: "finished" (end expiry after the end-of-run markers) or "idle" (no record for the idle expiry; their open incidents resolved).
# TYPE sdcwatch_pipeline_runs_evicted_total counter
sdcwatch_pipeline_runs_evicted_total{reason="finished"} 3.0
sdcwatch_pipeline_runs_evicted_total{reason="idle"} 1.0
# HELP sdcwatch_pipeline_late_ranks Ranks that missed the alignment deadline at the last closed step.
# TYPE sdcwatch_pipeline_late_ranks gauge
sdcwatch_pipeline_late_ranks{run="r1"} 1.0
# HELP sdcwatch_emitter_dropped_records_total Records the in-rank emitters dropped (buffer full or bus down), summed over ranks.
# TYPE sdcwatch_emitter_dropped_records_total counter
sdcwatch_emitter_dropped_records_total{run="r1"} 3.0
# HELP sdcwatch_exporter_omitted Runs (what=runs) beyond metrics.max_runs, model pieces (what=pieces) beyond metrics.max_pieces, layers (what=layers, (piece, layer) pairs) beyond metrics.max_layers, summed over runs, and flagged hosts (what=hosts) beyond metrics.max_hosts, that have no series of their own at this scrape.
# TYPE sdcwatch_exporter_omitted gauge
sdcwatch_exporter_omitted{what="runs"} 0.0
sdcwatch_exporter_omitted{what="layers"} 0.0
sdcwatch_exporter_omitted{what="pieces"} 0.0
sdcwatch_exporter_omitted{what="hosts"} 0.0
# HELP sdcwatch_exporter_view_errors_total Scrapes at which reading the service state failed (the scrape then shows only this).
# TYPE sdcwatch_exporter_view_errors_total counter
sdcwatch_exporter_view_errors_total 0.0
"""


def test_exposition_text_of_a_small_view_is_exact():
    assert render(support.small_view, top_k=2) == EXPECTED_SMALL


def test_incident_rank_is_exported_even_outside_the_top_k():
    view = support.small_view()
    view.runs[0].detector_values[RANK_SCORE][:] = 0.0
    view.runs[0].detector_values[RANK_SCORE][0] = 50.0  # rank 0 is the top outlier; rank 5 only has the incident
    exported = re.findall(r'sdcwatch_rank_outlier_score\{host="[^"]*",rank="(\d+)"', render(lambda: view, top_k=1))
    assert exported == ["0", "5"]


def test_top_k_prefers_higher_scores_then_lower_ranks_and_puts_nan_first():
    view = support.small_view()
    view.incidents = []
    view.runs[0].detector_values[RANK_SCORE] = np.array([1.0, 3.0, 3.0, 3.0, np.nan, 0.0, 2.0, 3.0])
    exported = re.findall(r'rank="(\d+)"', render(lambda: view, top_k=3))
    assert exported == ["1", "2", "4"]  # NaN first, then the two lowest of the four 3.0 ranks


def test_top_k_zero_exports_only_incident_ranks():
    exported = re.findall(r'sdcwatch_rank_outlier_score\{[^}]*rank="(\d+)"', render(support.small_view, top_k=0))
    assert exported == ["5"]


def test_resolved_incidents_are_listed_but_not_counted_open():
    view = support.small_view()
    view.incidents = [support.sdc_incident(opened_at=990.0, resolved=True)]
    text = render(lambda: view)
    assert 'state="resolved"' in text
    assert 'sdcwatch_incidents_open{kind="sdc_suspected",run="r1",severity="critical"} 0.0' in text
    assert 'sdcwatch_rank_outlier_score{host="h2",rank="5"' not in render(lambda: view, top_k=0)


@pytest.mark.parametrize("world", [8, 1024, 16_384])
def test_cardinality_is_bounded_whatever_the_world_size(world):
    count = len(series(render(lambda: support.large_view(world), top_k=16)))
    assert count < 2000, f"{count} series at {world} ranks"


def test_series_count_does_not_grow_with_world_size():
    def split(world):
        lines = series(render(lambda: support.large_view(world), top_k=16))
        per_rank = [s for s in lines if s.startswith("sdcwatch_rank_outlier_score{")]
        return len(per_rank), len(lines) - len(per_rank)

    small_ranks, small_rest = split(64)
    huge_ranks, huge_rest = split(16_384)
    assert small_rest == huge_rest
    # top-K plus at most MAX_RANKS_PER_INCIDENT ranks of each of the 4 open incidents
    assert 16 <= huge_ranks <= 16 + 4 * MAX_RANKS_PER_INCIDENT
    assert 16 <= small_ranks <= 16 + 4 * MAX_RANKS_PER_INCIDENT


def test_no_label_carries_a_step_and_every_family_is_catalogued():
    text = render(lambda: support.large_view(256))
    every = catalogue(detector_metrics())
    names = {spec.name for spec in every} | {spec.family for spec in every}
    for family in text_string_to_metric_families(text):
        assert family.name in names, family.name
        assert family.documentation, family.name
        for sample in family.samples:
            assert not {"step", "first_step", "last_step"} & set(sample.labels), sample


def test_catalogue_follows_the_naming_convention():
    for spec in catalogue(detector_metrics()):
        assert re.fullmatch(r"sdcwatch_[a-z]+_[a-z0-9_]+", spec.name), spec.name
        assert (spec.kind == "counter") == spec.name.endswith("_total"), spec.name
        assert spec.help.endswith("."), spec.name
        assert "step" not in spec.labels


def test_a_failing_view_still_answers_the_scrape_and_counts_the_error():
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        raise RuntimeError("service lock poisoned")

    registry = CollectorRegistry()
    registry.register(SdcwatchCollector(broken))
    first = generate_latest(registry).decode()
    second = generate_latest(registry).decode()
    assert series(first) == ["sdcwatch_exporter_view_errors_total 1.0"]
    assert series(second) == ["sdcwatch_exporter_view_errors_total 2.0"]
    assert calls["n"] == 2


def test_layer_metric_filter_and_stats_choice():
    view = support.large_view(32, layers=3)
    text = render(lambda: view, layer_metrics=["attn_entropy"], layer_stats=["median"])
    layer_series = [s for s in series(text) if s.startswith("sdcwatch_layer_metric")]
    assert len(layer_series) == 3
    assert all('metric="attn_entropy"' in s and 'stat="median"' in s for s in layer_series)


@pytest.mark.parametrize(
    "options,key",
    [
        ({"top_k": -1}, "metrics.top_k"),
        ({"top_k": 2.5}, "metrics.top_k"),
        ({"layer_stats": ["p99"]}, "exporter.layer_stats"),
        ({"scalar_stats": "median"}, "exporter.scalar_stats"),
        ({"max_pieces": 0}, "metrics.max_pieces"),
    ],
)
def test_bad_settings_are_rejected_naming_the_key(options, key):
    with pytest.raises(ConfigError) as err:
        SdcwatchCollector(support.small_view, **options)
    assert err.value.key == key


def test_view_fn_must_be_callable():
    with pytest.raises(ConfigError, match="exporter.view_fn"):
        SdcwatchCollector(support.small_view())


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@pytest.mark.parametrize("make_view", [support.small_view, lambda: support.large_view(16_384)])
def test_promtool_check_metrics_accepts_the_exposition(make_view):
    text = render(make_view)
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


def test_collector_renders_a_real_detection_pipeline_view():
    """The collector against the detector service's own view (not a hand-built one)."""
    from sdcwatch.core.record_type import Record
    from sdcwatch.service.pipeline import DetectionPipeline

    rng = np.random.default_rng(0)
    world, layers = 8, 3
    pipeline = DetectionPipeline()
    for step in range(160):
        records = []
        for rank in range(world):
            grad = 1.0 + 0.05 * rng.normal() + (2.0 if rank == 5 and step >= 100 else 0.0)
            records.append(
                Record.make(
                    run="ref",
                    step=step,
                    rank=rank,
                    world=world,
                    host=f"node{rank // 4}",
                    time=float(step),
                    scalars={"loss": 3.0 + 0.01 * rng.normal(), "grad_norm_local": grad, "nonfinite": 0.0},
                    layers={"attn_entropy": (2.0 + 0.02 * rng.normal(size=layers)).tolist()},
                )
            )
        pipeline.process(records)
    pipeline.flush()
    view = pipeline.view()
    text = render(lambda: view, top_k=2)

    families = {f.name: f for f in text_string_to_metric_families(text)}
    exported = {s.labels["rank"] for s in families["sdcwatch_rank_outlier_score"].samples}
    strongest = int(np.nanargmax(view.runs[0].detector_values[RANK_SCORE]))
    assert str(strongest) in exported
    for inc in view.incidents:
        if inc.open:
            assert {str(r) for r in inc.ranks} <= exported
    assert len(families["sdcwatch_layer_metric"].samples) == 3 * layers  # min, median, max
    assert families["sdcwatch_training_world_size"].samples[0].value == world
    if shutil.which("promtool"):
        result = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_layers_past_max_layers_keep_the_incident_layer_and_the_widest_spread():
    """Per-layer series are bounded like ranks: open-incident layers, then the widest spread."""
    view = support.small_view(layers=300)  # the incident names layer 1
    stats = np.tile(np.array([1.0, 1.9, 2.0, 2.1, 3.0]), (300, 1))  # spread (max - min) / IQR = 10
    stats[200] = [1.0, 1.9, 2.0, 2.1, 90.0]  # one rank far off in layer 200
    stats[250, 4] = np.nan  # a NaN in layer 250: ranked first
    view.runs[0].layer_stats = {"attn_entropy": stats}
    text = render(lambda: view, top_k=2, max_layers=3, layer_stats=("max",))
    layers = sorted(int(m) for m in re.findall(r'sdcwatch_layer_metric\{layer="(\d+)"', text))
    assert layers == [1, 200, 250]
    assert 'sdcwatch_exporter_omitted{what="layers"} 297.0' in text
    assert render(lambda: view, top_k=2, max_layers=300).count("sdcwatch_layer_metric{") == 900


def test_guard_actions_are_counted_by_action_from_the_guard_findings():
    view = support.small_view()
    view.findings_total = {("guard", "guard_skip"): 3, ("guard", "guard_evict"): 1, ("spike", "loss_spike"): 2}
    lines = [ln for ln in series(render(lambda: view)) if ln.startswith("sdcwatch_guard_actions_total")]
    assert lines == [
        'sdcwatch_guard_actions_total{action="evict"} 1.0',
        'sdcwatch_guard_actions_total{action="skip"} 3.0',
    ]
