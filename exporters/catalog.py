"""The catalogue of every metric sdcwatch exposes (the service's own here, each detector's in its
file), for the collector, the dashboard and its README. Names follow
``sdcwatch_<subsystem>_<name>_<unit>``; counters end in ``_total``; no label carries a step number.
"""

from __future__ import annotations

from collections.abc import Sequence

from sdcwatch.core.metric_spec import MetricSpec

__all__ = ["catalogue", "STATS", "metric"]

#: Cross-rank statistics, in the column order of ``RunView.scalar_stats`` / ``layer_stats``.
STATS: tuple[str, ...] = ("min", "q25", "median", "q75", "max")


#: The run as a whole (its detectors' families follow these).
_RUN: tuple[MetricSpec, ...] = (
    MetricSpec("sdcwatch_training_last_step", "gauge", ("run",), "Last training step the detector service completed."),
    MetricSpec(
        "sdcwatch_training_steps_total", "counter", ("run",), "Training steps the detector service has completed."
    ),
    MetricSpec("sdcwatch_training_world_size", "gauge", ("run",), "Number of ranks (world size) of the run."),
    MetricSpec(
        "sdcwatch_training_run_finished",
        "gauge",
        ("run",),
        "1 once every rank of the run sent its end-of-run marker (it ended normally: no stall alert; "
        "its series go after the end expiry), else 0.",
    ),
)

