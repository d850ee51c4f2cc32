"""The run lifecycle: end-of-run markers close a run, finished and idle runs are evicted."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.messages import decode_message
from sdcwatch.core.record import encode_batch
from sdcwatch.service.aligner import StepAligner
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings
from sdcwatch.service.run_lifecycle import RunLifecycle
from sdcwatch.telemetry import (
    Emitter,
    MemoryBus,
    MemoryTransport,
    end_marker,
    is_end_marker,
)
from stand_ins import Clock, clocked_pipeline


def pipeline(**settings) -> tuple[DetectionPipeline, Clock]:
    settings.setdefault("run_end_expiry_s", 300.0)
    settings.setdefault("run_idle_expiry_s", 3600.0)
    return clocked_pipeline(**settings)


def markers(synth: SyntheticRun, step: int, ranks=None) -> list:
    return [
        end_marker(synth.run, step, r, synth.world, time=2e9) for r in (range(synth.world) if ranks is None else ranks)
    ]


def feed(pipe, synth, steps) -> list:
    events = []
    for s in steps:
        events += pipe.process(synth.records(s))
    return events


def run_view(pipe, run):
    return next((r for r in pipe.view().runs if r.run == run), None)


def test_a_run_that_ends_with_every_ranks_marker_resolves_its_incidents_then_leaves():
    synth = SyntheticRun(seed=1, run="done", faults=[Fault("nonfinite", 30, rank=3, length=1)])
    pipe, clock = pipeline()
    events = feed(pipe, synth, range(40))
    assert [e.incident.kind for e in events if e.change == "opened"] == ["nonfinite"]
    assert [i for i in pipe.book.current() if i.open]  # quiet for 9 steps only: still open when the run ends
    assert pipe.process(markers(synth, 39)) == []
    assert run_view(pipe, "done").finished
    closing = pipe.expire()
    assert [(e.change, e.incident.kind) for e in closing] == [("resolved", "nonfinite")]
    assert closing[0].incident.resolved_step == 39
    assert not [i for i in pipe.book.current() if i.open]
    assert pipe.expire() == []  # closed once
    clock.t += 299.0
    pipe.expire()
    assert run_view(pipe, "done") is not None  # still shown until the end expiry
    clock.t += 2.0
    assert pipe.expire() == []  # nothing left open to resolve
    view = pipe.view()
    assert view.runs == [] and [i for i in view.incidents if i.run == "done"] == []
    assert view.pipeline.runs_evicted_total == {"finished": 1, "idle": 0}
    assert "done" not in pipe.lifecycle and "done" not in pipe.aligner.snapshot()["runs"]


def test_a_run_whose_ranks_go_silent_is_not_finished_and_is_evicted_when_idle():
    synth = SyntheticRun(seed=1, run="silent", faults=[Fault("nonfinite", 30, rank=3, length=1)])
    pipe, clock = pipeline(run_stale_s=10_000.0)
    feed(pipe, synth, range(40))
    pipe.process(markers(synth, 39, ranks=range(synth.world - 1)))  # one rank never says goodbye
    assert pipe.expire() == []
    assert not run_view(pipe, "silent").finished
    assert [i for i in pipe.book.current() if i.open]
    clock.t += 3599.0
    assert pipe.expire() == []
    clock.t += 1.0
    events = pipe.expire()
    assert [(e.change, e.incident.kind) for e in events] == [("resolved", "nonfinite")]
    assert pipe.view().runs == [] and pipe.view().pipeline.runs_evicted_total == {"finished": 0, "idle": 1}


def test_input_keeps_a_run_alive_and_eviction_is_per_run():
    a, b = SyntheticRun(seed=1, run="a"), SyntheticRun(seed=2, run="b")
    pipe, clock = pipeline(run_idle_expiry_s=100.0)
    feed(pipe, a, range(5))
    feed(pipe, b, range(5))
    clock.t += 60.0
    feed(pipe, b, range(5, 10))
    clock.t += 60.0
    pipe.expire()
    assert [r.run for r in pipe.view().runs] == ["b"]


def test_last_steps_are_judged_before_the_run_closes():
    synth = SyntheticRun(seed=1, run="tail")
    pipe, _ = pipeline()
    feed(pipe, synth, range(20))
    last = synth.records(20)
    # rank 7's record of the last step is still on its way when the others end
    pipe.process(last[:-1] + markers(synth, 20, ranks=range(7)))
    assert pipe.expire() == [] and not run_view(pipe, "tail").finished
    pipe.process([last[-1]] + markers(synth, 20, ranks=[7]))
    pipe.expire()
    view = run_view(pipe, "tail")
    assert view.finished and view.last_step == 20 and view.steps_total == 21 and view.late_ranks == 0


def test_an_incomplete_last_step_closes_after_the_step_timeout():
    synth = SyntheticRun(seed=1, run="gap")
    pipe, clock = pipeline(align_timeout_s=5.0)
    feed(pipe, synth, range(10))
    pipe.process(synth.records(10)[:-1] + markers(synth, 10))  # rank 7's last record was lost
    assert pipe.expire() == [] and run_view(pipe, "gap").last_step == 9
    clock.t += 5.0
    pipe.expire()
    view = run_view(pipe, "gap")
    assert view.finished and view.last_step == 10 and view.late_ranks == 1


def test_redelivered_records_do_not_reopen_a_finished_run_but_a_new_run_of_the_same_name_starts_afresh():
    synth = SyntheticRun(seed=1, run="again")
    pipe, _ = pipeline()
    feed(pipe, synth, range(30))
    pipe.process(markers(synth, 29))
    pipe.expire()
    pipe.process(synth.records(29) + markers(synth, 29))  # at-least-once delivery after a restart
    assert run_view(pipe, "again").finished and run_view(pipe, "again").steps_total == 30
    fresh = SyntheticRun(seed=5, run="again")  # the name is used again, from step 0, after the markers
    pipe.process([replace(r, time=3e9) for r in fresh.records(0)])
    pipe.process([replace(r, time=3e9 + 1) for r in fresh.records(1)])
    view = run_view(pipe, "again")
    assert not view.finished and view.last_step == 1 and view.steps_total == 2
    assert pipe.view().pipeline.runs_evicted_total["finished"] == 1


def test_lifecycle_survives_a_snapshot():
    synth = SyntheticRun(seed=1, run="saved")
    pipe, _ = pipeline()
    feed(pipe, synth, range(10))
    pipe.process(markers(synth, 9, ranks=range(3)))
    state = pipe.snapshot()
    again, _ = pipeline()
    again.restore(state)
    assert again.lifecycle.ended_ranks("saved") == 3 and not again.lifecycle.finished("saved")
    again.process(markers(synth, 9, ranks=range(3, 8)))
    assert again.lifecycle.finished("saved")
    again.expire()
    restored, clock4 = pipeline()
    restored.restore(again.snapshot())
    assert restored.lifecycle.finished("saved")
    clock4.t += 300.0
    restored.expire()
    assert "saved" not in restored.lifecycle and restored.view().pipeline.runs_evicted_total["finished"] == 1
    old_state = dict(state)
    del old_state["lifecycle"]  # a state file written before the lifecycle existed
    old, clock3 = pipeline(run_idle_expiry_s=50.0)
    old.restore(old_state)
    clock3.t += 50.0
    old.expire()
    assert old.view().runs == []


def test_markers_of_another_world_size_count_afresh():
    life = RunLifecycle(clock=Clock(1000.0))
    assert not life.end(end_marker("r", 0, 0, 1)) and "r" not in life  # a run never admitted: ignored
    life.arrived(["r"])
    assert not any(life.end(m) for m in [end_marker("r", 5, rank, 4) for rank in range(3)])
    assert not life.end(end_marker("r", 9, 0, 2))  # elastic shrink: the old world's markers no longer count
    assert life.end(end_marker("r", 9, 1, 2)) and life.finished("r")


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="run_end_expiry_s"):
        PipelineSettings(run_end_expiry_s=0)
    with pytest.raises(ConfigError, match="idle_expiry"):
        RunLifecycle(idle_expiry=-1.0)


def test_an_older_service_drops_the_marker_as_a_duplicate():
    """The marker is a plain version-1 record at the rank's last step: decoders and aligners
    that know nothing of it take it as a second copy of that step's record."""
    synth = SyntheticRun(seed=1, world=4, run="compat")
    marker = end_marker("compat", 0, 2, 4, host="node0")
    (decoded,) = decode_message(encode_batch([marker]))
    assert is_end_marker(decoded) and decoded.step == 0 and decoded.rank == 2
    aligner = StepAligner()
    frames = aligner.add(synth.records(0))
    frames += aligner.add([decoded])
    assert len(frames) == 1 and aligner.late_records == 1  # after the step closed: late, dropped
    aligner = StepAligner()
    frames = aligner.add(synth.records(0)[:3])
    frames += aligner.add([decoded])
    assert aligner.duplicates == 1 and frames == []  # while the step is open: a duplicate, dropped


