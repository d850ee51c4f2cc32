"""One incident per fault: a later fault on other ranks is a new incident naming its own rank, step
and layer, never folded into an earlier one with the ranks unioned; what one fault spreads to in
its step stays that fault's incident, blaming its origin."""

from __future__ import annotations

import math

import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import LAYER_METRICS
from sdcwatch.detectors import Finding, NonFiniteDetector, Severity
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.service.incidents import IncidentBook
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings


def finding(step, ranks, kind="nonfinite", sev=Severity.CRITICAL, msg="m", **kw):
    return Finding(detector="d", kind=kind, severity=sev, run="r", step=step, score=1.0, message=msg, ranks=ranks, **kw)


def incidents_of(pipe, kind):
    return sorted((i for i in pipe.incidents() if i.kind == kind), key=lambda i: i.first_step)


def synthetic(faults, steps, settings=None):
    pipe = DetectionPipeline(settings)
    synth = SyntheticRun(world=8, seed=2, faults=faults)
    events = []
    for s in range(steps):
        events += pipe.process(synth.records(s))
    return pipe, events + pipe.flush()


# -- through the detection pipeline, synthetic records ------------------------------------------


@pytest.mark.parametrize("second", [60, 300], ids=["first-still-open", "first-resolved"])
def test_two_nans_on_two_ranks_are_two_incidents(second):
    pipe, events = synthetic(
        [Fault("nonfinite", 45, rank=1, layer=2), Fault("nonfinite", second, rank=5, layer=0)], 400
    )
    a, b = incidents_of(pipe, "nonfinite")
    assert (a.first_step, a.last_step, a.ranks, a.hosts, a.layer) == (45, 45, (1,), ("node0",), 2)
    assert (b.first_step, b.last_step, b.ranks, b.hosts, b.layer) == (second, second, (5,), ("node1",), 0)
    assert a.id != b.id and "rank 5" in b.message and "rank 5" not in a.message
    opened = [e.incident.id for e in events if e.change == "opened"]
    assert opened == [a.id, b.id]
    assert not [e for e in events if e.change == "updated" and e.incident.id == a.id]  # a is left alone


def test_a_nan_on_another_rank_at_the_next_step_is_a_new_onset():
    """Consecutive bad steps are one streak only while the streak's origin stays bad: rank 1's NaN
    at step 45 is gone at 46, where rank 5 has one of its own."""
    pipe, _ = synthetic([Fault("nonfinite", 45, rank=1, layer=2), Fault("nonfinite", 46, rank=5, layer=0)], 120)
    a, b = incidents_of(pipe, "nonfinite")
    assert (a.first_step, a.ranks, a.layer) == (45, (1,), 2)
    assert (b.first_step, b.ranks, b.layer) == (46, (5,), 0)
    assert b.message.startswith("non-finite value at step 46: attn_logit_max layer 0 = inf on rank 5")


def test_nans_on_two_ranks_at_one_step_are_one_incident():
    pipe, _ = synthetic([Fault("nonfinite", 45, rank=1, layer=2), Fault("nonfinite", 45, rank=5, layer=0)], 120)
    (inc,) = incidents_of(pipe, "nonfinite")
    assert (inc.first_step, inc.ranks) == (45, (1, 5))


def test_a_second_diverged_replica_is_its_own_incident_while_the_first_stays_diverged():
    """Rank 1's parameters differ from step 45 on (it stays diverged: one open incident); rank 5's
    differ from step 60: the findings from then on name both, each incident keeps its own rank."""
    pipe, _ = synthetic([Fault("replica", 45, rank=1), Fault("replica", 60, rank=5)], 90)
    a, b = incidents_of(pipe, "replica_divergence")
    assert (a.first_step, a.last_step, a.ranks, a.hosts) == (45, 89, (1,), ("node0",))
    assert (b.first_step, b.last_step, b.ranks, b.hosts) == (60, 89, (5,), ("node1",))
    assert b.evidence["finding_ranks"] == [1, 5]  # the step's finding named both


