"""A non-finite value under tensor parallelism is blamed on the rank that saw it first in its forward
pass (``nonfinite_first``), not on the tensor-parallel peers the all-reduce handed it to; records
without the position keep every rank of the group named; a forged position never crashes the
service: the decoders of all three wires refuse one that is not a finite number >= 0."""

from __future__ import annotations

import dataclasses
import math

import pytest
from counter_wire import FORGED, assert_forged_is_dead_lettered, assert_travels_on_every_wire
from mesh_synth import MeshFault, MeshRun
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import FIRST_BAD
from sdcwatch.detectors import NonFiniteDetector, StepFrame
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.summary import decode_summary, encode_summary

STEP = 30


def tp_nan(first: dict[int, float] | None = None, *, coords: bool = True, tp: bool = True, mesh: MeshRun | None = None):
    """(frame, culprit, peer): a NaN made in the attention of rank ``culprit`` (tp=1, pp=0, dp=2)
    that the row-parallel all-reduce handed to its tensor-parallel peer (tp=0): both report a bad
    value of their own in the same layer (the metrics alone cannot order them). ``first``: rank -> nonfinite_first."""
    mesh = mesh or MeshRun()
    culprit, peer = mesh.rank_of(tp=1, pp=0, dp=2), mesh.rank_of(tp=0, pp=0, dp=2)
    mesh.faults = [MeshFault("nonfinite", step=STEP, rank=culprit)]
    records = []
    for rec in mesh.records(STEP):
        scalars, layers = dict(rec.scalars), dict(rec.layers)
        if rec.rank == peer:  # the all-reduced residual stream: bad on the peer too
            layers["attn_logit_max"] = tuple(math.nan if i == 1 else v for i, v in enumerate(layers["attn_logit_max"]))
        if first and rec.rank in first:
            scalars[FIRST_BAD] = first[rec.rank]
        where = {d: v for d, v in rec.coords.items() if tp or d != "tp"} if coords else {}
        records.append(dataclasses.replace(rec, scalars=scalars, layers=layers, coords=where))
    return StepFrame.from_records(mesh.run, STEP, mesh.world, records), culprit, peer


def test_the_rank_that_saw_it_first_is_blamed_and_its_tensor_peer_follows():
    frame, culprit, peer = tp_nan({})
    [before] = NonFiniteDetector().update(frame)
    assert set(before.ranks) == {culprit, peer}  # without positions the same layer metric: both, as before
    frame, culprit, peer = tp_nan({culprit: 9.0, peer: 15.0})
    [f] = NonFiniteDetector().update(frame)
    assert f.ranks == (culprit,)
    assert f.evidence["tensor_parallel_followers"] == [peer]
    assert f.evidence["first_bad_position"] == {str(peer): 15.0, str(culprit): 9.0}
    assert "first in its tensor-parallel group's forward pass (position 9)" in f.message
    assert "1 other rank(s) of its tensor-parallel group received it (all-reduce)" in f.message
    assert f.metric == "attn_logit_max" and f.layer == 1  # the culprit's own hit
    # the later stage of its pipeline is still a pipeline follower, not blamed
    assert f.evidence["pipeline_followers"]


def test_the_blame_follows_the_positions_not_the_rank_numbers():
    mesh = MeshRun()
    culprit, peer = mesh.rank_of(tp=1, pp=0, dp=2), mesh.rank_of(tp=0, pp=0, dp=2)
    frame, _, _ = tp_nan({culprit: 20.0, peer: 3.0})
    [f] = NonFiniteDetector().update(frame)
    assert f.ranks == (peer,) and f.evidence["tensor_parallel_followers"] == [culprit]


def test_a_peer_without_a_position_saw_nothing_bad_in_its_forward_pass():
    """Its bad values came after the collective (a vocabulary-parallel loss, its gradients)."""
    mesh = MeshRun()
    culprit, peer = mesh.rank_of(tp=1, pp=0, dp=2), mesh.rank_of(tp=0, pp=0, dp=2)
    [f] = NonFiniteDetector().update(tp_nan({culprit: 4.0})[0])
    assert f.ranks == (culprit,) and f.evidence["tensor_parallel_followers"] == [peer]