def test_emitter_sends_one_marker_after_its_records_and_none_when_the_run_failed():
    bus = MemoryBus()
    with Emitter(MemoryTransport(bus), run="e", rank=1, world=2, host="h") as em:
        for step in range(5):
            em.emit(step, loss=1.0)
    recs = bus.records()
    assert [(r.step, is_end_marker(r)) for r in recs] == [(s, False) for s in range(5)] + [(4, True)]
    assert recs[-1].rank == 1 and recs[-1].world == 2 and em.ended and em.sent == 5

    bus = MemoryBus()
    with pytest.raises(RuntimeError), Emitter(MemoryTransport(bus), run="e", rank=0, world=1) as em:
        em.emit(0, loss=1.0)
        raise RuntimeError("training crashed")
    assert [is_end_marker(r) for r in bus.records()] == [False] and not em.ended

    for stop, ends in ((KeyboardInterrupt(), True), (SystemExit(0), True), (SystemExit(3), False)):
        bus = MemoryBus()
        with pytest.raises(type(stop)), Emitter(MemoryTransport(bus), run="e", rank=0, world=1) as em:
            em.emit(0, loss=1.0)
            raise stop
        assert [is_end_marker(r) for r in bus.records()] == [False] + [True] * ends and em.ended == ends

    bus = MemoryBus()
    em = Emitter(MemoryTransport(bus), run="e", rank=0, world=1, end_marker=False)
    em.emit(0, loss=1.0)
    em.close()
    assert [is_end_marker(r) for r in bus.records()] == [False]

    bus = MemoryBus()
    Emitter(MemoryTransport(bus), run="e", rank=0, world=1).close()  # nothing emitted: nothing to end
    assert bus.records() == []


