"""Admission that loses nothing: runs earn their place among detectors.max_runs, and one run cannot flood.

A new run is on probation until it has shown ``run_probation_steps`` whole steps over
``run_probation_s``; past max_runs a new run's records wait (``run_wait_records``) until a run gives
way: a signed newcomer takes an unsigned run's place, a run on probation silent
``run_probation_idle_s`` or a training run silent ``run_yield_idle_s`` gives way to any. No record of
a run that is then admitted is dead-lettered, unless the buffer overflowed (and then it is said).
Each run has a record budget; what it sends past it is dead-lettered ``budget``. The pipeline runs on
fake clocks here; the last test runs the junk flood through the real broker.
"""

from __future__ import annotations

import json
import math
import uuid

import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.messages import encode_items
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.jsonsafe import json_safe
from sdcwatch.core.record import encode_batch, record_key
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.record_type import Record
from memory_source import MemorySource
from polling import step_until
from stand_ins import Clock, ListSink, clocked_pipeline
from sdcwatch.service.kafka_source import KafkaSource
from sdcwatch.service.loop import DetectorService
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings
from sdcwatch.telemetry import MemoryBus, end_marker
from serve_process import rank_emitters

TOPIC = "sdcwatch.telemetry"


def junk(name: str, step: int = 0) -> Record:
    """One record of a one-rank run that says nothing more."""
    return Record(name, step, 0, 1, "evil", 0.0, 0, {"loss": 1.0}, {}, {})


def dead_lettered(pipe: DetectionPipeline) -> dict[tuple[str, str], int]:
    """Records the pipeline set aside since the last call, by (reason, run)."""
    out: dict[tuple[str, str], int] = {}
    for reason, _, recs in pipe.aligner.take_rejected():
        for r in recs:
            out[reason, r.run] = out.get((reason, r.run), 0) + 1
    return out


def steps_judged(pipe: DetectionPipeline, run: str) -> int:
    return next(r.steps_total for r in pipe.view().runs if r.run == run)


@pytest.mark.parametrize(
    "junk_runs, junk_steps, junk_steps_a_second",
    [(1000, 4, None), (250, 40, None), (250, 40, 2.0)],
    ids=["1000x4-steps-at-once", "250x40-steps-at-once", "250x40-steps-over-20s"],
)
def test_junk_runs_filling_the_service_cost_a_real_run_none_of_its_records_and_its_nan_is_found(
    junk_runs, junk_steps, junk_steps_a_second
):
    """As many junk runs as the service keeps (the defaults' 1,000; the 40-step floods at a quarter
    of the size, with max_runs to match: the same logic at a quarter of the detection work). Junk
    sent at once stays on probation and gives way 2 s after it went silent; junk that trained (20
    whole steps over 10 s) gives way once silent 30 s. Either way the real run's records wait
    meanwhile: none is dead-lettered, its NaN is found at its step and rank."""
    pipe, clock = clocked_pipeline(max_runs=junk_runs)
    for step in range(junk_steps):  # before: 4 steps made them training for 15 minutes
        pipe.process([junk(f"junk-{i}", step) for i in range(junk_runs)])
        if junk_steps_a_second:
            clock.t += 1 / junk_steps_a_second
    assert pipe.aligner.runs() == junk_runs and dead_lettered(pipe) == {}
    assert pipe.aligner.on_probation("junk-0") == (junk_steps_a_second is None)
    real = SyntheticRun(world=8, run="legit", seed=3, faults=[Fault("nonfinite", 30, rank=5, length=1)])
    steps, dt = (40, 0.1) if junk_steps_a_second is None else (80, 0.5)  # ten steps a second, or two
    silent_since, start = (clock.t - 1 / junk_steps_a_second if junk_steps_a_second else clock.t), clock.t
    admitted_at = None
    events = []
    for step in range(steps):
        clock.t = start + dt * (step + 1)
        events += pipe.process(real.records(step))
        if admitted_at is None and pipe.aligner.holds("legit"):
            admitted_at = step
    events += pipe.flush()
    # watched at the first step sent once the junk was silent run_probation_idle_s (2 s), or
    # run_yield_idle_s (30 s) if it trained
    given_way = 2.0 if junk_steps_a_second is None else 30.0
    assert admitted_at == next(k for k in range(steps) if start + dt * (k + 1) - silent_since >= given_way)
    assert admitted_at == (19 if junk_steps_a_second is None else 58)
    assert dead_lettered(pipe) == {} and pipe.aligner.waiting_records == 0
    assert steps_judged(pipe, "legit") == steps, "every step of the real run judged"
    assert pipe.runs_forgotten == 1 and pipe.aligner.runs() == junk_runs
    nonfinite = [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]
    assert [(i.run, i.first_step, i.ranks) for i in nonfinite] == [("legit", 30, (5,))]


