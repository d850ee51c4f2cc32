"""Fair admission: runs earn their place among detectors.max_runs, and one run cannot flood.

A new run is on probation until it has shown ``run_probation_steps`` steps; past max_runs a run on
probation silent for ``run_probation_idle_s`` gives way to a newcomer, a training run never does
(only ``run_stale_s``, the end and the idle expiry take it). Each run has a record budget; what it
sends past it is dead-lettered ``budget``. The pipeline runs on fake clocks here; the last test runs
the junk flood through the real broker.
"""

from __future__ import annotations

import math
import uuid

import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.messages import encode_items
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.record import encode_batch, record_key
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.record_type import Record
from memory_source import MemorySource
from polling import step_until
from stand_ins import Clock, ListSink, clocked_pipeline
from sdcwatch.service.kafka_source import KafkaSource
from sdcwatch.service.loop import DetectorService
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings
from sdcwatch.telemetry import MemoryBus
from serve_process import rank_emitters

TOPIC = "sdcwatch.telemetry"


def on_probation(aligner, run: str) -> bool:
    """Whether ``run`` is held but has not yet shown its probation steps (read from the saved state)."""
    return aligner.snapshot()["runs"][run]["steps_closed"] < aligner.probation_steps


def junk(name: str, step: int = 0) -> Record:
    """One record of a one-rank run that says nothing more."""
    return Record(name, step, 0, 1, "evil", 0.0, 0, {"loss": 1.0}, {}, {})


def refused(pipe: DetectionPipeline) -> dict[str, int]:
    """Records the pipeline set aside since the last call, by reason."""
    out: dict[str, int] = {}
    for reason, _, recs in pipe.aligner.take_rejected():
        out[reason] = out.get(reason, 0) + len(recs)
    return out


def test_a_thousand_junk_runs_give_way_to_a_real_run_within_seconds_and_its_nan_is_found():
    pipe, clock = clocked_pipeline()  # the defaults: 1,000 runs, probation 3 steps / 2 s
    for i in range(1000):  # 0.16 s of sending on the bus
        pipe.process([junk(f"junk-{i}")])
    assert pipe.aligner.runs() == 1000 and refused(pipe) == {}
    real = SyntheticRun(world=4, run="real", seed=3, faults=[Fault("nonfinite", 30, rank=2, length=1)])
    admitted_at = None
    events = []
    for step in range(40):  # ten steps a second
        clock.t += 0.1
        events += pipe.process(real.records(step))
        if admitted_at is None and pipe.aligner.holds("real"):
            admitted_at = step
    events += pipe.flush()
    # before: every record of the real run dead-lettered (runs) for 15 minutes, its NaN never reported
    assert admitted_at is not None and admitted_at <= 20, "the real run is watched within 2 s of the flood"
    assert refused(pipe) == {"runs": 4 * admitted_at}
    assert pipe.runs_forgotten == 1 and pipe.aligner.runs() == 1000
    nonfinite = [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]
    assert [(i.run, i.first_step, i.ranks) for i in nonfinite] == [("real", 30, (2,))]


def test_a_training_run_is_never_evicted_by_a_flood_of_new_names():
    pipe, clock = clocked_pipeline(max_runs=2, run_stale_s=600.0)
    real = SyntheticRun(world=4, run="real", seed=4, faults=[Fault("nonfinite", 12, rank=1, length=1)])
    for step in range(10):
        pipe.process(real.records(step))
        clock.t += 1.0
    assert not on_probation(pipe.aligner, "real")
    admitted = 0
    for i in range(1000):  # a new name every 0.3 s for 5 minutes; the real run pauses (a checkpoint)
        clock.t += 0.3
        pipe.process([junk(f"junk-{i}")])
        admitted += pipe.aligner.holds(f"junk-{i}")
        pipe.expire()
        assert pipe.aligner.holds("real"), f"the training run was evicted by junk-{i}"
    # the junk names take turns in the one other place (a silent one gives way after 2 s)
    assert admitted == 1000 // 7 + 1
    events = []
    for step in range(10, 20):  # the real run goes on where it was: its state kept
        events += pipe.process(real.records(step))
    events += pipe.flush()
    assert refused(pipe).get("runs", 0) == 1000 - admitted
    nonfinite = [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]
    assert [(i.run, i.first_step, i.ranks) for i in nonfinite] == [("real", 12, (1,))]
    view = next(r for r in pipe.view().runs if r.run == "real")
    assert (view.last_step, view.steps_total) == (19, 20)  # one run throughout, never started afresh


