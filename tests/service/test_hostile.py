"""Hostile input and faults: one record must never stop, blind or crash the service.

The integration test runs every attack an attacker with write access to the telemetry topic can
mount against one real ``sdcwatch serve`` process and the real broker, then checks that the
service is up, its memory bounded, each bad record dead-lettered and counted with its reason, and
that a good run sent around the attacks is still processed and its NaN still found. The other
tests cover the faults that need no broker (state files, report, replay, config, emitter).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from polling import returns, step_until, wait_for
from sdcwatch.telemetry import Emitter, KafkaTransport, Record, encode
from serve_process import ServeProcess, Topics, metric, peek_topic, rank_emitters, run_cli, scrape, wait_metric

from sdcwatch.broker import free_port

#: Run names of the flood beyond the 1,000 runs the service keeps (victim, deep, the longest name and 997 of them).
FLOOD_PAST_ROOM = 15_000 - 997
#: Peak resident memory the service may reach during the whole attack (measured: see docs/operating.md).
RSS_BOUND_MIB = 512


# ---------------------------------------------------------------------------------------------
# the real service and broker


def _serve(bootstrap, topics, state_dir, group, *flags) -> ServeProcess:
    """The service under attack, started: snapshots every second, a short align timeout."""
    serve = ServeProcess(
        bootstrap, topics, state_dir, "--detectors-align-timeout-s", "2", *flags, group=group, snapshot_interval_s=1
    )
    serve.wait_banner()
    return serve


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _rec(run="attack", step=0, rank=0, world=4, **kw) -> bytes:
    return encode(
        Record(
            run, step, rank, world, "evil", time.time(), 0, kw.pop("scalars", {"loss": 1.0}), {}, kw.pop("layers", {})
        )
    )


def _victim_steps(emitters, steps, nan_step=None):
    for step in steps:
        for em in emitters:
            loss = math.nan if step == nan_step and em.rank == 2 else 2.0 + 0.01 * ((step * 7 + em.rank) % 5)
            em.emit(
                step,
                loss=loss,
                grad_norm_local=1.0 + 0.01 * em.rank,
                grad_norm_global=1.0,
                layers={"attn_entropy": [1.5, 1.6]},
            )
        time.sleep(0.01)
    for em in emitters:
        assert em.flush(60)


@pytest.mark.integration
@pytest.mark.slow
def test_every_attack_on_one_real_service_is_dead_lettered_counted_and_survived(bootstrap, tmp_path):
    from kafka import KafkaProducer

    tag = uuid.uuid4().hex[:8]
    topics = Topics.fresh(tag)
    group, state = f"hostile-{tag}", tmp_path / "state"
    # the admission settings are the defaults: the victim's first 20 steps come in a burst (still on
    # probation), and the flood, runs that have shown less, never takes its place while it is silent
    serve = _serve(bootstrap, topics, state, group, "--limits-max-message-bytes", "1500000")
    url = serve.metrics_url
    try:
        emitters = rank_emitters(bootstrap, topics.telemetry, "victim")
        _victim_steps(emitters, range(20))
        wait_metric(
            url,
            lambda samples: metric(samples, "sdcwatch_training_last_step", run="victim") >= 19,
            60,
            "the victim run's first 20 steps",
        )

        attacker = KafkaProducer(bootstrap_servers=[bootstrap], max_request_size=4 << 20, linger_ms=20)
        send = lambda value, key=b"evil": attacker.send(topics.telemetry, key=key, value=value)  # noqa: E731
        expected = {  # reason -> dead letters
            "world": 2,
            "layers": 1,
            "layer_metrics": 1,
            "values": 1,
            "step_size": 1,
            "name": 1,
            "counter": 4,
            "oversize": 1,
            "malformed": 1,
            "step_jump": 1,
        }
        send(_rec(world=10**9))  # 16.1: 7.45 GiB at the align timeout before
        send(_rec(world=2_000_000))  # 16.1: 7-8 s snapshots, 19 s scrapes before
        send(_rec(world=1000, layers={f"m{i}": [0.5] * 65_535 for i in range(3)}))  # 16.1: 5 GB before
        send(_rec(layers={f"m{i}": [0.5] for i in range(40)}))
        send(_rec(layers={f"m{i}": [0.5] * 1000 for i in range(9)}))
        send(_rec(world=131_072, layers={f"m{i}": [0.5] * 100 for i in range(3)}))
        send(_rec(run="r" * 2000))  # 16.4: restart crash loop before
        send(_rec(run="n" * 1024, world=1))  # the longest name is fine, at decode and at restore
        for rank in range(4):  # 16.5: all of /metrics blank before
            send(_rec(run="overflow", rank=rank, scalars={"loss": 1.0, "emitter_dropped": 1e308}))
        send(b"SDCW" + os.urandom(2_000_000))  # 16.7: over 1 MB, lost before
        send(b"\x00not a record")
        send(_rec(run="victim", step=2**62, world=4))  # 16.3: blinded the run before
        deep = {f"m{i}": [0.1 * (layer % 7) for layer in range(1000)] for i in range(7)}
        for rank in range(2):  # a deep model: 1,000 layers x 7 metrics, within the limits
            send(_rec(run="deep", rank=rank, world=2, layers=deep))
        attacker.flush(60)
        wait_metric(
            url, lambda samples: metric(samples, "sdcwatch_pipeline_runs") >= 3, 60, "the deep run and the longest name"
        )
        for i in range(15_000):  # 16.6: 285,085 series and 7-28 s scrapes before
            send(_rec(run=f"flood-{i}", world=1), key=f"flood-{i}".encode())
        attacker.flush(60)
        wait_metric(
            url,
            lambda samples: (
                metric(samples, "sdcwatch_pipeline_dead_letters_by_reason_total", reason="runs")
                + metric(samples, "sdcwatch_pipeline_runs_forgotten_total")
                >= FLOOD_PAST_ROOM
            ),
            120,
            "the flood of run names to be read (waiting, then taking turns in the places on probation)",
        )
        for rank in range(2):  # the deep run goes on after the flood, with a NaN: an open incident puts
            # it among the runs /metrics shows (those alerting first, then the most recently active:
            # the flood's runs take turns in the places after it)
            loss = math.nan if rank == 0 else 1.0
            send(_rec(run="deep", step=1, rank=rank, world=2, layers=deep, scalars={"loss": loss}))
        attacker.flush(60)
        attacker.close()

        # 16.13: twenty scrapers at once while the good run goes on
        answered: list[int] = []  # how long a scrape takes under the flood is bench/bench_flood.py's
        stop = threading.Event()

        def scraper():
            while not stop.is_set():
                urllib.request.urlopen(url, timeout=60).read()
                answered.append(1)

        scrapers = [threading.Thread(target=scraper, daemon=True) for _ in range(20)]
        for th in scrapers:
            th.start()
        _victim_steps(emitters, range(20, 60), nan_step=40)
        for em in emitters:
            em.close(10)
        wait_metric(
            url,
            lambda samples: metric(samples, "sdcwatch_training_last_step", run="victim") >= 59,
            120,
            "the victim run's steps after the attack",
        )
        stop.set()
        for th in scrapers:
            th.join(60)

        # the NaN after the attack is found, on its rank and step
        wait_for(
            lambda: any(e["kind"] == "nonfinite" and e["run"] == "victim" for e in serve.events()),
            60,
            "the victim's non-finite incident",
            interval=0.25,
            retry_on=OSError,
        )
        incidents = serve.events()
        nonfinite = [e for e in incidents if e["kind"] == "nonfinite" and e["run"] == "victim"]
        assert (nonfinite[0]["first_step"], nonfinite[0]["ranks"]) == (40, [2])

        # every bad record counted with its reason
        wait_metric(
            url,
            lambda samples: all(
                metric(samples, "sdcwatch_pipeline_dead_letters_by_reason_total", reason=r) >= n
                for r, n in expected.items()
            ),
            60,
            "every dead letter to be counted",
        )
        samples = scrape(url)
        got = {r: metric(samples, "sdcwatch_pipeline_dead_letters_by_reason_total", reason=r) for r in expected}
        assert got == expected
        # the names past the service's 1,000 runs (victim, deep, the longest name and 997 more) wait
        # and take turns in the places of runs on probation silent for 2 s (each then forgotten);
        # dead-lettered (runs) only past the 50,000 records that may wait
        refused = metric(samples, "sdcwatch_pipeline_dead_letters_by_reason_total", reason="runs")
        assert refused + metric(samples, "sdcwatch_pipeline_runs_forgotten_total") >= FLOOD_PAST_ROOM
        assert metric(samples, "sdcwatch_pipeline_dead_letters_total") == sum(expected.values()) + refused
        assert metric(samples, "sdcwatch_pipeline_late_records_total") >= 0
        assert metric(samples, "sdcwatch_pipeline_consumer_partitions") > 0  # 16.2: never evicted
        assert [s.value for s in samples if s.name == "sdcwatch_pipeline_consumer_rebalances_total"] == [0.0]
        assert not [ln for ln in serve.lines if "lost its partitions" in ln]
        # 16.5: /metrics is whole: the good run's series are there
        assert metric(samples, "sdcwatch_training_loss", run="victim") > 0
        # 16.6: series bounded by run and by layer, whatever came in
        wait_metric(
            url,
            lambda samples: {"victim", "deep"} <= {s.labels["run"] for s in samples if "run" in s.labels},
            60,
            "the deep run given a place and shown",
        )
        samples = scrape(url)
        runs = {s.labels["run"] for s in samples if "run" in s.labels}
        assert len(runs) <= 20 and {"victim", "deep"} <= runs
        assert metric(samples, "sdcwatch_exporter_omitted", what="runs") >= 900
        assert metric(samples, "sdcwatch_exporter_omitted", what="layers") == 1000 - 128
        assert metric(samples, "sdcwatch_pipeline_runs") == 1000
        assert len(samples) < 8000, len(samples)
        assert len(answered) >= 20, len(answered)  # every scraper was answered while the run went on
        # 16.7: the message over 1 MB is in the dead-letter topic, truncated, with its size and reason
        dead = peek_topic(bootstrap, topics.dead)
        big = [m for m in dead if dict(m.headers).get("sdcwatch.size") == b"2000004"]
        assert len(big) == 1 and len(big[0].value) == 64 * 1024
        assert dict(big[0].headers)["sdcwatch.truncated"] == b"true"
        assert dict(big[0].headers)["sdcwatch.reason_code"] == b"oversize"
        peak = _peak_rss_mib(serve.pid)
        print(f"\nhostile: peak RSS {peak:.0f} MiB, {len(samples)} series, {len(answered)} concurrent scrapes")
        assert peak < RSS_BOUND_MIB, peak
        assert serve.running(), serve.stderr()[-3000:]

        # 16.4 and 16.9: a clean stop writes the state; the next start loads it (no crash loop)
        serve.stop()
        serve = _serve(bootstrap, topics, state, group)
        assert "resumed" in serve.banner
        samples = serve.scrape()  # the state came back: the runs and the victim's incident
        assert metric(samples, "sdcwatch_pipeline_runs") == 1000
        assert metric(samples, "sdcwatch_incident_first_step", run="victim") == 40
    finally:
        serve.close()


@pytest.mark.integration
def test_a_slow_snapshot_does_not_evict_the_consumer_from_its_group(bootstrap, unique_topic, tmp_path):
    """16.2: a snapshot that takes longer than max_poll_interval_ms (6 s) once had the consumer
    evicted, its commits failing and the lag gauge at 0; now the reader keeps polling meanwhile."""
    from sdcwatch.service.kafka_source import KafkaSource
    from sdcwatch.service.loop import DetectorService
    from sdcwatch.service.pipeline import DetectionPipeline

    class SlowSave(DetectionPipeline):
        slow = True

        def save(self, path, state=None):
            if self.slow:
                self.slow = False
                time.sleep(8.0)
            super().save(path, state)

    emitter = Emitter(KafkaTransport(bootstrap, unique_topic), run="slow", rank=0, world=1)
    for step in range(10):
        emitter.emit(step, loss=1.0)
    assert emitter.flush(30)
    source = KafkaSource(
        bootstrap, unique_topic, group=f"g-{uuid.uuid4().hex[:8]}", deadletter_topic=f"{unique_topic}.dead"
    )
    service = DetectorService(source, SlowSave(), state_dir=tmp_path, snapshot_every=1.0, poll_timeout=0.2)
    try:
        step_until(service.step, lambda: service.pipeline.records_total >= 10, 60, "the records read")
        assert source.partitions > 0
        service.snapshot()  # 8 s on the service thread
        for step in range(10, 20):
            emitter.emit(step, loss=1.0)
        emitter.close(10)
        step_until(service.step, lambda: service.pipeline.records_total >= 20, 30, "the records read")
        assert service.pipeline.records_total == 20
        assert (source.partitions, source.rebalances) == (4, 0), "the member lost its partitions"
        service.snapshot()
        assert source.lag() == 0
    finally:
        service.close()


def test_records_past_the_limits_are_refused_at_decode_with_the_reason():
    """16.1, 16.4, 16.5: the limits in one place, checked at decode, named in the error."""
    from sdcwatch.core.errors import RecordError
    from sdcwatch.core.limits import LimitError, RecordLimits, reason_of
    from sdcwatch.core.messages import decode_message
    from sdcwatch.core.record import from_dict, to_dict

    limits = RecordLimits()
    cases = {
        "world": _rec(world=10**9),
        "layers": _rec(world=1000, layers={"m": [0.5] * 65_535}),
        "layer_metrics": _rec(layers={f"m{i}": [0.5] for i in range(33)}),
        "values": _rec(layers={f"m{i}": [0.5] * 1000 for i in range(9)}),
        "step_size": _rec(world=131_072, layers={f"m{i}": [0.5] * 100 for i in range(3)}),
        "counter": _rec(scalars={"emitter_dropped": 1e308}),
        "name": _rec(run="r" * 1025),
    }
    for reason, value in cases.items():
        with pytest.raises(LimitError) as err:
            decode_message(value, limits)
        assert reason_of(err.value) == reason, (reason, err.value)
    for bad in (math.inf, math.nan, -1.0):
        with pytest.raises(LimitError, match="counter must be finite"):
            decode_message(_rec(scalars={"emitter_dropped": bad}), limits)
    with pytest.raises(LimitError) as err:
        decode_message(b"x" * 100, RecordLimits(max_message_bytes=99))
    assert err.value.reason == "oversize"
    assert reason_of(RecordError("magic", "x")) == "malformed"
    # one rule for names at decode and at restore: the longest name that decodes also restores
    rec = decode_message(_rec(run="n" * 1024, world=1), limits)[0]
    assert from_dict(to_dict(rec)) == rec
    with pytest.raises(LimitError):
        from_dict({**to_dict(rec), "run": "n" * 1025})
    # the configuration reaches the same limits
    from sdcwatch.config import load_config

    cfg = load_config(env={"SDCWATCH_LIMITS_MAX_WORLD": "1000000"})
    assert cfg.limits.record_limits() == RecordLimits(max_world=1_000_000)
    with pytest.raises(Exception, match="limits.max_layers"):
        load_config(env={"SDCWATCH_LIMITS_MAX_LAYERS": "70000"})


def test_an_emitter_dropped_sum_past_float_range_does_not_blank_the_metrics():
    """16.5: counters that sum to infinity used to raise OverflowError in the view."""
    import numpy as np
    from sdcwatch.service.run_state import count_total as _count

    assert _count(np.array([1e308, 1e308, 1e308, 1e308])) == 2**53
    assert _count(np.array([np.nan, -5.0, 3.0, np.inf])) == 3


def test_a_step_far_ahead_is_set_aside_and_the_run_is_not_blinded():
    """16.3: one record at step 2**62 once made every later record late."""
    from detector_synth import SyntheticRun
    from memory_source import MemorySource
    from sdcwatch.service.loop import DetectorService
    from sdcwatch.service.pipeline import DetectionPipeline
    from sdcwatch.telemetry import MemoryBus, MemoryTransport

    bus = MemoryBus()
    synth = SyntheticRun(seed=1, world=4)
    tr = MemoryTransport(bus)
    clock = [0.0]
    service = DetectorService(
        MemorySource(bus), DetectionPipeline(clock=lambda: clock[0]), poll_timeout=0.001, clock=lambda: clock[0]
    )
    for s in range(30):
        tr.send(synth.records(s))
    for _ in range(5):
        service.step()
    bus.append("sdcwatch.telemetry", b"x", _rec(run=synth.records(0)[0].run, step=2**62, world=4))
    for _ in range(2):
        service.step()
    clock[0] += 10.0  # past the alignment timeout: the lone far step is judged
    for _ in range(2):
        service.step()
    assert service.source.dead_letter_reasons == {"step_jump": 1}
    bad = [r.scalars.get("loss") for r in synth.records(30)]
    records = synth.records(30)
    records[2] = Record(
        records[2].run,
        30,
        2,
        4,
        records[2].host,
        records[2].time,
        0,
        {**records[2].scalars, "loss": math.nan},
        records[2].fingerprints,
        records[2].layers,
    )
    tr.send(records)
    events = [e for _ in range(3) for e in service.step()]
    assert bad and any(e.incident.kind == "nonfinite" and e.incident.ranks == (2,) for e in events)
    assert service.pipeline.aligner.late_records == 0
    # a jump every rank makes (a restart from a later checkpoint) is taken
    jump = [
        Record(r.run, 500_000, r.rank, 4, r.host, r.time, 0, r.scalars, r.fingerprints, r.layers)
        for r in synth.records(31)
    ]
    tr.send(jump)
    for _ in range(2):
        service.step()
    clock[0] += 2.0  # a complete step out of order waits the reorder grace
    for _ in range(2):
        service.step()
    assert service.pipeline.aligner.last_closed(jump[0].run) == 500_000
    assert service.source.dead_letter_reasons == {"step_jump": 1}


@pytest.mark.parametrize(
    "content, fault",
    [
        (b"", "empty"),
        (b'{"version": 1, "aligner": {"ru', "not valid JSON"),
        (b'{"version": 1}', "structurally wrong (missing key 'aligner')"),
        (b"[1, 2]", "not an object"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_a_bad_state_file_is_one_clear_error_naming_the_file_and_the_way_out(tmp_path, content, fault):
    """16.9: raw KeyError/IsADirectoryError tracebacks before."""
    from sdcwatch.core.errors import ConfigError
    from sdcwatch.service.pipeline import DetectionPipeline

    path = tmp_path / "pipeline-state.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        DetectionPipeline().load(path)
    assert str(path) in str(err.value) and fault in str(err.value) and "--state-reset" in str(err.value)


def test_state_writes_keep_the_previous_snapshot_and_a_folder_is_named(tmp_path):
    from sdcwatch.core.errors import ConfigError
    from sdcwatch.service.pipeline import DetectionPipeline
    from sdcwatch.service.statefile import previous_state

    path = tmp_path / "pipeline-state.json"
    pipe = DetectionPipeline()
    pipe.save(path)
    pipe.records_total = 7
    pipe.save(path)
    assert json.loads(previous_state(path).read_text())["records_total"] == 0
    assert json.loads(path.read_text())["records_total"] == 7
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "pipeline-state.json").mkdir()
    with pytest.raises(ConfigError, match="is a folder, not a state file"):
        DetectionPipeline().load(tmp_path / "dir" / "pipeline-state.json")


def test_serve_with_a_damaged_state_exits_clearly_and_starts_with_state_reset(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "pipeline-state.json").write_text('{"version": 1, "aligner"')
    serve = ServeProcess(f"127.0.0.1:{free_port()}", Topics.fresh(), state, metrics_port=0)
    assert serve.wait(120) == 2 and "Traceback" not in serve.stderr()
    assert "pipeline-state.json" in serve.stderr() and "--state-reset" in serve.stderr()
    from sdcwatch.serve import reset_state

    aside = reset_state(state)
    assert aside is not None and aside.exists() and not (state / "pipeline-state.json").exists()


def test_a_misspelt_environment_section_stops_serve_naming_the_variable():
    """16.8: SDCWATCH_METRIC_PORT was silently ignored."""
    out = run_cli("serve", env={**os.environ, "SDCWATCH_METRIC_PORT": "9999"})
    assert out.returncode == 2 and "SDCWATCH_METRIC_PORT" in out.stderr and "SDCWATCH_METRICS_PORT" in out.stderr


def test_credentials_in_the_alertmanager_url_are_sent_as_basic_auth_and_never_logged(caplog):
    """16.8: the URL's user info was logged on every retry."""
    import base64
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from sdcwatch.core.errors import DeliveryError
    from sdcwatch.exporters.delivery import post_json

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    port = server.server_address[1]
    assert post_json(f"http://ops:s%40cret@127.0.0.1:{port}/api/v2/alerts", b"[]", 5) == 200
    server.server_close()
    assert seen == ["Basic " + base64.b64encode(b"ops:s@cret").decode()]
    with pytest.raises(DeliveryError) as err:
        post_json(f"http://ops:hunter2@127.0.0.1:{free_port()}/api/v2/alerts", b"[]", 2)
    assert "hunter2" not in str(err.value) and "ops:***@127.0.0.1" in str(err.value)