def test_an_idle_training_run_keeps_its_place_until_a_new_run_waits_run_yield_idle_s():
    pipe, clock = clocked_pipeline(max_runs=1, run_yield_idle_s=30.0)
    first = SyntheticRun(world=4, run="first", seed=4)
    for step in range(25):  # 25 whole steps over 24 s: training
        pipe.process(first.records(step))
        clock.t += 1.0
    assert not pipe.aligner.on_probation("first")
    clock.t += 600.0  # silent 10 minutes, nobody waiting: it keeps its place
    pipe.expire()
    assert pipe.aligner.holds("first")
    for step in range(25, 30):  # it goes on where it was
        pipe.process(first.records(step))
    clock.t += 10.0  # a checkpoint: silent 10 s when a new run comes
    second = SyntheticRun(world=2, run="second", seed=5)
    for step in range(30):  # a step a second: it waits until "first" has been silent 30 s
        pipe.process(second.records(step))
        assert pipe.aligner.holds("second") == (step >= 20), step
        clock.t += 1.0
    pipe.flush()
    assert not pipe.aligner.holds("first") and pipe.runs_forgotten == 1
    assert dead_lettered(pipe) == {} and steps_judged(pipe, "second") == 30


def test_signed_runs_come_first_and_unsigned_runs_are_capped_while_a_signed_run_is_held():
    pipe, clock = clocked_pipeline(max_runs=3, max_unsigned_runs=1)
    pipe.signed = {"job-a", "job-b"}.__contains__
    runs = {
        name: SyntheticRun(world=2, run=name, seed=i) for i, name in enumerate(["u1", "u2", "u3", "job-a", "job-b"])
    }

    def send(*names: str, step: int) -> None:
        pipe.process([r for name in names for r in runs[name].records(step)])

    for step in range(25):  # u1 and u2 training, job-a joins them: the cap binds only newcomers
        send("u1", "u2", step=step)
        send("job-a", step=step)
        clock.t += 1.0
    assert [pipe.aligner.on_probation(r) for r in ("u1", "u2", "job-a")] == [False, False, False]
    send("u2", "job-a", step=25)  # u1 is the idlest
    send("job-b", step=0)  # full: a signed newcomer takes the place of the idlest unsigned run at once
    assert pipe.aligner.held() == ["u2", "job-a", "job-b"] and pipe.runs_forgotten == 1
    pipe.evict("job-b")  # a free place; but an unsigned run holds all unsigned runs may hold
    for step in range(3):
        send("u3", step=step)
        assert not pipe.aligner.holds("u3") and pipe.aligner.waits("u3")
    clock.t += 120.0  # job-a silent 2 minutes: an unsigned newcomer never takes a signed run's place
    send("u3", step=3)
    assert pipe.aligner.held() == ["u2", "job-a"] and pipe.aligner.waits("u3")
    pipe.evict("job-a")  # no signed run held: the cap is off, the waiting run comes in at the next tick
    pipe.tick()
    assert pipe.aligner.holds("u3") and pipe.aligner.waiting_records == 0
    pipe.flush()
    assert dead_lettered(pipe) == {} and steps_judged(pipe, "u3") == 4


def test_graduation_takes_whole_steps_over_time_not_a_burst_or_steps_missing_ranks():
    pipe, clock = clocked_pipeline()  # 20 whole steps over 10 s
    for step in range(40):  # 40 one-record steps at once
        pipe.process([junk("burst", step)])
    assert pipe.aligner.on_probation("burst")
    real = SyntheticRun(world=4, run="real", seed=7)
    for step in range(30):  # a step a second from 3 of its 4 ranks: none whole
        pipe.process(real.records(step)[:3])
        pipe.tick()
        clock.t += 1.0
    pipe.flush()
    assert pipe.aligner.on_probation("real")
    for n, step in enumerate(range(30, 50), start=1):  # whole steps, a second apart
        pipe.process(real.records(step))
        assert pipe.aligner.on_probation("real") == (n < 20), n
        clock.t += 1.0


