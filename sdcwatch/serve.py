"""``sdcwatch serve``: the production detector service: Kafka in, incidents out (anomalies topic,
Alertmanager, webhook, log), /metrics for Prometheus, state snapshots so a restart resumes without
a new warm-up or a repeated alert; Ctrl-C or SIGTERM stop it after a final snapshot.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sdcwatch.config import ServeConfig, add_serve_arguments, config_from_args
from sdcwatch.core.errors import TransportError

__all__ = ["build_service", "serve_main", "reset_state"]

log = logging.getLogger("sdcwatch.serve")


def build_service(
    cfg: ServeConfig,
    *,
    sinks: Sequence[Any] | None = None,
    extra_sinks: Sequence[Any] = (),
    wrap_source: Callable[[Any], Any] | None = None,
    poll_timeout: float = 0.2,
    state_reset: bool = False,
) -> tuple[Any, Any | None]:
    """The service and its metrics server (None when ``metrics.port`` is 0, not started), from a config:
    ``sdcwatch serve``'s, the demo's and the end-to-end benchmark's. ``sinks`` replaces the incident
    sinks the config names, ``extra_sinks`` are added to them; ``wrap_source`` wraps the Kafka source;
    ``state_reset``: start afresh, not from the state topic's snapshot."""
    from sdcwatch.exporters.topics import SummaryTopicSink
    from sdcwatch.service.loop import DetectorService
    from sdcwatch.service.summary import encode_summary

    changelog = _changelog(cfg)
    pipeline, resumed, taken = _pipeline(cfg, None if state_reset else changelog)  # a damaged state fails here
    auth = _authenticator(cfg)  # an unreadable key file too
    source = _source(cfg, auth)
    if taken is not None and taken.schemas:  # the record layouts the snapshot's writer had learnt
        source.schemas.restore(taken.schemas)
    if wrap_source is not None:
        source = wrap_source(source)
    summary_sink = None
    if cfg.detectors.stage == "spatial":  # incidents come from the temporal stage
        summary_sink = SummaryTopicSink.to_kafka(
            cfg.bus.bootstrap, cfg.bus.summaries_topic, encode=encode_summary, **cfg.bus.security
        )
        chosen: list[Any] = []
    else:
        chosen = list(sinks) if sinks is not None else _incident_sinks(cfg, pipeline, auth)
    service = DetectorService(
        source,
        pipeline,
        sinks=[*chosen, *extra_sinks],
        summary_sink=summary_sink,
        state_dir=cfg.state.dir,
        snapshot_every=cfg.state.snapshot_interval_s,
        poll_timeout=poll_timeout,
        resumed=resumed,
        changelog=changelog,
        taken=taken,
    )
    return service, _metrics_server(cfg, service)


def _changelog(cfg: ServeConfig) -> Any | None:
    """The state topic ``state.topic`` names, keyed by the consumer group and the stage; None when off."""
    if not cfg.state.topic:
        return None
    from sdcwatch.service.changelog import StateChangelog

    temporal = cfg.detectors.stage == "temporal"
    group = f"{cfg.bus.group}.temporal" if temporal else cfg.bus.group
    keyring = cfg.auth.keyring()  # with job keys, the service signs its snapshots with a key of its own
    return StateChangelog(
        cfg.bus.bootstrap,
        cfg.state.topic,
        group=group,
        stage=cfg.detectors.stage,
        security=cfg.bus.security,
        key=keyring.service_key("state") if keyring is not None else None,
        source_topic=cfg.bus.summaries_topic if temporal else cfg.bus.telemetry_topic,  # its offsets date a snapshot
    )


def _created_telemetry_topic(cfg: ServeConfig) -> bool:
    """Create the telemetry topic as the emitters would (4 partitions) when it does not exist yet;
    whether this instance did. Then no instance of its group held it before: this one stays when
    another, started as it was joining, shares its group (the other leaves, as a newcomer does)."""
    from kafka.admin import NewTopic
    from kafka.errors import KafkaError

    from sdcwatch.core.kafka import new_admin

    try:
        admin = new_admin(
            cfg.bus.bootstrap,
            cfg.bus.security,
            request_timeout_ms=10_000,
            bootstrap_timeout_ms=int(cfg.bus.connect_timeout_s * 1000),
        )
        try:
            admin.create_topics([NewTopic(cfg.bus.telemetry_topic, 4, 1)])
        finally:
            admin.close()
    except (KafkaError, OSError, ValueError) as exc:  # it exists, or may not be created here: not the first
        log.debug("telemetry topic %s not created: %s", cfg.bus.telemetry_topic, exc)
        return False
    log.info("created the telemetry topic %s (4 partitions)", cfg.bus.telemetry_topic)
    return True