def test_report_escapes_and_type_checks_incident_fields(tmp_path):
    """16.10: "peak_step": "<script>..." was written into the page raw."""
    from sdcwatch.core.errors import ReplayError

    from sdcwatch.report.data import load_incidents

    bad = tmp_path / "incidents.jsonl"
    bad.write_text(
        json.dumps(
            {
                "kind": "nonfinite",
                "severity": "critical",
                "message": "m",
                "first_step": 1,
                "last_step": 3,
                "peak_step": "<script>alert(1)</script>",
            }
        )
        + "\n"
    )
    with pytest.raises(ReplayError, match="'peak_step' must be an integer"):
        load_incidents(bad)


def test_replay_bounds_lines_and_columns_with_a_clear_error(tmp_path):
    """16.11: a 1 GiB CSV line took 2-4 GB; a huge header raised an uncaught _csv.Error."""
    import resource

    from sdcwatch.core.errors import ReplayError
    from sdcwatch.service.offline import MAX_LINE_BYTES, replay

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    long_line = tmp_path / "long.csv"
    with open(long_line, "w") as fh:
        fh.write("step,loss\n0,1.0\n")
        fh.write("1,")
        chunk = "9" * (1 << 20)
        for _ in range(64):  # 64 MiB in one line (written in pieces: the test must not hold it either)
            fh.write(chunk)
        fh.write("\n")
    with pytest.raises(ReplayError, match="line longer than"):
        replay(long_line)
    huge_header = tmp_path / "header.csv"
    huge_header.write_text("step,loss," + "x" * (200 << 10) + "\n0,1.0,2\n")  # a 200 kB header field
    with pytest.raises(ReplayError, match="header"):
        replay(huge_header)
    wide = tmp_path / "wide.csv"
    wide.write_text("step,loss," + ",".join(f"c{i}" for i in range(5000)) + "\n")
    with pytest.raises(ReplayError, match="5,002 columns"):
        replay(wide)
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text('{"v": 1, "run": "' + "x" * (MAX_LINE_BYTES + 10) + '"}\n')
    with pytest.raises(ReplayError, match="line longer than"):
        replay(jsonl)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 64, grown_mib  # the 64 MiB line was never held whole