def test_waiting_records_past_run_wait_records_are_dead_lettered_by_run_and_said_at_admission(caplog):
    pipe, clock = clocked_pipeline(max_runs=1, run_wait_records=50)
    pipe.process([junk("held")])
    pipe.process([junk("old-junk")])  # waits
    real = SyntheticRun(world=4, run="real", seed=8)
    for step in range(15):  # 60 records: past 50 the run that sent least recently goes first, then this one
        pipe.process(real.records(step))
    lost = dead_lettered(pipe)
    assert lost == {("runs", "old-junk"): 1, ("runs", "real"): 51}  # step 12's third record overflowed
    assert pipe.aligner.waiting_records == 9
    clock.t += 2.0  # "held" silent on probation: it gives way
    with caplog.at_level("WARNING", logger="sdcwatch.service.pipeline"):
        pipe.process(real.records(15))
    assert pipe.aligner.holds("real")
    said = [r.getMessage() for r in caplog.records if r.name == "sdcwatch.service.pipeline"]
    assert said == [
        "run 'real' admitted after 51 of its records were dead-lettered (reason runs) while it waited for a "
        "place (detectors.run_wait_records): its first steps are missing"
    ]


def test_the_dead_letters_of_an_overflow_name_the_run_and_its_count():
    pipe, _ = clocked_pipeline(max_runs=1, run_wait_records=3)
    pipe.process([junk("held")])
    pipe.process([junk("late", s) for s in range(4)])
    [(reason, why, recs)] = pipe.aligner.take_rejected()
    assert (reason, len(recs)) == ("runs", 4)
    assert why == (
        "run 'late' waited for a place among detectors.max_runs and the 3 records runs may wait with are "
        "full (detectors.run_wait_records): its 4 waiting record(s) are lost (4 in all)"
    )


def test_waiting_records_are_kept_in_the_state_and_admitted_after_a_restart():
    pipe, clock = clocked_pipeline(max_runs=1)
    pipe.process([junk("held")])
    real = SyntheticRun(world=4, run="real", seed=9)
    for step in range(3):
        pipe.process(real.records(step))
    state = json.loads(json.dumps(json_safe(pipe.snapshot())))
    again, clock2 = clocked_pipeline(max_runs=1)
    again.restore(state)
    assert again.aligner.waits("real") and again.holds("real") and again.aligner.waiting_records == 12
    clock2.t += 2.0
    again.process(real.records(3))
    again.flush()
    assert dead_lettered(again) == {} and steps_judged(again, "real") == 4


@pytest.mark.parametrize("restart", [False, True], ids=["one-service", "killed-while-it-waits"])
def test_a_run_that_ends_while_it_waits_finishes_once_it_has_a_place(restart):
    """Its end markers wait with its records, in the state file too: a service killed meanwhile
    resumes with them, and the run finishes once it has a place."""
    pipe, clock = clocked_pipeline(max_runs=1)
    pipe.process([junk("held")])
    short = SyntheticRun(world=2, run="short", seed=10)
    for step in range(3):
        pipe.process(short.records(step))
    pipe.process([end_marker("short", 2, r, 2, time=2e9) for r in range(2)])  # it ended, still waiting
    assert pipe.aligner.waits("short") and not pipe.lifecycle.finished("short")
    assert pipe.aligner.waiting_records == 8  # its 6 records and 2 markers
    if restart:
        state = json.loads(json.dumps(json_safe(pipe.snapshot())))
        pipe, clock = clocked_pipeline(max_runs=1)
        pipe.restore(state)
        assert pipe.aligner.waits("short") and pipe.aligner.waiting_records == 8
    clock.t += 2.0
    pipe.tick()  # "held" gave way: the run comes in with its records, then its end
    assert pipe.lifecycle.finished("short")
    pipe.expire()
    assert steps_judged(pipe, "short") == 3 and dead_lettered(pipe) == {}