def _pipeline(cfg: ServeConfig, changelog: Any = None) -> tuple[Any, bool, Any]:
    """The pipeline ``[detectors]`` and ``[limits]`` describe with its saved state (from ``state.dir``
    or a newer snapshot on the state topic); whether there was one; the topic's snapshot, if used."""
    from sdcwatch.detectors.registry import default_detectors
    from sdcwatch.service.changelog import resume_state
    from sdcwatch.service.loop import STATE_FILE
    from sdcwatch.service.pipeline import DetectionPipeline

    configs = cfg.detectors.detector_configs()
    pipeline = DetectionPipeline(
        cfg.detectors,  # the [detectors] section is the pipeline's settings
        stage=cfg.detectors.stage,
        detectors=lambda: default_detectors(configs),
        limits=cfg.limits.record_limits(),
        hosts=cfg.hosts,  # the [hosts] section is the host ledger's settings
    )
    origin, snap = resume_state(pipeline, Path(cfg.state.dir) / STATE_FILE, changelog)
    if snap is not None:
        print(
            f"sdcwatch serve: resuming from state topic {changelog.topic} (snapshot {snap.snapshot}, written "
            f"{max(0.0, time.time() - snap.written_at):.1f} s ago, {pipeline.records_total} records)",
            file=sys.stderr,
            flush=True,
        )
    return pipeline, origin is not None, snap


def _authenticator(cfg: ServeConfig) -> Any | None:
    """The [auth] keys as an Authenticator (verifies telemetry, binds runs to keys), None when off."""
    keyring = cfg.auth.keyring()
    if keyring is None:
        return None
    from sdcwatch.service.auth import Authenticator

    log.info(
        "auth: verifying telemetry with key(s) %s; unsigned messages: %s", ", ".join(keyring.kids), cfg.auth.unsigned
    )
    auth = Authenticator(keyring, unsigned=cfg.auth.unsigned)
    auth.warn_unrestricted()
    return auth


def _source(cfg: ServeConfig, auth: Any = None) -> Any:
    """The Kafka source of the stage: step summaries for a temporal stage, else telemetry."""
    from sdcwatch.service.bus import decode_summary_message
    from sdcwatch.service.ingest import IngestDecoder, SchemaRegistry
    from sdcwatch.service.kafka_source import KafkaSource

    bus = cfg.bus
    common = dict(deadletter_topic=bus.deadletter_topic, connect_timeout=bus.connect_timeout_s, **bus.security)
    if cfg.detectors.stage == "temporal":
        return KafkaSource(
            bus.bootstrap,
            bus.summaries_topic,
            group=f"{bus.group}.temporal",
            decode=decode_summary_message,
            sole_member_after_s=bus.share_timeout_s or None,
            **common,
        )
    limits = cfg.limits.record_limits()
    sharing = bool(bus.share_timeout_s) and cfg.detectors.stage == "both"  # stage both checks its group is its own
    return KafkaSource(
        bus.bootstrap,
        bus.telemetry_topic,
        group=bus.group,
        limits=limits,
        sole_member_after_s=bus.share_timeout_s if sharing else None,
        first_member=sharing and _created_telemetry_topic(cfg),
        ingest=IngestDecoder(SchemaRegistry(limits), auth=auth, schema_wait=cfg.detectors.schema_wait_s),
        **common,
    )


def _incident_sinks(cfg: ServeConfig, pipeline: Any, auth: Any = None) -> list[Any]:
    """Where the config sends incident changes: the anomalies topic, then Alertmanager, the
    webhook, the log and the training jobs' guards, each when configured."""
    from sdcwatch.exporters import AlertmanagerSink, LogSink, WebhookSink
    from sdcwatch.exporters.topics import AnomalyTopicSink, ControlTopicSink
    from sdcwatch.service.checkpoint_marks import CertifiedPolicy

    bus, alerts = cfg.bus, cfg.alerts
    key = auth.keyring.service_key("anomalies") if auth is not None else None  # readers believe only it
    chosen: list[Any] = [AnomalyTopicSink.to_kafka(bus.bootstrap, bus.anomalies_topic, key=key, **bus.security)]
    if alerts.alertmanager_url:
        chosen.append(AlertmanagerSink(alerts.alertmanager_url, timeout=alerts.timeout_s))
    if alerts.webhook_url:
        chosen.append(WebhookSink(alerts.webhook_url, timeout=alerts.timeout_s))
    if alerts.log:
        chosen.append(LogSink())
    if cfg.guard.actions:  # the loop back to the training jobs' guards
        # a rollback names the newest clean checkpoint before the incident
        policy = CertifiedPolicy.around(cfg.guard.policy(), pipeline.checkpoints)
        keys = auth.key_of if auth is not None else None  # each run's decisions signed with its key
        nonces = auth.nonce_of if auth is not None else None  # ... for the start the run announced last
        chosen.append(
            ControlTopicSink.to_kafka(
                bus.bootstrap, bus.control_topic, policy=policy, keys=keys, nonces=nonces, **bus.security
            )
        )
    return chosen


