"""`sdcwatch serve` as a subprocess against the real broker: detects, stops on SIGTERM, resumes."""

from __future__ import annotations

import re
import uuid

import pytest
from polling import step_until, wait_for
from serve_process import ServeProcess, Topics, metric, peek_events, run_cli, wait_metric
from simulated_nan import nan_run

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")


def wait_for_nonfinite_incident(bootstrap, topic, timeout):
    wait_for(
        lambda: any(e["kind"] == "nonfinite" for e in peek_events(bootstrap, topic)),
        timeout,
        f"a non-finite incident on {topic}",
        interval=0.25,
    )


def wait_taken(metrics_url, records, timeout=90.0):
    """Wait until the service has taken ``records`` distinct records (duplicates do not count)."""

    def taken(samples):
        return metric(samples, "sdcwatch_pipeline_records_total") - metric(
            samples, "sdcwatch_pipeline_duplicates_total"
        )

    wait_metric(
        metrics_url, lambda samples: taken(samples) >= records, timeout, f"the service to take {records} records"
    )


def test_serve_detects_stops_on_sigterm_and_resumes_without_repeating_alerts(bootstrap, tmp_path):
    torch.set_num_threads(1)
    tag = uuid.uuid4().hex[:8]
    topics = Topics.fresh(tag)
    group = f"serve-{tag}"
    state = tmp_path / "state"
    nan_step = 40
    serve = ServeProcess(bootstrap, topics, state, group=group, snapshot_interval_s=1)
    metrics_url = serve.wait_banner()
    run = nan_run(bootstrap, topics.telemetry, f"serve-{tag}", nan_step)
    emitters = run.emitters
    run.train(nan_step + 5)
    for em in emitters:
        assert em.flush(30)
    # the service has read every record sent, and the incident is on the anomalies topic
    wait_taken(metrics_url, sum(em.sent for em in emitters))
    wait_for_nonfinite_incident(bootstrap, topics.anomalies, 60)
    err = serve.stop()
    assert "stopped" in err
    assert (state / "pipeline-state.json").exists()
    first = serve.events()
    opened = [e for e in first if e["change"] == "opened"]
    nonfinite = [e for e in opened if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0]["first_step"] == nan_step
    assert nonfinite[0]["ranks"] == [2]  # the other ranks only saw the all-reduced NaN

    # restart: the same group and state; the ranks go on training (NaN persists in the model)
    serve = ServeProcess(bootstrap, topics, state, group=group, snapshot_interval_s=1)
    metrics_url = serve.wait_banner()
    assert "resumed" in serve.banner
    run.train(10)
    run.close()
    for em in emitters:
        em.close(30)
    # records_total is restored from the state, so this counts both lives of the service
    wait_taken(metrics_url, sum(em.sent for em in emitters))
    serve.stop()
    after = serve.events()
    opened_ids = [e["id"] for e in after if e["change"] == "opened"]
    assert len(opened_ids) == len(set(opened_ids)), "an incident was opened twice"
    assert [e["id"] for e in after if e["change"] == "opened" and e["kind"] == "nonfinite"] == [nonfinite[0]["id"]]


def test_serve_config_error_names_the_key(tmp_path):
    bad = tmp_path / "serve.toml"
    bad.write_text('[alerts]\nalertmanger_url = "http://am:9093"\n')
    out = run_cli("serve", "--config", str(bad))
    assert out.returncode == 2
    assert "alerts.alertmanger_url" in out.stderr and "alertmanager_url" in out.stderr
    out = run_cli("serve", "--metrics-port", "http")
    assert out.returncode == 2 and "metrics.port" in out.stderr