#: The findings, incidents, checkpoints, statistics across ranks, and the service's own health.
_SERVICE: tuple[MetricSpec, ...] = (
    MetricSpec(
        "sdcwatch_detector_findings_total",
        "counter",
        ("detector", "kind"),
        "Findings produced by each detector, by kind.",
    ),
    # the training job's guard, as its records report it
    MetricSpec(
        "sdcwatch_guard_actions_total",
        "counter",
        ("action",),
        "Steps at which a training job's guard acted: skip, rerun, rollback or evict.",
    ),
    # ranks: per-rank only for the top-K outliers and ranks in open incidents
    MetricSpec(
        "sdcwatch_rank_metric",
        "gauge",
        ("run", "piece", "metric", "stat"),
        "Statistic across ranks (min, q25, median, q75, max) of a per-rank scalar at the last step; under "
        'tensor or pipeline parallelism across the ranks of one model piece (piece="pp=1,tp=0", no piece label '
        "for plain data parallel).",
    ),
    MetricSpec(
        "sdcwatch_layer_metric",
        "gauge",
        ("run", "piece", "metric", "layer", "layer_name", "stat"),
        "Statistic across ranks of a per-layer metric at the last step (a sampled one, such as the attention "
        "statistics: at the last step that measured it, up to 256 steps back), per model piece like sdcwatch_rank_metric "
        "(a pipeline stage numbers its own layers from 0); only at the indices the metric has, layer_name the "
        "module an index is when the ranks sent their names.",
    ),
    # incidents
    MetricSpec("sdcwatch_incidents_open", "gauge", ("run", "kind", "severity"), "Incidents currently open."),
    MetricSpec(
        "sdcwatch_incidents_total",
        "counter",
        ("kind", "severity"),
        "Incidents opened since the service started (an escalation counts under its new kind too).",
    ),
    MetricSpec(
        "sdcwatch_incident_info",
        "info",
        ("run", "id", "kind", "severity", "state", "rank", "host", "layer", "layer_name", "metric", "detector"),
        "One series per open or recently resolved incident, carrying its description as labels.",
    ),
    MetricSpec(
        "sdcwatch_incident_first_step",
        "gauge",
        ("run", "id"),
        "First training step of an open or recently resolved incident.",
    ),
    MetricSpec(
        "sdcwatch_incident_last_step", "gauge", ("run", "id"), "Last training step at which an incident was seen."
    ),
    MetricSpec("sdcwatch_incident_score", "gauge", ("run", "id"), "Peak detector score of an incident."),
    # certified checkpoints: the checkpoints a run reported, as the service marked them
    MetricSpec(
        "sdcwatch_checkpoint_newest_clean_step",
        "gauge",
        ("run",),
        "Step of the newest checkpoint of the run marked clean (no fault began at or before it): the one to resume from.",
    ),
    MetricSpec(
        "sdcwatch_checkpoint_step",
        "gauge",
        ("run", "slot", "mark"),
        "Step of a recent checkpoint of the run (slot 0 the newest, at most 8, and the newest clean one), "
        "labelled with its marking: clean, suspect or after-fault.",
    ),
    # hosts across runs (docs/hosts.md): a series per flagged host only, at most metrics.max_hosts
    MetricSpec(
        "sdcwatch_host_verdict",
        "gauge",
        ("host", "verdict"),
        "1 for each host the service judges suspect or quarantine from the evidence of several runs, worst "
        "first, at most metrics.max_hosts (clean and cleared hosts have no series; `sdcwatch hosts` lists all).",
    ),
    MetricSpec("sdcwatch_hosts_tracked", "gauge", (), "Hosts whose evidence across runs the service keeps."),
    MetricSpec("sdcwatch_hosts_suspect", "gauge", (), "Hosts judged suspect or quarantine."),
    # ingest pipeline
    MetricSpec("sdcwatch_pipeline_records_total", "counter", (), "Telemetry records the service has consumed."),
    MetricSpec("sdcwatch_pipeline_records_per_second", "gauge", (), "Recent rate of consumed telemetry records."),
    MetricSpec(
        "sdcwatch_pipeline_consumer_lag_records",
        "gauge",
        (),
        "Records between the consumer position and the end of the telemetry topic.",
    ),
    MetricSpec(
        "sdcwatch_pipeline_dead_letters_total", "counter", (), "Malformed records routed to the dead-letter topic."
    ),
    MetricSpec(
        "sdcwatch_state_write_errors_total",
        "counter",
        (),
        "State snapshots that could not be written (a full or read-only disk); detection goes on, each is retried.",
    ),
    MetricSpec(
        "sdcwatch_state_topic_refused_total",
        "counter",
        ("reason",),
        "State topic snapshots refused at start, by reason: older (the service wrote a newer one: a copy "
        "re-published), deleted (a tombstone of the manifest, which the service never writes) (see docs/service.md).",
    ),
    MetricSpec(
        "sdcwatch_auth_runs_refused_total",
        "counter",
        ("key", "reason"),
        "Messages refused because their key may not speak for their run or their envelope is not fresh, by key id "
        "and reason: run_name (not issued for it), bound (another key holds it), full (no binding free), unsigned, "
        "replayed (its number taken before), stale (an older start), future (a start ahead of the clock), unfresh "
        "(no start, from a key that sends them) (see docs/service.md).",
    ),
    MetricSpec(
        "sdcwatch_auth_redelivered_total",
        "counter",
        ("key",),
        "Signed messages read again at their place in the topic (a rebalance or a restart re-reads from the "
        "committed offset), taken again, by key id (at-least-once delivery, not refusals; see docs/service.md).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_dead_letters_by_reason_total",
        "counter",
        ("reason",),
        "Records routed to the dead-letter topic, by reason: malformed, unknown_version, empty, oversize, "
        "world, layers, layer_metrics, values, step_size, counter, name, step_jump, runs, unknown_schema "
        "(see docs/operating.md, Limits).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_consumer_partitions",
        "gauge",
        (),
        "Partitions of the telemetry topic this instance reads; 0 means evicted from its consumer group or "
        "waiting for a rebalance: nothing is processed.",
    ),
    MetricSpec(
        "sdcwatch_pipeline_consumer_rebalances_total",
        "counter",
        (),
        "Times the partitions this instance reads changed after it first joined its consumer group (another "
        "instance joined or left, or this one was evicted for polling too late: records may be read again).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_messages_waiting_for_schema",
        "gauge",
        (),
        "Wire v2 messages held until the message carrying their record layout comes (at most "
        "detectors.schema_wait_s, then dead-lettered as unknown_schema).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_offset_gaps_total",
        "counter",
        ("outcome",),
        "Gaps in a telemetry partition's offsets: refetched (times the reader went back to one), filled (the "
        "missing messages came), skipped (taken as real after the gap wait; their messages were not read).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_runs",
        "gauge",
        (),
        "Runs whose detection state the service keeps (at most detectors.max_runs).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_runs_forgotten_total",
        "counter",
        (),
        "Runs that gave way to new ones within detectors.max_runs (on probation and silent, training and silent "
        "run_yield_idle_s, or unsigned to a signed newcomer).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_duplicates_total", "counter", (), "Duplicate records (same run, step and rank) discarded."
    ),
    MetricSpec(
        "sdcwatch_pipeline_late_records_total",
        "counter",
        (),
        "Records that arrived after their step had closed, and were dropped.",
    ),
    MetricSpec(
        "sdcwatch_pipeline_world_changes_total",
        "counter",
        (),
        "Times a run's world size changed (its open steps were closed and alignment started over).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_incomplete_steps_total",
        "counter",
        (),
        "Steps closed without every rank's record (late or missing ranks).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_summaries_total",
        "counter",
        (),
        "Step summaries a temporal stage received from the spatial stage (scale-out).",
    ),
    MetricSpec(
        "sdcwatch_pipeline_summaries_late_total",
        "counter",
        (),
        "Step summaries that arrived after a later step had been judged, and were dropped.",
    ),
    MetricSpec(
        "sdcwatch_pipeline_last_record_age_seconds", "gauge", (), "Seconds since the service consumed its last record."
    ),
    MetricSpec(
        "sdcwatch_pipeline_last_step_age_seconds",
        "gauge",
        ("run",),
        "Seconds since the service completed the last step of the run.",
    ),
    MetricSpec(
        "sdcwatch_pipeline_runs_evicted_total",
        "counter",
        ("reason",),
        'Runs dropped from memory and /metrics: "finished" (end expiry after the end-of-run markers) '
        'or "idle" (no record for the idle expiry; their open incidents resolved).',
    ),
    MetricSpec(
        "sdcwatch_pipeline_late_ranks",
        "gauge",
        ("run",),
        "Ranks that missed the alignment deadline at the last closed step.",
    ),
    MetricSpec(
        "sdcwatch_emitter_dropped_records_total",
        "counter",
        ("run",),
        "Records the in-rank emitters dropped (buffer full or bus down), summed over ranks.",
    ),
    # the exporter itself
    MetricSpec(
        "sdcwatch_exporter_omitted",
        "gauge",
        ("what",),
        "Runs (what=runs) beyond metrics.max_runs, model pieces (what=pieces) beyond metrics.max_pieces, "
        "layers (what=layers, (piece, layer) pairs) beyond metrics.max_layers, summed over runs, and flagged "
        "hosts (what=hosts) beyond metrics.max_hosts, that have no series of their own at this scrape.",
    ),
    MetricSpec(
        "sdcwatch_exporter_view_errors_total",
        "counter",
        (),
        "Scrapes at which reading the service state failed (the scrape then shows only this).",
    ),
)


def catalogue(detector_metrics: Sequence[MetricSpec] = ()) -> tuple[MetricSpec, ...]:
    """Every family, in exposition order: the run's, then its detectors' (``detector_metrics``: the
    runs' ``detector_metrics``, or the registry's ``detector_metrics()``), then the service's."""
    return (*_RUN, *detector_metrics, *_SERVICE)


def metric(name: str, detector_metrics: Sequence[MetricSpec] = ()) -> MetricSpec:
    """The spec of ``name``; ``KeyError`` naming it when the catalogue has no such metric."""
    for spec in catalogue(detector_metrics):
        if spec.name == name:
            return spec
    raise KeyError(f"no metric {name!r} in the sdcwatch catalogue")