def _metrics_server(cfg: ServeConfig, service: Any) -> Any | None:
    """The /metrics server of ``service`` (not started), or None when ``metrics.port`` is 0."""
    from sdcwatch.exporters.server import MetricsServer

    if not cfg.metrics.enabled:
        return None
    return MetricsServer(
        functools.partial(service.view, max_runs=cfg.metrics.max_runs),
        address=cfg.metrics.address,
        port=cfg.metrics.port,
        top_k=cfg.metrics.top_k,
        max_layers=cfg.metrics.max_layers,
        max_pieces=cfg.metrics.max_pieces,
        max_hosts=cfg.metrics.max_hosts,
    )


def reset_state(state_dir: Path) -> Path | None:
    """Move the state file out of the way (renamed, never deleted), and the snapshot before it, which a
    start without the file would resume from; returns where the state file went."""
    from sdcwatch.service.loop import STATE_FILE
    from sdcwatch.service.statefile import previous_state

    path = Path(state_dir) / STATE_FILE
    prev = previous_state(path)
    if prev.exists() or prev.is_symlink():
        prev_aside = prev.with_name(f"{prev.name}.bad-{time.strftime('%Y%m%dT%H%M%S')}")
        os.replace(prev, prev_aside)
        print(f"sdcwatch serve: --state-reset: moved {prev} to {prev_aside}", file=sys.stderr)
    if not path.exists() and not path.is_symlink():
        print(f"sdcwatch serve: --state-reset: no state file at {path}; starting afresh", file=sys.stderr)
        return None
    aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    print(f"sdcwatch serve: --state-reset: moved {path} to {aside}; starting afresh", file=sys.stderr)
    return aside


def _leave_while_connecting(signum: int, frame: Any) -> None:
    """Ctrl-C before the service runs: nothing was read, so there is nothing to save; exit 130."""
    os.write(2, b"sdcwatch serve: interrupted while connecting to Kafka\n")
    os._exit(130)


def serve_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="sdcwatch serve",
        description="Run the sdcwatch detector service: Kafka in, incidents out to the anomalies topic, "
        "Alertmanager, a webhook and the log; /metrics for Prometheus. Settings come from "
        "flags, the environment (SDCWATCH_<SECTION>_<KEY>) and a TOML file, in that order of "
        "precedence.",
    )
    add_serve_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument(
        "--state-reset",
        action="store_true",
        help="move the state file and the snapshot before it aside (kept as pipeline-state.json.bad-<time> "
        "and pipeline-state.json.prev.bad-<time>) and start without them, nor the state topic's snapshot (the "
        "next snapshot replaces it): the way out of a damaged state file; detectors warm up again. A refused "
        "or damaged topic snapshot alone needs no reset: a good state file is taken instead, and logged",
    )
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.INFO if args.verbose else logging.WARNING)
    logging.getLogger("sdcwatch.incidents").setLevel(logging.INFO)
    logging.getLogger("sdcwatch.detectors").setLevel(logging.INFO)  # partition assignments
    cfg = config_from_args(args)
    cfg.state.dir.mkdir(parents=True, exist_ok=True)
    if args.state_reset:
        reset_state(cfg.state.dir)

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.warning("received %s: stopping after a final snapshot", signal.Signals(signum).name)
        stop.set()

    # each client gives up on an unreachable bus after bus.connect_timeout_s (--connect-timeout, 30 s):
    # say what is being waited for, and leave at once on Ctrl-C (nothing was read yet; a
    # KeyboardInterrupt could wait out the client's clean-up); once the service runs, Ctrl-C and
    # SIGTERM stop it after a final snapshot.
    print(f"sdcwatch serve: connecting to Kafka at {cfg.bus.bootstrap}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, _leave_while_connecting)
    try:
        service, metrics = build_service(cfg, state_reset=args.state_reset)
    except TransportError as exc:
        local = "`sdcwatch broker` starts one on 127.0.0.1:9092"
        raise TransportError(f"{exc} (is a broker running there? For a trial on one machine, {local})") from None
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if metrics is not None:
        metrics.start()
    resumed = " (resumed from the saved state)" if getattr(service, "resumed", False) else ""
    stage = cfg.detectors.stage
    topic, group = (
        (cfg.bus.summaries_topic, f"{cfg.bus.group}.temporal")
        if stage == "temporal"
        else (cfg.bus.telemetry_topic, cfg.bus.group)
    )
    out = f"; step summaries to {cfg.bus.summaries_topic}" if stage == "spatial" else ""
    print(
        f"sdcwatch serve: consuming {topic} from {cfg.bus.bootstrap} as group {group}{out}{resumed}; "
        f"stage {stage}; metrics {metrics.url if metrics else 'off'}; state in {cfg.state.dir}",
        file=sys.stderr,
        flush=True,
    )
    try:
        service.run_forever(stop)  # closes (final snapshot) on the way out
    finally:
        if metrics is not None:
            metrics.close()
    pipe = service.pipeline
    done = (
        f"{service.summary_sink.published} step summaries published"
        if service.summary_sink is not None
        else f"{service.events_published} incident changes published"
    )
    taken = f"{pipe.summaries_total} step summaries" if stage == "temporal" else f"{pipe.records_total} records"
    print(f"sdcwatch serve: stopped after {taken}; {done}", file=sys.stderr, flush=True)
    return 0