def test_which_new_run_gets_a_free_place_does_not_depend_on_the_order_of_the_poll():
    """Two new runs, one place: the one with more records in the poll (a job's ranks) gets it,
    then the name decides; the order the poll read them in never does."""
    real = SyntheticRun(world=4, run="real", seed=5)
    for order in (lambda j, r: j + r, lambda j, r: r + j, lambda j, r: [r[0], *j, *r[1:]]):
        pipe, clock = clocked_pipeline(max_runs=2)
        pipe.process([junk("held")])
        pipe.process(order([junk("aaa-junk")], real.records(0)))
        assert (pipe.aligner.holds("real"), pipe.aligner.holds("aaa-junk")) == (True, False)
        assert refused(pipe) == {"runs": 1}
        pipe2, _ = clocked_pipeline(max_runs=2)
        pipe2.process([junk("held")])
        pipe2.process(order([junk("b")], [junk("a")]))  # equal counts: by name
        assert (pipe2.aligner.holds("a"), pipe2.aligner.holds("b")) == (True, False)


def test_a_run_on_probation_that_keeps_sending_keeps_its_place():
    pipe, clock = clocked_pipeline(max_runs=2, run_probation_idle_s=2.0)
    pipe.process([junk("slow")])  # one step so far, still sending
    pipe.process([junk("quiet")])
    for i in range(5):
        clock.t += 1.5
        pipe.process([junk("slow", step=0)])  # a duplicate still counts as input
        pipe.process([junk(f"new-{i}")])
        assert pipe.aligner.holds("slow")
    assert not pipe.aligner.holds("quiet")  # the silent one gave way to a newcomer
    clock.t += 1.0
    for step in range(1, 3):  # its third step: off probation
        pipe.process([junk("slow", step=step)])
    assert not on_probation(pipe.aligner, "slow")


def test_admission_settings_are_checked_and_reach_the_aligner():
    pipe, _ = clocked_pipeline(run_probation_steps=5, run_record_budget=10.0, run_budget_window_s=3.0)
    assert (pipe.aligner.probation_steps, pipe.aligner.record_budget) == (5, 10.0)
    with pytest.raises(ConfigError, match=r"^detectors\.run_probation_steps: must be an integer >= 1, got 0$"):
        PipelineSettings(run_probation_steps=0)
    with pytest.raises(ConfigError, match=r"^detectors\.run_record_budget: must be a number > 0, got 0.0$"):
        PipelineSettings(run_record_budget=0.0)


def _v1(records: list[Record]) -> bytes:
    return encode_batch(records)


def _v2(records: list[Record]) -> list[tuple[bytes, bytes]]:
    enc = encode_items([PackedRecord.from_record(r) for r in records], record_key, 64, set())
    return [(k, v) for k, v, _ in enc]