def test_which_new_run_gets_a_free_place_does_not_depend_on_the_order_of_the_poll():
    """Two new runs, one place: the one with more records in the poll (a job's ranks) gets it,
    then the name decides; the order the poll read them in never does. The other waits."""
    real = SyntheticRun(world=4, run="real", seed=5)
    for order in (lambda j, r: j + r, lambda j, r: r + j, lambda j, r: [r[0], *j, *r[1:]]):
        pipe, clock = clocked_pipeline(max_runs=2)
        pipe.process([junk("held")])
        pipe.process(order([junk("aaa-junk")], real.records(0)))
        assert (pipe.aligner.holds("real"), pipe.aligner.waits("aaa-junk")) == (True, True)
        assert dead_lettered(pipe) == {}
        pipe2, _ = clocked_pipeline(max_runs=2)
        pipe2.process([junk("held")])
        pipe2.process(order([junk("b")], [junk("a")]))  # equal counts: by name
        assert (pipe2.aligner.holds("a"), pipe2.aligner.waits("b")) == (True, True)


def test_a_run_on_probation_that_keeps_sending_keeps_its_place():
    pipe, clock = clocked_pipeline(max_runs=2, run_probation_idle_s=2.0, run_probation_steps=3, run_probation_s=1.0)
    pipe.process([junk("slow")])  # one step so far, still sending
    pipe.process([junk("quiet")])
    for i in range(5):
        clock.t += 1.5
        pipe.process([junk("slow", step=0)])  # a duplicate still counts as input
        pipe.process([junk(f"new-{i}")])
        assert pipe.aligner.holds("slow")
    assert not pipe.aligner.holds("quiet")  # the silent one gave way to a newcomer
    clock.t += 1.0
    for step in range(1, 3):  # its third whole step, over a second: off probation
        pipe.process([junk("slow", step=step)])
    assert not pipe.aligner.on_probation("slow")


def test_admission_settings_are_checked_and_reach_the_aligner():
    pipe, _ = clocked_pipeline(
        run_probation_steps=5, run_probation_s=4.0, run_wait_records=7, run_record_budget=10.0, run_budget_window_s=3.0
    )
    aligner = pipe.aligner
    assert (aligner.probation_steps, aligner.probation_s, aligner.wait_records, aligner.record_budget) == (
        5,
        4.0,
        7,
        10.0,
    )
    with pytest.raises(ConfigError, match=r"^detectors\.run_wait_records: must be an integer >= 1, got 0$"):
        PipelineSettings(run_wait_records=0)
    with pytest.raises(ConfigError, match=r"^detectors\.run_yield_idle_s: must be a number > 0, got 0.0$"):
        PipelineSettings(run_yield_idle_s=0.0)
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
    after them is watched within seconds, none of its records dead-lettered (they waited), and its
    NaN found at its step. Before: its first 80 records dead-lettered (runs), and before that every
    one of them for 15 minutes.

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
    assert pipe.runs_forgotten == 1 and source.dead_letter_reasons == {} and pipe.aligner.waiting_records == 0
    nonfinite = [(i.first_step, i.ranks) for i in sink.opened if i.run == "real" and i.kind == "nonfinite"]
    assert nonfinite == [(45, (2,))]


def test_a_run_that_gives_way_with_a_step_still_open_loses_none_of_its_records():
    """A run on probation gives way to a new one while a step of it is open (two of its four ranks
    sent it): those two records wait for its return with the rest of the step, nothing is
    dead-lettered, and the step is judged whole once the run has a place again."""
    pipe, clock = clocked_pipeline(max_runs=1)
    early = [Record("early", 0, rank, 4, "h", 0.0, 0, {"loss": 1.0}, {}, {}) for rank in range(4)]
    pipe.process(early[:2])
    clock.t += 3.0  # past run_probation_idle_s
    pipe.process([junk("newcomer")])
    assert pipe.aligner.held() == ["newcomer"] and pipe.aligner.waits("early")
    assert pipe.aligner.waiting_records == 2 and dead_lettered(pipe) == {}
    pipe.process(early[2:])  # the rest of its step; the newcomer is not silent yet
    assert pipe.aligner.waits("early")
    clock.t += 3.0
    pipe.tick()  # the newcomer silent, and it showed no more whole steps than "early" waits with
    assert pipe.aligner.held() == ["early"] and pipe.aligner.waiting_records == 0
    pipe.flush()
    assert steps_judged(pipe, "early") == 1 and dead_lettered(pipe) == {}