@pytest.mark.slow
def test_split_service_spatial_instances_share_the_steps_and_the_temporal_stage_names_the_rank(bootstrap, tmp_path):
    """Two spatial instances in one consumer group, one temporal instance, all as `sdcwatch serve`;
    the incident names the rank and, from the names the ranks sent, the module."""
    from sdcwatch.telemetry.wire.transports import ensure_topic

    torch.set_num_threads(1)
    tag = uuid.uuid4().hex[:8]
    topics = Topics.fresh(tag)
    summaries = ["--bus-summaries-topic", f"sum.{tag}"]
    group = f"split-{tag}"
    world, steps, nan_step = 4, 64, 50
    # four partitions; the run's step windows (key run/step//16) of "split" fall in partitions 2, 0, 2, 1,
    # so either assignment of two partitions each gives both spatial instances whole steps to do
    assert ensure_topic(bootstrap, topics.telemetry, 4)
    spatial = [
        ServeProcess(
            bootstrap,
            topics,
            tmp_path / f"spatial{i}",
            "--stage",
            "spatial",
            *summaries,
            group=group,
            metrics_port=0,
            snapshot_interval_s=1,
        )
        for i in range(2)
    ]
    temporal = ServeProcess(
        bootstrap, topics, tmp_path / "temporal", "--stage", "temporal", *summaries, group=group, snapshot_interval_s=1
    )
    for p in (*spatial, temporal):
        p.wait_banner()
    temporal_metrics = temporal.metrics_url
    for p in spatial:  # after the rebalance each spatial instance owns two partitions
        p.wait_line(lambda line: re.search(r"assigned partitions \[\d+, \d+\] ", line) is not None)

    run = nan_run(bootstrap, topics.telemetry, "split", nan_step, world, ranks_per_host=2)
    run.train(steps)
    run.close()
    assert [em.sent for em in run.emitters] == [steps] * world
    # consume, summarise, judge (slow machines take longer)
    wait_for_nonfinite_incident(bootstrap, topics.anomalies, 90)
    wait_metric(  # the last step read by the spatial stage (not still on the bus) before it stops
        temporal_metrics,
        lambda samples: metric(samples, "sdcwatch_training_last_step", run="split") >= steps - 1,
        90,
        "the last step through both stages",
    )
    for p in spatial:  # the spatial stage publishes what it holds on the way out
        p.terminate()
    outs = [p.stop() for p in spatial]
    published = []
    for out in outs:
        line = next(ln for ln in out.splitlines() if ln.startswith("sdcwatch serve: stopped"))
        published.append(int(line.split("; ")[1].split()[0]))
    assert min(published) > 0, f"one spatial instance did no steps: {published}"
    assert sum(published) >= steps  # a rebalance may redeliver a window; the temporal stage drops repeats

    wait_metric(
        temporal_metrics,
        lambda samples: metric(samples, "sdcwatch_pipeline_summaries_total") >= sum(published),
        60,
        f"the temporal stage to take the {sum(published)} published summaries",
    )
    outs.append(temporal.stop())
    assert f"after {sum(published)} step summaries" in outs[2]

    events = temporal.events()
    opened = [e for e in events if e["change"] == "opened"]
    nonfinite = [e for e in opened if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1, opened
    assert (nonfinite[0]["first_step"], nonfinite[0]["ranks"], nonfinite[0]["hosts"]) == (
        nan_step,
        [2],
        [run.host_of(2)],
    )
    # the ranks' layer names reached the spatial instances; the temporal stage names the module with them
    assert (nonfinite[0]["metric"], nonfinite[0]["layer"], nonfinite[0]["layer_name"]) == (
        "attn_logit_max",
        0,
        "blocks.0.attn",
    )
    assert "attn_logit_max of blocks.0.attn (layer 0) = nan on rank 2" in nonfinite[0]["message"]


def test_serve_with_guard_actions_publishes_decisions_to_the_control_topic(bootstrap, tmp_path):
    """[guard] actions = true wires the policy's sink; an incident becomes one decision that the
    training side's reader (KafkaControl) decodes; with the default config there is no such sink."""
    from sdcwatch.core.incident import Incident, IncidentEvent, Severity
    from sdcwatch.exporters.topics import ControlTopicSink
    from sdcwatch.telemetry.guard.control_topic import KafkaControl

    from sdcwatch.config import load_config
    from sdcwatch.serve import build_service

    topic = f"control.{uuid.uuid4().hex[:8]}"
    base = {
        "bus.bootstrap": bootstrap,
        "metrics.port": 0,
        "state.dir": str(tmp_path / "s"),
        "alerts.log": False,
        "bus.telemetry_topic": f"t.{uuid.uuid4().hex[:8]}",
        "bus.control_topic": topic,
    }
    plain, _ = build_service(load_config(overrides=base, env={}))
    assert not any(isinstance(s, ControlTopicSink) for s in plain.sinks)
    plain.close()
    service, _ = build_service(
        load_config(overrides={**base, "guard.actions": True, "guard.on_silent_drift": "evict"}, env={})
    )
    (sink,) = [s for s in service.sinks if isinstance(s, ControlTopicSink)]
    assert sink.policy.actions and sink.policy.on_silent_drift == "evict"
    reader = KafkaControl(bootstrap, "r1", topic)
    got, attempts = [], []

    def publish_and_poll():
        # the reader starts at the end of the topic once it reached it: one incident (on a rank of its
        # own) an attempt, until its decision arrives
        rank = 5 + len(attempts)
        attempts.append(rank)
        name = f"r1:silent_drift:40:r{rank}"
        inc = Incident(name, "r1", "silent_drift", Severity.WARNING, 40, 45, "drift", ranks=(rank,), hosts=("h2",))
        service._publish([IncidentEvent("opened", inc), IncidentEvent("updated", inc)])
        for s in service.sinks:
            s._flush()
        got.extend(reader.poll())
        return got

    try:
        wait_for(publish_and_poll, 30, "the decision on the control topic", interval=0.5)
        first = attempts.index(got[0].ranks[0])
        wait_for(lambda: got.extend(reader.poll()) or len(got) >= len(attempts) - first, 30, "every later decision")
        assert [(d.action, d.hosts, d.since_step) for d in got] == [("evict", ("h2",), 40)] * len(got)
        # one decision an incident (its update repeats none), in the order published, from the first read on
        assert [d.ranks[0] for d in got] == attempts[first:]
    finally:
        reader.close()
        service.close()


def test_schema_wait_from_the_environment_holds_a_v2_message_and_shows_it_on_metrics(bootstrap, tmp_path):
    """``SDCWATCH_DETECTORS_SCHEMA_WAIT_S``: a v2 message whose schema has not come yet waits that
    long (here past the 2 s default), counted by the waiting gauge, and decodes once its schema comes."""
    import time

    import numpy as np
    from kafka import KafkaProducer
    from sdcwatch.core.columnar import encode_rows
    from sdcwatch.core.record_layout import schema_for
    from sdcwatch.exporters.collector import SdcwatchCollector
    from sdcwatch.telemetry.wire.transports import ensure_topic

    from sdcwatch.config import load_config
    from sdcwatch.serve import build_service

    topic = f"t.{uuid.uuid4().hex[:8]}"
    cfg = load_config(
        overrides={
            "bus.bootstrap": bootstrap,
            "metrics.port": 0,
            "state.dir": str(tmp_path / "s"),
            "alerts.log": False,
        },
        env={
            "SDCWATCH_DETECTORS_SCHEMA_WAIT_S": "30",
            "SDCWATCH_BUS_TELEMETRY_TOPIC": topic,
            "SDCWATCH_BUS_GROUP": f"g-{uuid.uuid4().hex[:8]}",  # not the group other tests' services left
        },
    )
    assert cfg.detectors.schema_wait_s == 30.0
    ensure_topic(bootstrap, topic, 1)
    service, _ = build_service(cfg, sinks=[])
    schema = schema_for(("loss",), (), [])

    def message(rank: int, with_schema: bool) -> bytes:
        rows = np.zeros(1, schema.dtype)
        rows["step"], rows["rank"], rows["world"], rows["time"] = 0, rank, 2, time.time()
        return encode_rows(schema, "r", ["h"], rows.tobytes(), 1, with_schema=with_schema)

    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        step_until(service.step, lambda: service.source.assigned, 30, "the source's partitions")
        producer.send(topic, key=b"r/1", value=message(1, with_schema=False)).get(10)
        t0 = time.monotonic()
        step_until(service.step, lambda: service.view().pipeline.waiting_for_schema, 20, "the message to wait")
        while time.monotonic() - t0 < 3.0:  # past the default wait of 2 s: the time is what is tested
            service.step()
        view = service.view()
        assert view.pipeline.waiting_for_schema == 1 and view.pipeline.dead_letters_total == 0
        text = "\n".join(
            f"{s.name} {s.value}" for fam in SdcwatchCollector(service.view).collect() for s in fam.samples
        )
        assert "sdcwatch_pipeline_messages_waiting_for_schema 1.0" in text
        producer.send(topic, key=b"r/0", value=message(0, with_schema=True)).get(10)
        step_until(service.step, lambda: service.pipeline.records_total >= 2, 30, "both records")
        assert service.pipeline.records_total == 2
        assert service.view().pipeline.waiting_for_schema == 0
    finally:
        producer.close()
        service.close()