def test_equal_positions_and_ranks_without_tensor_coordinates_keep_every_rank_named():
    mesh = MeshRun()
    culprit, peer = mesh.rank_of(tp=1, pp=0, dp=2), mesh.rank_of(tp=0, pp=0, dp=2)
    [tie] = NonFiniteDetector().update(tp_nan({culprit: 7.0, peer: 7.0})[0])
    assert set(tie.ranks) == {culprit, peer} and "tensor_parallel_followers" not in tie.evidence
    # no coordinates (a data-parallel job: DDP, FSDP): positions change nothing
    [flat] = NonFiniteDetector().update(tp_nan({culprit: 4.0, peer: 9.0}, coords=False)[0])
    assert culprit in flat.ranks and peer in flat.ranks and "tensor_parallel_followers" not in flat.evidence
    assert "tensor-parallel" not in flat.message
    # coordinates without ``tp`` (a launcher that does not say): no tensor-parallel group to judge
    [untold] = NonFiniteDetector().update(tp_nan({culprit: 4.0, peer: 9.0}, tp=False)[0])
    assert {culprit, peer} <= set(untold.ranks) and "tensor_parallel_followers" not in untold.evidence


def test_positions_of_other_tensor_groups_do_not_decide_for_this_one():
    """Two replicas each with a NaN made at once: each group is judged on its own ranks."""
    mesh = MeshRun()
    a1, a0 = mesh.rank_of(tp=1, pp=0, dp=2), mesh.rank_of(tp=0, pp=0, dp=2)
    b1, b0 = mesh.rank_of(tp=1, pp=0, dp=0), mesh.rank_of(tp=0, pp=0, dp=0)
    frame, _, _ = tp_nan({a1: 30.0, a0: 40.0, b0: 5.0})
    li = frame.layer_names.index("attn_logit_max")
    frame.layers[[b0, b1], li, :] = math.nan
    [f] = NonFiniteDetector().update(frame)
    assert set(f.ranks) == {a1, b0}
    assert f.evidence["tensor_parallel_followers"] == sorted([a0, b1])


@pytest.mark.parametrize("role", ["both", "split"])
def test_the_incident_names_the_first_rank_through_the_pipeline_split_or_not(role):
    mesh = MeshRun()
    culprit, peer = mesh.rank_of(tp=1, pp=0, dp=2), mesh.rank_of(tp=0, pp=0, dp=2)
    frames = [mesh.frame(s) for s in range(STEP)] + [tp_nan({culprit: 2.0, peer: 11.0})[0]]
    if role == "both":
        pipe = DetectionPipeline()
        events = [e for f in frames for e in pipe.process_frame(f)]
    else:
        spatial, temporal = DetectionPipeline(stage="spatial"), DetectionPipeline(stage="temporal")
        events = []
        for f in frames:
            spatial.process_frame(f)
            events += temporal.process_summaries([decode_summary(encode_summary(x)) for x in spatial.take_summaries()])
        events += temporal.flush()
    opened = [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]
    assert [i.ranks for i in opened] == [(culprit,)]


def test_a_huge_but_valid_position_is_not_a_near_inf_value():
    """The position is bookkeeping: 1e15 on a clean step is no finding."""
    mesh = MeshRun()
    records = [
        dataclasses.replace(r, scalars={**r.scalars, FIRST_BAD: 1e15}) if r.rank == 3 else r for r in mesh.records(5)
    ]
    assert NonFiniteDetector().update(StepFrame.from_records(mesh.run, 5, mesh.world, records)) == []


def _record(value: float) -> Record:
    return Record("r", 1, 0, 4, "h", 1.0, 0, {"loss": 1.0, FIRST_BAD: value}, {}, {"stream_max": (math.nan,)})


def test_a_position_travels_on_every_wire():
    assert_travels_on_every_wire(_record(12.0), FIRST_BAD)


@pytest.mark.parametrize("bad", FORGED)
def test_a_forged_position_is_dead_lettered_on_every_wire(bad, tmp_path):
    assert_forged_is_dead_lettered(_record(bad), FIRST_BAD, 3.0, tmp_path)