def test_a_burst_of_first_steps_then_a_pause_holds_its_place_against_a_flood_of_lesser_runs():
    """A real run's first 20 steps reach the service in one poll (it started before the service,
    or the bus caught up), then it pauses while one-record runs flood in: it stays on probation
    (20 steps at once are no evidence of time), but a newcomer that has shown fewer whole steps
    never takes its place; the flood takes turns in the other places. When it goes on, its whole
    steps over time end its probation, and its NaN is found."""
    pipe, clock = clocked_pipeline(max_runs=50)
    real = SyntheticRun(world=4, run="real", seed=11, faults=[Fault("nonfinite", 30, rank=2, length=1)])
    events = pipe.process([r for step in range(20) for r in real.records(step)])
    assert pipe.aligner.on_probation("real")
    for wave in range(5):  # 500 one-record runs, 100 every 3 s, for 49 places
        clock.t += 3.0
        events += pipe.process([junk(f"flood-{wave}-{i}") for i in range(100)])
        assert pipe.aligner.holds("real"), wave
    assert pipe.runs_forgotten == 4 * 49  # each wave took the places of the last one
    for step in range(20, 40):
        clock.t += 1.0
        events += pipe.process(real.records(step))
    assert not pipe.aligner.on_probation("real")
    events += pipe.flush()
    assert steps_judged(pipe, "real") == 40 and dead_lettered(pipe) == {}
    nonfinite = [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]
    assert [(i.run, i.first_step, i.ranks) for i in nonfinite] == [("real", 30, (2,))]


def test_a_paused_training_run_gives_way_only_to_a_run_that_trained_and_comes_back_with_its_credit():
    """An unsigned training run silent 2 minutes (a checkpoint) keeps its place while one-record
    runs flood in: only a newcomer that has shown training (20 whole steps over 10 s, waiting)
    takes it once it has been silent run_yield_idle_s. The run that gave way comes back with
    nothing lost: its records wait, it keeps the training it showed (no second probation), and
    it takes the place of a run on probation silent 2 s at once, across a restart too. What it
    loses is its detectors' history: they start afresh (warm-up again) and its open incidents
    resolved when it gave way."""
    pipe, clock = clocked_pipeline(max_runs=1)
    a, b = SyntheticRun(world=2, run="a", seed=12), SyntheticRun(world=2, run="b", seed=13)
    for step in range(25):  # 25 whole steps over 24 s: training
        pipe.process(a.records(step))
        clock.t += 1.0
    for i in range(120):  # a checkpoint: silent 2 minutes, while one-record runs come
        clock.t += 1.0
        pipe.process([junk(f"flood-{i}")])
        assert pipe.aligner.held() == ["a"], i
    for step in range(25):  # a real newcomer: it waits until it has shown training
        clock.t += 1.0
        pipe.process(b.records(step))
        assert pipe.aligner.holds("b") == (step >= 19), step
    assert pipe.aligner.on_probation("b") and pipe.runs_forgotten == 1
    state = json.loads(json.dumps(json_safe(pipe.snapshot())))  # the service restarts meanwhile
    pipe, clock = clocked_pipeline(max_runs=1)
    pipe.restore(state)
    for step in range(25, 35):  # "a" goes on: its records wait until "b" has been silent 2 s
        clock.t += 1.0
        pipe.process(a.records(step))
        assert pipe.aligner.holds("a") == (step >= 26), step
    assert not pipe.aligner.on_probation("a") and pipe.runs_forgotten == 1
    pipe.flush()
    assert dead_lettered(pipe) == {} and pipe.aligner.waiting_records == 120  # the flood still waits
    assert steps_judged(pipe, "a") == 10  # its detectors started afresh at step 25