# -- a real training job (simulated data-parallel ranks of the reference model) ----------------


def _simulated(faults, steps, **settings):
    """The records of a 4-rank simulated job with NaNs written into attention scores (``faults``:
    (rank, step, block)), as the demo's NaN preset writes them."""
    pytest.importorskip("torch")
    import torch
    from sdcwatch.testbed.campaign.branches import RecordCollector
    from sdcwatch.testbed.faultspec import FaultSpec
    from sdcwatch.testbed.model import GPTConfig
    from sdcwatch.testbed.simulated import SimulatedRun, shared_corpus

    torch.set_num_threads(1)
    records: list = []
    specs = [
        FaultSpec(kind="nan", rank=r, step=s, duration=1, target=f"blocks.{b}.attn.scores", where="output", seed=1)
        for r, s, b in faults
    ]
    run = SimulatedRun(
        world=4,
        seed=1,
        faults=specs,
        model=GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4),
        batch_size=2,
        corpus=shared_corpus(1 << 18),
        emitter_factory=lambda rank, host: RecordCollector(records, run="job", rank=rank, world=4, host=host),
        **settings,
    )
    try:
        run.train(steps)
    finally:
        run.close()
    return records


def _incidents(records, settings=None):
    pipe = DetectionPipeline(settings)
    pipe.process(records)
    pipe.flush()
    return incidents_of(pipe, "nonfinite")


def test_two_nans_in_a_training_job_are_two_incidents_naming_their_own_rank_step_and_layer():
    """The job skips a non-finite update (as Megatron-LM and loss scalers do), so it trains on
    cleanly after each NaN: rank 1's at step 4 in block 1, rank 3's at step 20 in block 0."""
    records = _simulated([(1, 4, 1), (3, 20, 0)], 24, skip_nonfinite=True)
    # the first incident still open at step 20 (the default: resolved after 50 quiet steps), and resolved
    for settings in (None, PipelineSettings(resolve_after_steps=10)):
        a, b = _incidents(records, settings)
        assert (a.first_step, a.last_step, a.ranks, a.layer) == (4, 4, (1,), 1), a
        assert (b.first_step, b.last_step, b.ranks, b.layer) == (20, 20, (3,), 0), b
        assert "rank 1" in a.message and "rank 3" in b.message
        assert a.resolved_step == (14 if settings else None)


def test_a_nan_that_spreads_to_every_rank_stays_one_incident_blaming_its_origin():
    """Without a skip the NaN reaches every replica through the all-reduce at its step (every rank's
    all-reduced values go bad) and every rank's own values from the next step on."""
    records = _simulated([(2, 4, 1)], 9)
    bad = {r.rank for r in records if r.step == 6 and not math.isfinite(r.scalars["loss"])}
    assert bad == {0, 1, 2, 3}  # it did spread
    (inc,) = _incidents(records)
    assert (inc.first_step, inc.last_step, inc.ranks, inc.layer) == (4, 8, (2,), 1)
    assert "the all-reduced values of 3 other rank(s) followed" in inc.message


# -- the detector's streak -------------------------------------------------------------------------


def _frame(step, bad=(), absent=()):
    records = []
    for rank in range(4):
        if rank in absent:
            continue
        layers = {m: [1.0, 1.0] for m in LAYER_METRICS}
        for r, layer in bad:
            if r == rank:
                layers["q_norm_mean"][layer] = math.nan
        scalars = {"loss": math.nan if rank in dict(bad) else 2.0, "grad_norm_global": 1.0}
        records.append(Record.make(run="r", step=step, rank=rank, world=4, scalars=scalars, layers=layers))
    return StepFrame.from_records("r", step, 4, records)