def test_emitter_sends_no_marker_when_records_were_left_unsent():
    bus = MemoryBus()
    bus.down = True
    em = Emitter(MemoryTransport(bus), run="e", rank=0, world=1)
    em.emit(0, loss=1.0)
    em.close(timeout=0.2)
    bus.down = False
    assert bus.records() == [] and not em.ended and em.dropped == 1


def test_rank_scores_and_view_of_a_finished_run_stay_consistent():
    synth = SyntheticRun(seed=1, run="v")
    pipe, _ = pipeline()
    feed(pipe, synth, range(10))
    before = run_view(pipe, "v")
    pipe.process(markers(synth, 9))
    pipe.expire()
    after = run_view(pipe, "v")
    assert after.finished and not before.finished
    assert after.last_step == before.last_step and np.array_equal(
        after.detector_values["sdcwatch_rank_outlier_score"], before.detector_values["sdcwatch_rank_outlier_score"]
    )


def test_split_stages_pass_the_end_of_a_run_from_the_spatial_to_the_temporal_stage():
    from sdcwatch.service.summary import decode_summary, encode_summary

    synth = SyntheticRun(seed=1, run="split", faults=[Fault("nonfinite", 30, rank=3, length=1)])
    clock = Clock(1000.0)
    spatial = DetectionPipeline(PipelineSettings(), stage="spatial", clock=clock, wall=clock)
    temporal = DetectionPipeline(PipelineSettings(), stage="temporal", clock=clock, wall=clock)

    def relay():
        wire = [encode_summary(x) for x in spatial.outbox]
        spatial.outbox.clear()
        return temporal.process_summaries([decode_summary(w) for w in wire])

    events = []
    for step in range(40):
        spatial.process(synth.records(step))
        events += relay()
        clock.t += 3.0  # past the order grace: the temporal stage judges what it holds
        events += temporal.tick()
    assert [e.incident.kind for e in events if e.change == "opened"] == ["nonfinite"]
    spatial.process(markers(synth, 39))
    spatial.expire()
    (end,) = spatial.outbox
    assert end.ended and end.step == 39 and decode_summary(encode_summary(end)).ended
    assert not decode_summary(encode_summary(spatial.outbox[0].__class__(run="x", step=1, world=1, n_present=1))).ended
    relay()
    assert temporal.lifecycle.finished("split") and run_view(temporal, "split").finished
    closing = temporal.expire()
    assert [(e.change, e.incident.kind) for e in closing] == [("resolved", "nonfinite")]
    clock.t += 300.0
    spatial.expire()
    temporal.expire()
    assert "split" not in spatial.lifecycle and temporal.view().runs == []