def test_junk_runs_that_gave_way_do_not_take_turns_in_the_places_of_the_others():
    """50 one-rank junk runs x 40 steps are read ahead of a real run while the junk holds every
    place. Their excess waits (a pass judges 128 records, 2 of each run) while the real run waits for
    a place, so they fall silent and the real run takes a place 2 s later; the run that gave way
    then waits with its excess, which does not hold the others' back: their excess is judged, not
    traded. Before, each junk run gave way in turn to the one before it (50 evictions, each one's
    detectors rebuilt) and the junk's excess waited until the last had turned."""
    clock = Clock(1000.0)
    pipe = DetectionPipeline(PipelineSettings(max_runs=50, pass_records=128), clock=clock, wall=clock)
    bus = MemoryBus()
    source = MemorySource(bus)
    sink = ListSink()
    svc = DetectorService(source, pipe, sinks=[sink], poll_timeout=0.01, clock=clock)
    for step in range(40):
        for i in range(50):
            bus.append(TOPIC, b"junk", _v1([junk(f"junk-{i}", step)]))
    svc.step()  # the junk read first: it takes every place
    clock.t += 0.1
    real = SyntheticRun(world=8, run="real", seed=3, faults=[Fault("nonfinite", 30, rank=5, length=1)])
    placed = drained = None
    for step in range(60):  # a step of the real run a pass, a pass every 0.1 s
        bus.append(TOPIC, b"real", _v1(real.records(step)))
        svc.step()
        placed = step if placed is None and pipe.aligner.holds("real") else placed
        drained = step if drained is None and placed is not None and len(pipe.backlog) == 0 else drained
        clock.t += 0.1
    # placed 2 s after the junk fell silent; the junk's 1,900 records left judged at 128 a pass
    assert placed == 20 and drained == 35  # 15 passes of 128 (before: drained at 44, the last of 50 turns)
    # the real run's place, and no other: the junk's excess was judged in bounded passes, not traded
    assert pipe.runs_forgotten == 1
    svc.step()
    assert source.dead_letter_reasons == {} and pipe.aligner.waiting_records == 0
    nonfinite = [(i.run, i.first_step, i.ranks) for i in sink.opened if i.kind == "nonfinite"]
    assert nonfinite == [("real", 30, (5,))]


TRAINED = [(1.0 + k, "t") for k in range(25)]  # "t": 25 whole steps over 24 s, training


@pytest.mark.parametrize(
    "signed, held, start, alive, gave_way, at",
    [
        pytest.param({"s", "n"}, [(0.0, "s"), (3.0, "u")], 3.0, None, "s", 3.0, id="1-probation-silent-2s-before-2"),
        pytest.param({"s", "n"}, [(1.5, "s"), (2.9, "u")], 2.9, None, "u", 2.9, id="2-signed-takes-unsigned-at-once"),
        pytest.param(None, [*TRAINED, (923.0, "u")], 923.0, "u", "t", 925.0, id="3-any-takes-a-run-silent-900s"),
        pytest.param(None, [(0.0, "p"), *TRAINED], 881.0, "p", "p", 900.0, id="3-stale-before-4-training"),
        pytest.param({"s"}, [*TRAINED, (25.0, "s")], 25.0, None, "t", 55.0, id="4-trained-takes-training-silent-30s"),
    ],
)
def test_admission_is_the_first_rule_that_names_a_run_to_give_way(signed, held, start, alive, gave_way, at):
    """Two places, held by runs that sent a step at the times given (``alive`` goes on sending its
    last one); a newcomer sends a step a second from ``start``: who gives way, and when, says which
    rule decided, in which order (PipelineSettings' defaults)."""
    pipe, clock = clocked_pipeline(max_runs=2)
    pipe.signed = None if signed is None else signed.__contains__
    steps: dict[str, int] = {}
    for t, run in held:
        clock.t = t
        steps[run] = steps.get(run, -1) + 1
        pipe.process([junk(run, steps[run])])
    holding = pipe.aligner.held()
    for k in range(40):
        clock.t = start + k
        pipe.process([junk("n", k)] + ([junk(alive, steps[alive])] if alive else []))  # alive: not silent
        if pipe.aligner.holds("n"):
            break
    assert clock.t == at
    assert pipe.aligner.held() == [r for r in holding if r != gave_way] + ["n"]