def test_a_streak_goes_on_while_its_origin_is_bad_or_silent():
    det, book = NonFiniteDetector(), IncidentBook()
    book.add(det.update(_frame(10, bad=[(1, 1)])))
    every = [(r, layer) for r in range(4) for layer in range(2)]
    (f,) = det.update(_frame(11, bad=every))  # spread: still rank 1's
    assert f.ranks == (1,) and f.message.startswith("non-finite values since step 10, which began on rank 1")
    (g,) = det.update(_frame(12, bad=[(0, 0), (2, 0), (3, 0)], absent=(1,)))  # its record is late
    assert g.ranks == (1,)
    book.add([f, g])
    (h,) = det.update(_frame(13, bad=[(3, 0)]))  # rank 1 clean again, rank 3 bad: a new onset
    assert h.ranks == (3,) and h.message.startswith("non-finite value at step 13")
    book.add([h])
    assert sorted((i.first_step, i.ranks) for i in [i for i in book.current() if i.open]) == [(10, (1,)), (13, (3,))]


# -- the book's rule ----------------------------------------------------------------------------


def test_the_book_splits_a_finding_between_the_incident_it_continues_and_a_new_one():
    book = IncidentBook()
    book.add([finding(5, (1,), kind="replica_divergence", hosts=("h1",), coords=({"dp_replicate": 1},))])
    both = finding(
        9, (1, 5), kind="replica_divergence", hosts=("h1", "h5"), coords=({"dp_replicate": 1}, {"dp_replicate": 5})
    )
    ev = book.add([both], hosts=[f"h{r}" for r in range(8)])
    assert [(e.change, e.incident.first_step, e.incident.ranks, e.incident.hosts) for e in ev] == [
        ("opened", 9, (5,), ("h5",))
    ]
    assert ev[0].incident.coords == ({"dp_replicate": 5},)
    first = next(i for i in [i for i in book.current() if i.open] if i.first_step == 5)
    assert (first.ranks, first.hosts, first.last_step) == ((1,), ("h1",), 9)
    # a finding that blames no rank (replicas split) goes on with the latest incident of its kind
    assert book.add([finding(10, (), kind="replica_divergence")]) == []
    assert {i.first_step: i.last_step for i in [i for i in book.current() if i.open]} == {5: 9, 9: 10}


def test_a_finding_on_several_ranks_of_a_rank_local_kind_feeds_each_ranks_own_incident():
    """A checksum mismatch on ranks 1 and 5 at one step: two incidents, each with its rank's product."""
    hits = [
        {"rank": 5, "metric": "gemm_bwd", "layer": 3, "ratio": 90.0},
        {"rank": 1, "metric": "gemm_fwd", "layer": 0, "ratio": 40.0},
    ]
    f = finding(
        7, (1, 5), kind="checksum_mismatch", metric="gemm_bwd", layer=3, hosts=("h1", "h5"), evidence={"hits": hits}
    )
    ev = IncidentBook().add([f], hosts=[f"h{r}" for r in range(8)])
    assert sorted(
        (e.incident.id, e.incident.ranks, e.incident.hosts, e.incident.metric, e.incident.layer) for e in ev
    ) == [
        ("r:checksum_mismatch:7:r1", (1,), ("h1",), "gemm_fwd", 0),
        ("r:checksum_mismatch:7:r5", (5,), ("h5",), "gemm_bwd", 3),
    ]
    assert all(e.change == "opened" for e in ev)


def test_an_incident_restored_from_an_older_state_goes_on_and_a_new_rank_opens_its_own():
    old = IncidentBook()
    old.add([finding(45, (1,))])
    state = old.snapshot()
    state["open"] = [[["r", "nonfinite"], d] for _, d in state["open"]]  # the key older books wrote
    book = IncidentBook()
    book.restore(state)
    assert book.add([finding(46, (1,))]) == []  # the same fault, still bad
    (ev,) = book.add([finding(47, (5,))])
    assert (ev.change, ev.incident.first_step, ev.incident.ranks) == ("opened", 47, (5,))
    assert sorted(i.last_step for i in [i for i in book.current() if i.open]) == [46, 47]