def test_the_budget_dead_letters_a_flooding_runs_excess_and_counts_it():
    clock = Clock(1000.0)
    settings = PipelineSettings(run_record_budget=100.0, run_budget_window_s=2.0)  # 200 at once, 100 a second
    pipe = DetectionPipeline(settings, clock=clock, wall=clock)
    bus = MemoryBus()
    source = MemorySource(bus)
    svc = DetectorService(source, pipe, poll_timeout=0.01, clock=clock)
    real = SyntheticRun(world=4, run="real", seed=6, faults=[Fault("nonfinite", 8, rank=0, length=1)])
    flood = [Record("flood", s, r, 8, "h", 0.0, 0, {"loss": 1.0}, {}, {}) for s in range(125) for r in range(8)]
    for k, v in _v2(flood[:500]):  # v2 column blocks
        bus.append(TOPIC, k, v)
    for i in range(0, 500, 50):  # and v1 records
        bus.append(TOPIC, b"flood", _v1(flood[500 + i : 550 + i]))
    events = []
    for step in range(10):
        for k, v in _v2(real.records(step)):
            bus.append(TOPIC, k, v)
        events += svc.step()
        clock.t += 0.1
    # the flood: 1,000 records at once, 200 within its budget; the real run (40 records) untouched
    assert source.dead_letter_reasons == {"budget": 800}
    assert pipe.aligner.over_budget == 800 and pipe.records_total == 1000 + 40
    more = [Record("flood", 200 + i // 8, i % 8, 8, "h", 0.0, 0, {"loss": 1.0}, {}, {}) for i in range(150)]
    bus.append(TOPIC, b"flood", _v1(more))  # a second after the flood the bucket holds 100 again
    events += svc.step()
    assert source.dead_letter_reasons == {"budget": 800 + 50}
    events += pipe.flush()
    nonfinite = [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]
    assert [(i.run, i.first_step, i.ranks) for i in nonfinite] == [("real", 8, (0,))]


@pytest.mark.integration
def test_after_a_junk_flood_on_the_broker_a_real_run_is_watched_within_seconds(bootstrap, unique_topic):
    """1,000 one-record runs fill the service (the defaults: 1,000 runs); a real 4-rank run started
    after them is watched within seconds, and its NaN found at its step. Before: every record of
    the real run dead-lettered (runs) for 15 minutes.

    The test drives the service's loop and its clocks: a step of the real run is a tenth of a
    second on them, and the next one goes out once the loop has taken this one (admitted or
    dead-lettered), so what the service decides does not depend on how fast a loaded machine runs."""
    from kafka import KafkaProducer

    source = KafkaSource(
        bootstrap, unique_topic, group=f"g-{uuid.uuid4().hex[:8]}", deadletter_topic=f"{unique_topic}.dead"
    )
    clock = Clock(1000.0)
    pipe = DetectionPipeline(PipelineSettings(align_timeout_s=2.0), clock=clock, wall=clock)
    sink = ListSink()
    svc = DetectorService(source, pipe, sinks=[sink], poll_timeout=0.1)
    try:
        junk_sender = KafkaProducer(bootstrap_servers=[bootstrap], linger_ms=5)
        for i in range(1000):
            junk_sender.send(unique_topic, key=f"junk-{i}".encode(), value=encode_batch([junk(f"junk-{i}")]))
        junk_sender.flush(30)
        junk_sender.close()
        step_until(svc.step, lambda: pipe.aligner.runs() >= 1000, 60, "the 1,000 junk runs")
        assert pipe.aligner.runs() == 1000
        junk_records = pipe.records_total
        emitters = rank_emitters(bootstrap, unique_topic, "real")
        watched = None  # the step after which the service held the real run
        for step in range(60):  # ten steps a second on the service's clocks
            clock.t = 1000.0 + 0.1 * step
            for em in emitters:
                loss = math.nan if (step, em.rank) == (45, 2) else 2.0 + 0.01 * em.rank
                em.emit(step, loss=loss, grad_norm_local=1.0, grad_norm_global=1.0, layers={"attn_entropy": [1.5]})
                em.flush(10)
            taken = junk_records + 4 * (step + 1)
            step_until(
                svc.step, lambda: pipe.records_total >= taken, 60, f"the loop to take step {step} of the real run"
            )
            if watched is None and pipe.aligner.holds("real"):
                watched = step
        for em in emitters:
            em.close(10)
        step_until(svc.step, lambda: any(i.run == "real" for i in sink.opened), 30, "the real run's incident")
    finally:
        svc.close()
    # the first step sent 2 s (run_probation_idle_s) after the flood went silent takes a junk run's place
    assert watched == 20, f"the real run was watched after step {watched}"
    assert pipe.runs_forgotten == 1 and source.dead_letter_reasons == {"runs": 4 * 20}
    nonfinite = [(i.first_step, i.ranks) for i in sink.opened if i.run == "real" and i.kind == "nonfinite"]
    assert nonfinite == [(45, (2,))]
