"""StepAligner and StepFrame: grouping by step across ranks, deadlines, duplicates, order, runs, world changes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from detector_synth import SyntheticRun
from hypothesis import given, settings
from hypothesis import strategies as st
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.record_type import Record
from sdcwatch.detectors import StepFrame
from sdcwatch.service.aligner import StepAligner
from stand_ins import Clock


def test_frame_from_records_puts_every_value_in_its_cell():
    recs = SyntheticRun(world=4, n_layers=3, seed=1).records(10)
    f = StepFrame.from_records("synth", 10, 4, recs)
    assert f.complete and f.present.all()
    for r in recs:
        assert f.scalar("loss")[r.rank] == r.scalars["loss"]
        assert np.allclose(f.layers[r.rank, f.layer_names.index("q_norm_mean")], r.layers["q_norm_mean"])
        assert int(f.fingerprints[r.rank, f.fp_names.index("param_fp")]) == r.fingerprints["param_fp"]
        assert f.hosts[r.rank] == r.host
    assert f.scalar("no_such_metric") is None


def test_frame_tells_a_sent_nan_from_a_missing_value():
    a = Record("r", 1, 0, 2, scalars={"loss": math.nan})
    b = Record("r", 1, 1, 2, scalars={"lr": 1.0})
    f = StepFrame.from_records("r", 1, 2, [a, b])
    sent = f.sent_scalars()
    assert sent[0, f.scalar_names.index("loss")] and not sent[1, f.scalar_names.index("loss")]


def test_complete_step_closes_at_once_and_incomplete_one_at_its_deadline():
    clock = Clock()
    al = StepAligner(timeout=2.0, clock=clock)
    synth = SyntheticRun(world=4)
    assert [f.step for f in al.add(synth.records(0))] == [0]
    partial = synth.records(1)[:3]
    assert al.add(partial) == []
    clock.t = 1.9
    assert al.poll() == []
    clock.t = 2.1
    (frame,) = al.poll()
    assert frame.step == 1 and not frame.complete and list(frame.present) == [True, True, True, False]
    assert al.incomplete_steps == 1


def test_duplicates_and_records_of_closed_steps_are_dropped_and_counted():
    al = StepAligner(timeout=5.0, clock=Clock())
    recs = SyntheticRun(world=4).records(0)
    al.add(recs[:2] + recs[:1])
    assert al.duplicates == 1
    assert [f.step for f in al.add(recs[2:])] == [0]
    assert al.add(recs[:1]) == []
    assert al.late_records == 1


def test_out_of_order_steps_leave_in_step_order():
    al = StepAligner(timeout=5.0, clock=Clock())
    synth = SyntheticRun(world=3)
    r0, r1 = synth.records(0), synth.records(1)
    assert al.add(r1 + r0[:2]) == []  # step 1 complete but waits for step 0
    assert [f.step for f in al.add(r0[2:])] == [0, 1]


def test_a_complete_step_after_a_gap_waits_the_reorder_grace():
    clock = Clock()
    al = StepAligner(timeout=5.0, reorder_grace=0.5, clock=clock)
    synth = SyntheticRun(world=2)
    assert [f.step for f in al.add(synth.records(0))] == [0]  # the first step of a run: in order
    assert al.add(synth.records(2)) == []  # step 1 may still come
    assert [f.step for f in al.add(synth.records(1))] == [1, 2]
    assert al.add(synth.records(4)) == []
    clock.t = 0.6
    assert [f.step for f in al.poll()] == [4]  # grace over: step 3 never came
    # stride learnt: a run that logs every 2nd step flows without waiting
    assert [f.step for f in al.add(synth.records(6))] == [6]


def test_a_complete_step_out_of_order_waits_for_the_earlier_ones_while_the_bus_has_a_backlog():
    # a service behind the topic reads the next 16-step window (another partition) before the
    # rest of this one: the later step must not close ahead of them and make their records late
    clock = Clock()
    al = StepAligner(timeout=5.0, reorder_grace=0.5, clock=clock)
    synth = SyntheticRun(world=2)
    assert [f.step for f in al.add(synth.records(0))] == [0]
    al.backlog = True
    assert al.add(synth.records(16)) == []
    clock.t = 2.0  # past the grace: still waiting, the earlier steps are on the bus
    assert al.poll() == []
    assert [f.step for f in al.add([r for s in range(1, 16) for r in synth.records(s)])] == list(range(1, 17))
    assert al.late_records == 0
    assert al.add(synth.records(18)) == []
    clock.t = 7.1  # the timeout still bounds the wait
    assert [f.step for f in al.poll()] == [18]
    al.backlog = False
    assert al.add(synth.records(23)) == []  # the stride is now 2: 20 was next
    clock.t = 7.7  # no backlog: the grace applies again
    assert [f.step for f in al.poll()] == [23]


def test_too_many_open_steps_force_the_oldest_out():
    al = StepAligner(timeout=100.0, max_open=3, clock=Clock())
    synth = SyntheticRun(world=2)
    out = []
    for s in range(6):
        out += al.add(synth.records(s)[:1])
    assert [f.step for f in out] == [0, 1, 2]


def test_runs_are_kept_apart():
    al = StepAligner(timeout=5.0, clock=Clock())
    a, b = SyntheticRun(world=2, run="a"), SyntheticRun(world=3, run="b")
    frames = al.add(a.records(0) + b.records(0)[:2])
    assert [(f.run, f.step, f.world) for f in frames] == [("a", 0, 2)]
    assert [(f.run, f.world) for f in al.add(b.records(0)[2:])] == [("b", 3)]


def test_world_size_change_closes_the_old_alignment_and_starts_a_new_one():
    al = StepAligner(timeout=5.0, clock=Clock())
    old, new = SyntheticRun(world=4), SyntheticRun(world=2)
    al.add(old.records(0))
    pending = al.add(old.records(1)[:3])
    assert pending == []
    frames = al.add(new.records(2))
    assert [(f.step, f.world, f.complete) for f in frames] == [(1, 4, False), (2, 2, True)]
    assert al.world_changes == 1


def test_snapshot_keeps_open_steps():
    clock = Clock()
    al = StepAligner(timeout=5.0, clock=clock)
    recs = SyntheticRun(world=3).records(0)
    al.add(recs[:2])
    state = json.loads(json.dumps(al.snapshot()))
    al2 = StepAligner(timeout=5.0, clock=clock)
    al2.restore(state)
    assert al2.add(recs[:1]) == []  # a duplicate of a restored record
    assert [f.step for f in al2.add(recs[2:])] == [0]


@pytest.mark.parametrize("kw", [{"timeout": 0}, {"timeout": -1}, {"max_open": 0}])
def test_bad_settings_are_named(kw):
    with pytest.raises(ConfigError) as exc:
        StepAligner(**kw)
    assert f"aligner.{next(iter(kw))}" in str(exc.value)


@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(0, 3))
def test_any_order_with_duplicates_gives_the_same_frames_in_step_order(rnd, dup_every):
    synth = SyntheticRun(world=3, seed=1)
    records = [r for s in range(6) for r in synth.records(s)]
    shuffled = records + (records[:: dup_every + 1] if dup_every else [])
    rnd.shuffle(shuffled)
    al = StepAligner(timeout=1e9, max_open=100, clock=Clock())
    frames = []
    for i in range(0, len(shuffled), 4):
        frames += al.add(shuffled[i : i + 4])
    frames += al.flush()
    assert [f.step for f in frames] == list(range(6))
    assert all(f.complete for f in frames)
    for f in frames:
        assert np.array_equal(f.scalars, synth.frame(f.step).scalars)
