"""`sdcwatch capture`: one run from the telemetry topic into the JSON lines replay and report read."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
import threading
import uuid

import pytest
from polling import wait_for
from serve_process import run_cli
from sdcwatch.core.messages import decode_line
from sdcwatch.core.rank_notes import LayerNames
from sdcwatch.core.record import encode, encode_batch
from sdcwatch.telemetry import Record, end_marker, from_json, is_end_marker, to_json

from sdcwatch.capture import Capture, capture


def rec(run: str, step: int, rank: int, world: int = 2, **scalars) -> Record:
    return Record.make(
        run=run, step=step, rank=rank, world=world, host="h", time=1e9 + step, scalars=scalars or {"loss": 2.0}
    )


class ListReader:
    """A test double of the topic reader: hands out prepared polls, then nothing."""

    def __init__(self, polls) -> None:
        self.polls = list(polls)
        self.at_end_calls = 0

    def poll(self, timeout: float):
        return self.polls.pop(0) if self.polls else []

    def at_end(self) -> bool:
        self.at_end_calls += 1
        return not self.polls

    def end_mark(self) -> int:  # one partition, read in order: what was handed out is all there was
        return 0

    def past(self, mark: int) -> bool:
        return True


class PartitionReader:
    """A test double of a topic with several partitions, fetched one whole partition after the other
    (as a consumer may: each poll returns what one partition's fetch brought)."""

    def __init__(self, partitions: list[list[bytes]], order: list[int]) -> None:
        self.partitions = partitions
        self.read = [0] * len(partitions)
        self.order = list(order)

    def poll(self, timeout: float):
        if not self.order:
            return []
        p = self.order.pop(0)
        out = self.partitions[p][self.read[p] :]
        self.read[p] = len(self.partitions[p])
        return out

    def at_end(self) -> bool:
        return self.past(self.end_mark())

    def end_mark(self) -> list[int]:
        return [len(p) for p in self.partitions]

    def past(self, mark: list[int]) -> bool:
        return all(r >= m for r, m in zip(self.read, mark))


def test_capture_reads_every_partition_before_it_calls_a_run_ended():
    """The last window's partition, with the end markers, can be fetched before an earlier
    window's: the file must still hold every step the ranks sent, not stop at the markers."""
    window_0 = [encode(rec("a", s, r)) for s in range(16) for r in range(2)]
    window_1 = [encode(rec("a", s, r)) for s in range(16, 32) for r in range(2)]
    last = [encode(rec("a", 32, r)) for r in range(2)] + [encode(end_marker("a", 32, r, 2)) for r in range(2)]
    reader = PartitionReader([window_0, window_1, last], order=[2, 0, 1])
    out = io.StringIO()
    cap = Capture("a", out)
    why = capture(reader, cap, idle_timeout=60, stop=threading.Event(), clock=FakeClock())
    assert why.startswith("the run ended")
    steps = sorted({from_json(line).step for line in out.getvalue().splitlines()})
    assert steps == list(range(33))
    assert cap.records == 2 * 33 + 2


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.5  # every look at the clock is half a poll later
        return self.t


def test_capture_keeps_one_run_with_its_markers_and_stops_when_every_rank_ended():
    out = io.StringIO()
    cap = Capture("a", out)
    polls = [
        [encode_batch([rec("a", 0, 0), rec("a", 0, 1), rec("b", 0, 0, world=1)]), b"garbage", None],
        [encode(rec("a", 1, 0, loss=math.nan)), encode(rec("a", 1, 1))],
        [encode(end_marker("a", 1, 0, 2))],
        [encode(end_marker("a", 1, 1, 2))],
        [encode(rec("a", 2, 0))],  # never read: the run ended before
    ]
    reader = ListReader(polls)
    why = capture(reader, cap, idle_timeout=60, stop=threading.Event(), clock=FakeClock())
    assert why.startswith("the run ended")
    lines = out.getvalue().splitlines()
    recs = [from_json(line) for line in lines]
    assert [(r.step, r.rank, is_end_marker(r)) for r in recs] == [
        (0, 0, False),
        (0, 1, False),
        (1, 0, False),
        (1, 1, False),
        (1, 0, True),
        (1, 1, True),
    ]
    assert math.isnan(recs[2].scalars["loss"])  # strict JSON keeps the NaN
    assert all(json.loads(line)["run"] == "a" for line in lines)
    assert (cap.records, len(cap.refused), cap.other) == (6, 2, 1)
    assert cap.refused.counts == {"malformed": 1, "empty": 1}
    assert cap.describe() == "6 records of run 'a' (steps 0-1, 2 of 2 ranks, 2/2 ranks ended)"
    assert len(reader.polls) == 1


def test_capture_stops_when_idle_only_once_the_topic_is_read_to_its_end():
    cap = Capture("a", io.StringIO())
    # a backlog of another run's records: idle for the run, but not at the end of the topic
    reader = ListReader([[encode(rec("b", s, 0, world=1))] for s in range(200)])
    clock = FakeClock()
    why = capture(reader, cap, idle_timeout=10, stop=threading.Event(), clock=clock)
    assert why == "no record of the run for 10 s"
    assert reader.polls == [] and cap.other == 200 and cap.records == 0
    assert reader.at_end_calls > 1  # it looked, found a backlog, and read on


def test_capture_stops_on_request_and_reports_progress():
    stop = threading.Event()
    cap = Capture("a", io.StringIO())
    said = []

    class Reader(ListReader):
        def poll(self, timeout):
            if len(said) >= 2:
                stop.set()
            return [encode(rec("a", len(said), 0))]

    why = capture(
        Reader([]), cap, idle_timeout=0, stop=stop, progress=said.append, progress_every=1.0, clock=FakeClock()
    )
    assert why == "interrupted"
    assert said == [f"{n} records of run 'a' (steps 0-{n - 1}, 1 of 2 ranks)" for n in (1, 2, 3)]
    assert cap.records == 3  # what was read before the stop is written


def test_capture_refuses_to_overwrite_and_checks_its_options(tmp_path):
    existing = tmp_path / "x.jsonl"
    existing.write_text("keep me\n")
    for extra, needle in (([], "exists; pass --force"), (["--idle-timeout", "-1", "--force"], "--idle-timeout")):
        out = run_cli("capture", "--run", "r", "-o", str(existing), *extra)
        assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert existing.read_text() == "keep me\n"


def test_the_report_reads_a_captured_file_and_skips_the_end_markers(tmp_path):
    from sdcwatch.report.data import load_records

    path = tmp_path / "run.jsonl"
    records = [rec("a", s, r, loss=2.0 + s) for s in range(3) for r in range(2)]
    path.write_text("".join(to_json(r) + "\n" for r in [*records, end_marker("a", 2, 0, 2), end_marker("a", 2, 1, 2)]))
    data = load_records(path)
    assert data.records == 6 and data.duplicates == 0 and data.steps.tolist() == [0, 1, 2]
    assert data.scalars["loss"][-1].tolist() == [4.0, 4.0]  # the marker at step 2 did not replace the step


@pytest.mark.integration
def test_capture_stops_cleanly_on_ctrl_c(bootstrap, tmp_path):
    import signal

    from sdcwatch.telemetry.wire.transports import ensure_topic

    topic = f"tel.{uuid.uuid4().hex[:8]}"
    ensure_topic(bootstrap, topic, 4)
    out_file = tmp_path / "none.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sdcwatch.cli",
            "capture",
            "--run",
            "never",
            "-o",
            str(out_file),
            "--bus-bootstrap",
            bootstrap,
            "--bus-telemetry-topic",
            topic,
            "--idle-timeout",
            "0",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr.readline().startswith("sdcwatch capture: reading")
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, err
    assert "stopped: interrupted" in err and "no record of run 'never' was seen" in err and "--from-beginning" in err
    assert out_file.read_text() == ""


@pytest.mark.integration
def test_capture_names_an_unreachable_broker(tmp_path):
    from sdcwatch.broker import free_port

    address = f"127.0.0.1:{free_port()}"
    env = {**__import__("os").environ, "SDCWATCH_BOOTSTRAP": address}
    out = run_cli("capture", "--run", "r", "-o", str(tmp_path / "o.jsonl"), "--connect-timeout", "2", env=env)
    assert out.returncode == 2
    assert f"cannot reach Kafka at {address}" in out.stderr and "SDCWATCH_BOOTSTRAP" in out.stderr
    assert "Traceback" not in out.stderr
    assert "within 2 s" in out.stderr  # the bound given, not kafka-python's own
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.integration
def test_capture_then_replay_gives_the_incidents_the_service_raised(bootstrap, tmp_path):
    """A live capture started before the run and one from the beginning after it both stop at the
    end markers with the same records; replaying the file raises the service's incidents."""
    torch = pytest.importorskip("torch")
    from sdcwatch.telemetry import Emitter, KafkaTransport
    from sdcwatch.telemetry.wire.transports import ensure_topic
    from serve_process import ServeProcess, Topics
    from simulated_nan import nan_run

    torch.set_num_threads(1)
    tag = uuid.uuid4().hex[:8]
    topics = Topics.fresh(tag)
    run_name = f"cap-{tag}"
    world, nan_step, steps = 4, 30, 45
    serve = ServeProcess(bootstrap, topics, tmp_path / "state", group=f"g-{tag}", snapshot_interval_s=1)
    serve.wait_banner()
    live_file = tmp_path / "live.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "sdcwatch.cli",
        "capture",
        "--run",
        run_name,
        "--bus-bootstrap",
        bootstrap,
        "--bus-telemetry-topic",
        topics.telemetry,
        "--idle-timeout",
        "120",
    ]
    ensure_topic(bootstrap, topics.telemetry, 4)  # an older run's topic: the capture starts at its end
    live = subprocess.Popen([*cmd, "-o", str(live_file)], stderr=subprocess.PIPE, text=True)
    assert live.stderr.readline().startswith("sdcwatch capture: reading")  # positions taken: from here on
    # another run on the same topic, which the capture must pass over
    other = Emitter(KafkaTransport(bootstrap, topics.telemetry), run=f"other-{tag}", rank=0, world=1)
    other.emit(0, loss=1.0)
    other.close()
    run = nan_run(bootstrap, topics.telemetry, run_name, nan_step, world)
    run.train(steps)
    run.close()  # the emitters send their end-of-run markers
    assert all(em.ended for em in run.emitters)
    live_err = live.communicate(timeout=120)[1]
    assert live.returncode == 0, live_err
    assert "stopped: the run ended" in live_err and f"{steps * world + world} records of run" in live_err

    after_file = tmp_path / "after.jsonl"
    out = subprocess.run([*cmd, "--from-beginning", "-o", str(after_file)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "stopped: the run ended" in out.stderr, out.stderr
    assert sorted(after_file.read_text().splitlines()) == sorted(live_file.read_text().splitlines())
    lines = live_file.read_text().splitlines()
    msgs = [decode_line(line) for line in lines]
    names = [m for m in msgs if isinstance(m, LayerNames)]  # the ranks' layer names
    assert {(n.run, n.rank) for n in names} == {(run_name, r) for r in range(world)}
    recs = [m for m in msgs if isinstance(m, Record)]
    assert {r.run for r in recs} == {run_name} and sum(map(is_end_marker, recs)) == world
    assert sorted((r.step, r.rank) for r in recs if not is_end_marker(r)) == [
        (s, r) for s in range(steps) for r in range(world)
    ]

    def service_incidents():
        """The latest state of each incident the service published."""
        latest = {}
        for e in serve.events():
            latest[e["id"]] = e
        return latest

    wait_for(
        lambda: any(e["kind"] == "nonfinite" for e in service_incidents().values()),
        60,
        "the service's incident",
        interval=0.25,
    )
    # the finished run is closed: every incident it opened is resolved
    wait_for(
        lambda: all(e["change"] == "resolved" for e in service_incidents().values()),
        60,
        "the service to close the finished run",
        interval=0.25,
    )
    serve.stop()
    replayed = run_cli("replay", str(live_file), "--json", timeout=120)
    assert replayed.returncode == 0, replayed.stderr
    offline = [json.loads(line) for line in replayed.stdout.splitlines()]

    def key(e):
        return (e["id"], e["kind"], e["first_step"], e["peak_step"], tuple(e["ranks"]), e["metric"], e["layer"])

    assert sorted(map(key, offline)) == sorted(map(key, service_incidents().values()))
    (nonfinite,) = [e for e in offline if e["kind"] == "nonfinite"]
    assert nonfinite["first_step"] == nan_step and nonfinite["ranks"] == [2]
    assert re.search(r"\bsteps 0-44\b", live_err)
    incidents = tmp_path / "incidents.jsonl"
    incidents.write_text(replayed.stdout)
    page = tmp_path / "report.html"
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdcwatch.cli",
            "report",
            str(live_file),
            "--incidents",
            str(incidents),
            "-o",
            str(page),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert report.returncode == 0, report.stderr
    assert run_name in page.read_text()


@pytest.mark.integration
def test_the_topic_reader_is_past_an_end_mark_only_once_every_partition_is_read(bootstrap, unique_topic):
    """What the capture waits on once every rank ended: the end offsets of all partitions, read."""
    from kafka import KafkaProducer
    from sdcwatch.service.kafka_source import TopicReader
    from sdcwatch.telemetry.wire.transports import ensure_topic

    ensure_topic(bootstrap, unique_topic, 4)
    producer = KafkaProducer(bootstrap_servers=[bootstrap])
    sent = 0
    for p in range(4):
        for i in range(5 + 10 * p):
            producer.send(unique_topic, value=f"{p}/{i}".encode(), partition=p)
            sent += 1
    producer.flush()
    producer.close()
    reader = TopicReader(bootstrap, unique_topic, from_beginning=True)
    try:
        assert reader.assign()
        mark = reader.end_mark()
        # every partition holds records (the embedded broker gives the last batch's first offset + 1
        # as the end: a batch is fetched whole, so reaching it still means the batch was read)
        assert len(mark) == 4 and all(end >= 1 for end in mark.values())
        assert not reader.past(mark)
        got: list[bytes | None] = []

        def read_past_the_mark() -> bool:
            got.extend(reader.poll(0.5))
            return reader.past(mark)

        wait_for(read_past_the_mark, 60, "the reader past the end mark", interval=0)
        assert len(got) == sent
    finally:
        reader.close()


class RacingConsumer:
    """A real consumer that fetches as the embedded broker does when two producers write one
    partition at once: one fetch lists a later batch without the earlier one at ``offset`` (its
    offsets given out, its bytes not yet written). kafka-python takes that as a legal gap and moves
    past it for good; what reads through this must go back for it."""

    def __init__(self, consumer, offset: int) -> None:
        self._consumer = consumer
        self.offset = offset
        self.dropped = None  # (partition, offset) the racing fetch left out, once it did

    def poll(self, **kwargs):
        batches = self._consumer.poll(**kwargs)
        for tp, msgs in batches.items():
            later = [m for m in msgs if m.offset > self.offset]
            if self.dropped is None and later and any(m.offset == self.offset for m in msgs):
                batches[tp] = [m for m in msgs if m.offset != self.offset]
                self.dropped = (tp.partition, self.offset)
        return batches

    def __getattr__(self, name):
        return getattr(self._consumer, name)


@pytest.mark.integration
def test_capture_goes_back_for_a_batch_a_racing_fetch_left_out(bootstrap, unique_topic, tmp_path):
    """Finding 13: capture lost rank 0's step 285 that serve recovered through its offset-gap
    re-fetch. Capture reads through the service's reader: a record the broker listed late is in
    the file, not skipped."""
    from kafka import KafkaProducer
    from sdcwatch.core.kafka import new_consumer
    from sdcwatch.service.kafka_source import TopicReader
    from sdcwatch.service.offset_gaps import OffsetGaps
    from sdcwatch.telemetry.wire.transports import ensure_topic

    from sdcwatch.capture import open_reader
    from sdcwatch.config import load_config

    ensure_topic(bootstrap, unique_topic, 1)
    producer = KafkaProducer(bootstrap_servers=[bootstrap])
    sent = [rec("g", s, r) for s in range(20) for r in range(2)] + [end_marker("g", 19, r, 2) for r in range(2)]
    for r in sent:  # one message each: offset = index in ``sent``
        producer.send(unique_topic, value=encode(r))
    producer.flush()
    producer.close()
    lost = 2 * 15  # rank 0, step 15
    racing = RacingConsumer(new_consumer(bootstrap, group_id=None, enable_auto_commit=False), lost)
    bus = load_config(None, env={}, overrides={"bus.bootstrap": bootstrap, "bus.connect_timeout_s": 10}).bus
    reader = open_reader(bus, unique_topic, from_beginning=True, consumer=racing)
    assert isinstance(reader, TopicReader) and isinstance(reader.gaps, OffsetGaps)  # the service's reader
    out = io.StringIO()
    try:
        why = capture(reader, Capture("g", out), idle_timeout=30, stop=threading.Event())
    finally:
        reader.close()
    assert racing.dropped == (0, lost), "the racing fetch never left a batch out: the test proves nothing"
    assert why.startswith("the run ended")
    got = sorted((r.step, r.rank) for r in map(from_json, out.getvalue().splitlines()) if not is_end_marker(r))
    assert got == [(s, r) for s in range(20) for r in range(2)], "rank 0's step 15 was lost"
    assert reader.gaps.counts["filled"] == 1 and reader.gaps.counts["skipped"] == 0


@pytest.mark.integration
@pytest.mark.parametrize("wire, signed", [("v1", False), ("v2", True)], ids=["v1-unsigned", "v2-signed"])
def test_a_run_on_kafka_captures_replays_and_reports_with_the_key_file(bootstrap, tmp_path, wire, signed):
    """Every kind the Kafka transport writes (records, layer names, a checkpoint note, end markers;
    signed with the job key) is captured in order with the key file ``sdcwatch serve`` takes, then
    replayed and reported. Before, a signed run captured 0 records ("N undecodable messages")."""
    from message_job import STEPS, assert_complete_and_in_order, order_of, run_job
    from sdcwatch.core.signing import JobKey
    from sdcwatch.telemetry import Emitter, KafkaTransport

    tag = uuid.uuid4().hex[:8]
    topic, keys = f"kinds.{tag}", tmp_path / "keys"
    keys.write_text("job-k:" + "k" * 32 + "\n")
    key = JobKey("job-k", b"k" * 32) if signed else None
    run_job(KafkaTransport(bootstrap, topic), wire, key)
    Emitter(KafkaTransport(bootstrap, topic), run=f"other-{tag}", rank=0, world=1, key=key).close()
    out, report = tmp_path / "cap.jsonl", tmp_path / "report.html"
    cli = [sys.executable, "-m", "sdcwatch.cli"]

    def capture_to(path, *more: str) -> subprocess.CompletedProcess:
        cmd = [*cli, "capture", "--run", "kinds", "-o", str(path), "--from-beginning", "--idle-timeout", "30"]
        cmd += ["--bus-bootstrap", bootstrap, "--bus-telemetry-topic", topic, *more]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    got = capture_to(out, "--auth-key-file", str(keys))
    assert got.returncode == 0 and "stopped: the run ended" in got.stderr and "refused" not in got.stderr, got.stderr
    assert f"wrote {STEPS + 1} records of run 'kinds'" in got.stderr, got.stderr
    assert_complete_and_in_order(order_of([decode_line(line) for line in out.read_text().splitlines()]), window=True)
    replayed = subprocess.run([*cli, "replay", str(out)], capture_output=True, text=True, timeout=120)
    assert replayed.returncode == 0 and replayed.stdout.strip() == "no incidents", replayed.stderr
    drawn = subprocess.run([*cli, "report", str(out), "-o", str(report)], capture_output=True, text=True, timeout=180)
    assert drawn.returncode == 0 and report.stat().st_size > 0, drawn.stderr
    if signed:  # without the key file the capture says why every message was refused
        got = capture_to(tmp_path / "bare.jsonl", "--idle-timeout", "3")
        assert got.returncode == 0 and "wrote 0 records" in got.stderr, got.stderr
        assert " auth (bad record field 'signature': a signed message, and no keyring to verify it" in got.stderr
