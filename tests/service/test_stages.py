"""The scale-out split: spatial instances (whole steps each) -> step summaries -> one temporal stage."""

from __future__ import annotations

import json

import numpy as np
import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.errors import ConfigError, SummaryError
from sdcwatch.core.record import encode
from sdcwatch.detectors.river_hst import RiverHalfSpaceTrees
from memory_source import MemorySource
from sdcwatch.service.bus import decode_summary_message
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.summary import StepSummary, SummaryOrder, decode_summary, encode_summary
from sdcwatch.telemetry import MemoryBus


def one_process(synth, steps):
    pipe = DetectionPipeline()
    for s in steps:
        pipe.process(synth.records(s))
    pipe.flush()
    return pipe


def split(synth, steps, instances=2, window=16, seed=0):
    """Records of each 16-step window go to one spatial instance (as Kafka partitions would); the
    temporal stage gets their summaries as bytes, interleaved in a shuffled order within a few steps."""
    spatial = [DetectionPipeline(stage="spatial") for _ in range(instances)]
    temporal = DetectionPipeline(stage="temporal")
    wire = []
    for s in steps:
        sp = spatial[(s // window) % instances]
        sp.process(synth.records(s))
        wire += [encode_summary(x) for x in sp.outbox]
        sp.outbox.clear()
    for sp in spatial:
        sp.flush()
        wire += [encode_summary(x) for x in sp.outbox]
    rng = np.random.default_rng(seed)
    jitter = np.arange(len(wire)) + rng.uniform(0, 3, len(wire))  # each a few positions late at most
    for i in np.argsort(jitter):
        temporal.process_summaries([decode_summary(wire[i])])
    temporal.flush()
    return temporal, wire


def opened(pipe):
    return sorted((i.kind, i.ranks, i.first_step) for i in pipe.incidents())


@pytest.mark.parametrize(
    "family,rank",
    [
        ("nonfinite", 5),
        ("replica", 6),
        ("missing", 2),
        ("straggler", 1),
        ("loss_spike", None),
        ("grad_spike", None),
        ("rank_gross", 3),
    ],
)
def test_split_stages_open_the_incidents_one_process_opens(family, rank):
    synth = SyntheticRun(seed=4, world=16, faults=[Fault(family, step=120, rank=rank or 0)])
    steps = range(200)
    whole = one_process(synth, steps)
    temporal, _ = split(synth, steps)
    assert opened(whole), f"{family}: nothing found by one process"
    assert opened(temporal) == opened(whole)
    if rank is not None:
        assert any(rank in i.ranks for i in temporal.incidents())
    assert temporal.view().runs[0].steps_total == len(steps)


def test_sparse_summaries_still_name_a_slightly_shifted_rank():
    """Cells with small |z| and no evidence building up stay out of the summary; a ~3 sigma shift
    on one rank is still named, within a few steps of when one process names it."""
    synth = SyntheticRun(seed=6, world=16, faults=[Fault("rank_shift", step=80, rank=9)])
    whole = one_process(synth, range(200))
    temporal, _ = split(synth, range(200))
    first = {i.kind: i for i in whole.incidents()}
    named = [i for i in temporal.incidents() if i.ranks == (9,)]
    assert named, f"rank 9 not named by the split stages: {opened(temporal)}"
    ref = min(i.first_step for i in whole.incidents() if i.ranks == (9,))
    assert ref <= named[0].first_step <= ref + 5, (ref, named[0].first_step, first)
    assert named[0].kind == "silent_drift"


def test_clean_run_is_silent_in_the_split_too():
    temporal, _ = split(SyntheticRun(seed=12, world=16), range(400))
    assert opened(temporal) == []


def test_a_summary_is_a_small_fraction_of_the_records_it_stands_for():
    synth = SyntheticRun(seed=1, world=1024)
    spatial = DetectionPipeline(stage="spatial")
    sizes, raw = [], 0
    for s in range(30):
        recs = synth.records(s)
        raw += sum(len(encode(r)) for r in recs)
        spatial.process(recs)
        sizes += [len(encode_summary(x)) for x in spatial.outbox]
        spatial.outbox.clear()
    assert len(sizes) == 30  # every step complete: all closed
    assert sum(sizes) * 20 < raw, f"summaries {sum(sizes)} B vs records {raw} B"


def test_summaries_out_of_order_duplicated_and_late_are_put_right():
    t = [0.0]
    order = SummaryOrder(grace=2.0, clock=lambda: t[0])
    s = [StepSummary("r", i, 4, 4) for i in range(6)]
    assert [x.step for x in order.add([s[0]])] == []  # the first waits: an earlier step may come
    t[0] = 2.5
    assert [x.step for x in order.poll()] == [0]
    assert [x.step for x in order.add([s[2], s[1], s[2]])] == [1, 2]
    assert order.duplicates == 1
    assert [x.step for x in order.add([s[4]])] == []  # 3 may still come
    assert [x.step for x in order.add([s[3]])] == [3, 4]
    assert order.add([s[1]]) == [] and order.late == 1
    t[0] = 10.0
    assert [x.step for x in order.add([s[5]])] == [5]


def waiting_for_step_1(t, **observations):
    """A SummaryOrder (clock ``t[0]``, grace 2 s) past step 0, holding step 2 until step 1 comes."""
    order = SummaryOrder(grace=2.0, clock=lambda: t[0])
    order.add([StepSummary("r", 0, 4, 4)])
    t[0] = 3.0
    order.poll()
    assert order.add([StepSummary("r", 2, 4, 4, observations=observations)]) == []
    return order


def test_a_summary_for_a_missing_step_waits_only_the_grace():
    t = [0.0]
    order = waiting_for_step_1(t)  # step 1 lost
    t[0] = 4.0
    assert order.poll() == []
    t[0] = 5.1
    assert [x.step for x in order.poll()] == [2]


def test_bad_summary_bytes_are_named_and_dead_lettered():
    good = encode_summary(StepSummary("r", 3, 4, 4, observations={"x": np.arange(3.0)}))
    with pytest.raises(SummaryError, match="magic"):
        decode_summary(b"SDCR\x01junk")
    with pytest.raises(SummaryError, match="version"):
        decode_summary(good[:4] + b"\x09" + good[5:])
    with pytest.raises(SummaryError, match="body"):
        decode_summary(good[:-4])
    bus = MemoryBus()
    for value in (good, b"garbage"):
        bus.append("sums", b"r", value)
    src = MemorySource(bus, "sums", decode=decode_summary_message)
    (back,) = src.poll()
    assert (back.run, back.step, src.dead_letters) == ("r", 3, 1)
    assert np.array_equal(back.observations["x"], np.arange(3.0))
    assert "magic" in src.dead_letter_log[0].reason


def test_a_detector_that_needs_whole_steps_is_refused_in_a_split_stage():
    with pytest.raises(ConfigError, match="river_hst"):
        DetectionPipeline(stage="spatial", detectors=lambda: [RiverHalfSpaceTrees()])
    with pytest.raises(ConfigError, match="detectors.stage"):  # the key a user sets
        DetectionPipeline(stage="sideways")


def test_each_stage_keeps_its_own_state_file(tmp_path):
    spatial = DetectionPipeline(stage="spatial")
    spatial.process(SyntheticRun(seed=1).records(0))
    spatial.save(tmp_path / "s.json")
    with pytest.raises(ConfigError, match="own state directory"):
        DetectionPipeline(stage="temporal").load(tmp_path / "s.json")
    again = DetectionPipeline(stage="spatial")
    assert again.load(tmp_path / "s.json")


def test_summaries_waiting_for_an_earlier_step_survive_a_restart():
    t = [0.0]
    order = waiting_for_step_1(t, spike={"loss": 1.5})
    again = SummaryOrder(grace=2.0, clock=lambda: t[0])
    again.restore(json.loads(json.dumps(order.snapshot())))
    out = again.add([StepSummary("r", 1, 4, 4)])
    assert [x.step for x in out] == [1, 2]
    assert out[1].observations == {"spike": {"loss": 1.5}}


def test_temporal_stage_restarted_mid_run_resumes_without_repeats_or_warmup(tmp_path):
    synth = SyntheticRun(
        seed=8, world=16, faults=[Fault("rank_gross", step=150, rank=3), Fault("loss_spike", step=170)]
    )
    spatial = DetectionPipeline(stage="spatial")
    blobs = []
    for s in range(230):
        spatial.process(synth.records(s))
        blobs += [encode_summary(x) for x in spatial.outbox]
        spatial.outbox.clear()
    t = [0.0]

    def tick():  # summaries arrive a second apart
        t[0] += 1.0
        return t[0]

    straight = DetectionPipeline(stage="temporal", clock=tick)
    events_straight = [e for b in blobs for e in straight.process_summaries([decode_summary(b)])]
    first = DetectionPipeline(stage="temporal", clock=tick)
    events = [e for b in blobs[:120] for e in first.process_summaries([decode_summary(b)])]
    first.save(tmp_path / "t.json")
    second = DetectionPipeline(stage="temporal", clock=tick)
    assert second.load(tmp_path / "t.json")
    events += [e for b in blobs[120:] for e in second.process_summaries([decode_summary(b)])]
    key = [(e.change, e.incident.kind, e.incident.first_step, e.incident.ranks) for e in events_straight]
    assert {(k[1], k[3]) for k in key if k[0] == "opened"} >= {("loss_spike", ())}, key
    assert any(k[0] == "opened" and k[3] == (3,) for k in key), key
    assert [(e.change, e.incident.kind, e.incident.first_step, e.incident.ranks) for e in events] == key


def test_rank_outlier_evidence_is_the_same_whether_cells_are_updated_lazily_or_every_step():
    """The temporal stage's lazy CUSUM equals the dense one on the same (sparse) observations."""
    from sdcwatch.detectors.rank_outlier import RankOutlierDetector

    synth = SyntheticRun(seed=3, world=16, faults=[Fault("rank_shift", step=30, rank=4)])
    spatial, lazy, dense = RankOutlierDetector(), RankOutlierDetector(), RankOutlierDetector()
    spatial.sparse = True
    for s in range(90):
        fr = synth.frame(s)
        seen = spatial.observe(fr)
        k = len(seen["metrics"])
        z = np.zeros((k, fr.world))
        z[seen["cells"][0], seen["cells"][1]] = seen["cell_z"]
        a = lazy.judge(fr, seen)
        b = dense.judge(fr, {**{x: seen[x] for x in ("sig", "metrics", "layers", "instant")}, "z": z})
        assert [(f.kind, f.ranks, round(f.score, 9)) for f in a] == [(f.kind, f.ranks, round(f.score, 9)) for f in b]
        if s % 7 == 0:  # a snapshot in between (it brings every cell up to date) changes nothing
            lazy.snapshot()
        assert np.allclose(lazy.rank_scores, dense.rank_scores)
    assert dense.rank_scores.argmax() == 4 and dense.rank_scores.max() >= 1.0


@pytest.mark.parametrize(
    "stats",
    [
        "x",
        {"scalars": {}},
        {"scalars": {"loss": 1.0}, "layers": {}},
        {"scalars": {}, "layers": {}, "pieces": {"names": []}},
    ],
)
def test_a_summary_with_forged_statistics_is_dead_lettered_naming_them(stats):
    """The temporal stage keeps a summary's statistics and shows them: a shape frame_stats never
    makes is refused at decoding, before it is kept."""
    with pytest.raises(SummaryError, match="stats"):
        decode_summary(encode_summary(StepSummary("r", 3, 4, 4, stats=stats)))