def test_runs_past_max_runs_leave_no_lifecycle_state_and_a_stale_run_makes_room_by_eviction():
    a, b = (
        SyntheticRun(seed=1, run="a", faults=[Fault("nonfinite", 5, rank=3, length=1)]),
        SyntheticRun(seed=2, run="b"),
    )
    pipe, clock = pipeline(max_runs=1, run_stale_s=100.0)
    feed(pipe, a, range(10))
    feed(pipe, b, range(3))  # run a is training: b does not fit
    pipe.process(markers(b, 2))
    assert "b" not in pipe.lifecycle and len(pipe.lifecycle) == 1
    clock.t += 100.0  # a falls silent; its incident resolves as stale, then b takes its place
    events = pipe.expire() + feed(pipe, b, range(3, 6))
    assert [(e.change, e.incident.run) for e in events] == [("resolved", "a")]
    assert "a" not in pipe.lifecycle and "b" in pipe.lifecycle and [i.run for i in pipe.view().incidents] == []


def test_a_rank_that_left_with_its_marker_is_not_reported_missing_and_one_that_vanished_is():
    """A replica that leaves the job (the guard's elastic eviction) sends its end-of-run marker at the
    step it leaves; the others go on: its absence is no missing rank. A rank that just stops is."""

    def gone_after(synth: SyntheticRun, rank: int, last: int, steps) -> list:
        events = []
        for s in steps:
            recs = synth.records(s)
            events += pipe.process([r for r in recs if r.rank != rank or s <= last])
        return events

    synth = SyntheticRun(seed=3, run="elastic")
    pipe, clock = pipeline()
    events = feed(pipe, synth, range(20))
    pipe.process(markers(synth, 19, ranks=[5]))  # rank 5 left after step 19
    events += gone_after(synth, 5, 19, range(20, 60))
    events += pipe.flush()
    assert not [e for e in events if e.incident.kind == "missing_rank"]

    vanished = SyntheticRun(seed=3, run="vanished")
    pipe, clock = pipeline()
    events = feed(pipe, vanished, range(20))
    events += gone_after(vanished, 5, 19, range(20, 60))
    events += pipe.flush()
    missing = [e.incident for e in events if e.change == "opened" and e.incident.kind == "missing_rank"]
    assert [i.ranks for i in missing] == [(5,)]