def test_emitter_warns_within_seconds_naming_the_address_and_close_honours_its_timeout(caplog):
    """16.12 and issue 11 item 7: close(timeout=1) took 6 s and left the sender running; the
    bus-unavailable warning came after 30 s or not at all."""
    import logging

    address = f"127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING, logger="sdcwatch.telemetry")
    em = Emitter(bootstrap=address, run="r", rank=0, world=1)
    em.emit(0, loss=1.0)

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "bus unavailable" in r.getMessage()]

    wait_for(warned, 20, "the bus-unavailable warning (before the 30 s bus wait ends)", interval=0.05)
    assert len(warned()) == 1 and address in warned()[0]
    for step in range(1, 20):
        em.emit(step, loss=1.0)
    returns(lambda: em.close(timeout=1), 30, "close(timeout=1) with nothing listening")
    assert not em._thread.is_alive()  # the sender stopped with it
    assert em.dropped == 20


def test_concurrent_scrapes_share_one_render():
    """16.13: twenty scrapers each built the whole view; now one render serves them all."""
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporters"))
    from _support import small_view
    from sdcwatch.exporters.server import MetricsServer

    calls = []

    def view():
        calls.append(1)
        time.sleep(0.2)  # a view that takes a while to build
        return small_view()

    with MetricsServer(view, port=0, cache_seconds=5.0) as server:
        threads = [
            threading.Thread(target=lambda: urllib.request.urlopen(server.url, timeout=30).read()) for _ in range(20)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    assert len(calls) == 1
