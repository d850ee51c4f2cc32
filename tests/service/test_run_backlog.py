"""A flood's cost falls on its own run: each pass of the service's loop judges every run's share of
what it read first, and a run's excess waits, in order and bounded, for later passes.

Before, a real run's records queued behind every junk record read ahead of them (1,000 junk runs x
40 steps on a real ``serve``: its NaN found 82.5 s after it started). The service runs on a fake
clock here; what is asserted is the order and the count of what was processed, never wall time.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from detector_synth import Fault, SyntheticRun
from memory_source import MemorySource
from sdcwatch.core.jsonsafe import json_safe
from sdcwatch.core.messages import encode_items
from sdcwatch.core.record import encode, encode_batch, record_key
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.record_type import Record
from sdcwatch.service.ingest import IngestDecoder, as_records
from sdcwatch.service.loop import DetectorService
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings
from sdcwatch.service.alignment_state import size_of
from sdcwatch.service.run_backlog import RunBacklog, fair_share
from sdcwatch.telemetry import MemoryBus
from stand_ins import Clock, ListSink

TOPIC = "sdcwatch.telemetry"
JUNK_RUNS, JUNK_STEPS, PASS = 100, 100, 128
NAN_STEP = 50


def junk(name: str, step: int) -> Record:
    return Record(name, step, 0, 1, "evil", 0.0, 0, {"loss": 1.0}, {}, {})


@pytest.mark.parametrize("max_runs", [1000, JUNK_RUNS], ids=["places-free", "junk-holds-every-place"])
@pytest.mark.parametrize("pass_records", [PASS, 1 << 30], ids=["shared", "one-queue"])
def test_a_flood_queued_ahead_of_a_real_run_delays_its_nan_by_one_pass_not_by_the_flood(max_runs, pass_records):
    """10,000 junk records (100 runs x 100 steps, a message each) are read before an 8-rank run
    starts; the run sends a step a pass (0.1 s) with a NaN at step 50. Its NaN opens in the pass
    that read it, each pass having judged about a pass's worth of junk, not the flood; none of its records is dead-lettered,
    and the junk is judged in order (no step late or twice). As one queue (the pass unbounded, as
    before), all 10,000 junk records are judged before any of the real run's."""
    clock = Clock(1000.0)
    settings = PipelineSettings(max_runs=max_runs, pass_records=pass_records)
    pipe = DetectionPipeline(settings, clock=clock, wall=clock)
    bus = MemoryBus()
    source = MemorySource(bus)
    sink = ListSink()
    svc = DetectorService(source, pipe, sinks=[sink], poll_timeout=0.01, clock=clock)
    for step in range(JUNK_STEPS):
        for i in range(JUNK_RUNS):
            bus.append(TOPIC, b"junk", encode(junk(f"junk-{i}", step)))
    real = SyntheticRun(world=8, run="real", seed=3, faults=[Fault("nonfinite", NAN_STEP, rank=5, length=1)])
    judged_before: dict[int, int] = {}  # real step -> records judged before the pass that read it
    found = placed = None  # the passes that found the NaN, and gave the real run its place
    for step in range(NAN_STEP + 30):
        bus.append(TOPIC, b"real", encode_batch(real.records(step)))
        judged_before[step] = pipe.records_total
        svc.step()
        placed = placed if placed is not None or not pipe.aligner.holds("real") else step
        clock.t += 0.1
        opened = [e for e in sink.events if e.change == "opened" and e.incident.kind == "nonfinite"]
        if opened and found is None:
            found = step
            assert (opened[0].incident.run, opened[0].incident.first_step, opened[0].incident.ranks) == (
                "real",
                NAN_STEP,
                (5,),
            )
    assert not [r for r in source.dead_letter_log if b"real" in (r.key or b"")]
    assert pipe.aligner.late_records == pipe.aligner.duplicates == 0
    junk_total = JUNK_RUNS * JUNK_STEPS
    if pass_records > junk_total:  # one queue: every junk record first
        assert judged_before[1] >= junk_total
        return
    assert found in (NAN_STEP, NAN_STEP + 1)  # the pass that read the step, or the next (its stride)
    # a pass judges about PASS records (its share and the others' excess), not the whole flood
    assert judged_before[NAN_STEP] <= NAN_STEP * (PASS + 8) < junk_total
    lost = sum(source.dead_letter_reasons.values())
    # read in the second pass (the first read 10,000 junk messages); with every place held, placed
    # once the junk it read ahead was silent run_probation_idle_s (2 s: 20 passes), not judged
    assert placed == 1 if max_runs > JUNK_RUNS else placed <= 1 + 20
    if max_runs == JUNK_RUNS:  # the real run waited for a place: silent junk runs gave way, and what
        assert pipe.runs_forgotten >= 1  # they had waiting waits for their return: nothing is lost
    assert lost == 0
    for _ in range(200):  # the junk left is judged in later passes
        svc.step()
        clock.t += 0.1
    # every record judged, or kept waiting for the return of the run that gave way (none lost)
    waiting = pipe.aligner.waiting_records
    assert len(pipe.backlog) == 0 and pipe.records_total + lost + waiting == junk_total + 8 * (NAN_STEP + 30)


def test_shares_are_max_min_fair():
    assert fair_share({"a": 10, "b": 10}, 100) == 10  # all fit
    assert fair_share({"small": 5, "big": 1000, "bigger": 2000}, 105) == 50
    assert fair_share({f"r{i}": 40 for i in range(1000)}, 2048) == 2


def test_a_poll_within_a_pass_or_of_one_run_passes_as_it_was_read():
    backlog = RunBacklog(10, 100, clock=Clock(0.0))
    small = [junk("a", s) for s in range(5)] + [junk("b", s) for s in range(5)]
    assert backlog.take(small)[0] is small
    one = [junk("a", s) for s in range(50)]
    assert backlog.take(one)[0] is one and len(backlog) == 0


def test_each_run_keeps_its_order_and_a_block_is_cut_at_its_share():
    backlog = RunBacklog(8, 1000, clock=Clock(0.0))
    decoder = IngestDecoder()
    flood = [Record("flood", s, r, 2, "h", 0.0, 0, {"loss": 1.0}, {}, {}) for s in range(10) for r in range(2)]
    packed = [PackedRecord.from_record(r) for r in flood]
    msgs = [(f"t/0/{i}", k, v) for i, (k, v, _) in enumerate(encode_items(packed, record_key, 64, set()))]
    blocks, _ = decoder.decode(msgs)
    real = [junk("real", s) for s in range(2)]
    out, lost = backlog.take(blocks + real)
    got = as_records(out)
    assert [(r.run, r.step, r.rank) for r in got] == [(r.run, r.step, r.rank) for r in flood[:6] + real]
    assert len(backlog) == 14 and lost == []
    seen = got[:6]
    while len(backlog):
        seen += as_records(backlog.take([])[0])
    assert [(r.step, r.rank) for r in seen] == [(r.step, r.rank) for r in flood]


def test_runs_read_before_a_flood_of_new_runs_take_their_share_first():
    """A run read before 10 new runs flood keeps its pace (what is left of the pass after every run's
    fair share goes to it first); the newcomers have one record each (their share, a rank of their
    world), and the pass holds no more than its 16 records."""
    backlog = RunBacklog(16, 1000, clock=Clock(0.0))
    backlog.take([junk("real", 0)])
    flood = [junk(f"new-{i}", s) for s in range(4) for i in range(10)]
    real = [junk("real", s) for s in range(1, 7)]
    out, _ = backlog.take(flood[:20] + real + flood[20:])
    assert sorted((r.run, r.step) for r in out) == sorted(
        [("real", s) for s in range(1, 7)] + [(f"new-{i}", 0) for i in range(10)]
    )
    assert len(backlog) == 30


def test_a_run_with_a_backlog_keeps_its_pace_and_its_records_through_a_flood_of_new_names():
    """An 8-rank run that caught up (a backlog) while every poll brings 20 new 4-rank runs of 2
    steps: the new names take one share of the pass between them, not a share each, so the real run
    keeps its pace; past the bound, the runs read last lose their records, never the real run's.
    Before, each new run had a rank of its world whatever the pass, the real run one step a pass,
    and its growing backlog was the one dead-lettered."""

    def rank_records(run: str, step: int, world: int) -> list[Record]:
        return [Record(run, step, r, world, "h", 0.0, 0, {"loss": 1.0}, {}, {}) for r in range(world)]

    backlog = RunBacklog(64, 300, clock=Clock(0.0))
    burst = [r for s in range(10) for r in rank_records("real", s, 8)]
    passed = [r for r in backlog.take(burst + rank_records("early-junk", 0, 4))[0] if r.run == "real"]
    lost: list = []
    for poll in range(30):
        real = [r for s in (10 + 2 * poll, 11 + 2 * poll) for r in rank_records("real", s, 8)]
        flood = [r for i in range(20) for s in range(2) for r in rank_records(f"junk-{poll}-{i}", s, 4)]
        out, dead = backlog.take(flood[:80] + real + flood[80:])
        passed += [r for r in as_records(out) if r.run == "real"]
        lost += dead
    while len(backlog):
        passed += [r for r in as_records(backlog.take([])[0]) if r.run == "real"]
    assert lost and all(recs and all(r.run.startswith("junk-") for r in recs) for _, _, recs in lost)
    assert [(r.step, r.rank) for r in passed] == [(s, r) for s in range(70) for r in range(8)]


def test_a_backlog_past_its_bound_dead_letters_the_run_with_most_waiting_by_name():
    backlog = RunBacklog(6, 20, clock=Clock(0.0))
    items = [junk("flood", s) for s in range(30)] + [junk("real", s) for s in range(3)]
    out, lost = backlog.take(items)
    assert [(r.run, r.step) for r in out] == [("flood", s) for s in range(3)] + [("real", s) for s in range(3)]
    assert [(reason, len(recs)) for reason, _, recs in lost] == [("budget", 27)]
    why = lost[0][1]
    assert "run 'flood'" in why and "its 27 record(s)" in why and "detectors.run_backlog_records" in why
    assert len(backlog) == 0
    out, _ = backlog.take([junk("flood", 30), junk("real", 3)])  # the flood goes on: behind the others
    assert [(r.run, r.step) for r in out] == [("real", 3), ("flood", 30)]
    backlog.take([])
    assert backlog.take([junk("flood", 31), junk("real", 4)])[0] == [junk("flood", 31), junk("real", 4)]


def test_the_backlog_is_kept_in_the_state_and_judged_after_a_restart():
    settings = PipelineSettings(pass_records=16)
    clock = Clock(1000.0)
    pipe = DetectionPipeline(settings, clock=clock, wall=clock)
    items = [junk(f"j{i}", s) for s in range(10) for i in range(4)]
    now = pipe.share(items)
    assert len(now) == 16 and len(pipe.backlog) == 24
    pipe.process(now)
    state = json.loads(json.dumps(json_safe(pipe.snapshot())))
    again = DetectionPipeline(settings, clock=clock, wall=clock)
    again.restore(state)
    assert len(again.backlog) == 24
    rest = []
    while len(again.backlog):
        rest += again.share([])
    assert sorted((r.run, r.step) for r in rest) == sorted((r.run, r.step) for r in items[16:])
    assert np.all([a.step < b.step for a, b in zip(rest, rest[1:]) if a.run == b.run])


@pytest.mark.parametrize("keys", [True, False], ids=["keys-on", "no-keys"])
def test_another_tenants_flood_over_many_names_is_one_taker_of_a_pass_with_keys_on(keys):
    """Before: each run was a taker of a pass. Another tenant's valid key sending for 31 run names
    (4 records each a poll) held 31 of 32 shares: a real 8-rank run got 4 of its 8 records a pass and
    fell further behind at every pass (issue 36's signed flood: its NaN 10-20 s late). With keys on,
    the runs of one key share one share: the real run's key takes its whole step every pass. Without
    keys every run is its own taker, as before."""
    backlog = RunBacklog(128, 1 << 20, clock=Clock(0.0))
    if keys:
        backlog.key_of = lambda run: "tenant" if run.startswith("junk") else "job"
    real_out, junk_out = [], []
    for step in range(20):
        items = [junk(f"junk-{i}", 4 * step + k) for i in range(31) for k in range(4)]
        items += [Record("real", step, r, 8, "h", 0.0, 0, {"loss": 1.0}, {}, {}) for r in range(8)]
        out, lost = backlog.take(items)
        assert lost == [] and sum(size_of(x) for x in out) <= 128
        real_out += [(r.step, r.rank) for r in as_records(x for x in out if x.run == "real")]
        junk_out.append(sum(size_of(x) for x in out if x.run != "real"))
    if keys:
        assert real_out == [(s, r) for s in range(20) for r in range(8)]  # every step whole, in order, at once
        assert min(junk_out[1:]) == 120  # the tenant's flood keeps the rest of each pass
    else:
        assert len(real_out) == 20 * 4  # half its records a pass: 80 of 160 still waiting
        assert real_out == [(s, r) for s in range(10) for r in range(8)]


@pytest.mark.parametrize("keys", [True, False], ids=["keys-on", "no-keys"])
def test_while_runs_wait_for_their_share_each_step_lets_the_reader_catch_up_before_it_judges(keys):
    """A record not read cannot be judged: with keys on, while a flood's records wait for their
    share, each step first gives the source's reader up to ``READ_FIRST_S`` to read what is on the bus
    (a real run's record behind the flood is then read, and gets its key's share of the next pass).
    With nothing waiting, no step waits; without keys neither (each name is a taker of a pass, and
    fewer passes would slow a real run among a flood's names)."""
    from sdcwatch.service.loop import READ_FIRST_S

    calls: list[str] = []

    class Watched(MemorySource):
        def catch_up(self, timeout: float) -> None:
            calls.append(f"catch_up {timeout}")

        def poll(self, timeout: float = 0.0, max_records: int = 10_000) -> list:
            calls.append("poll")
            return super().poll(timeout, max_records)

    clock = Clock(1000.0)
    pipe = DetectionPipeline(PipelineSettings(pass_records=PASS), clock=clock, wall=clock)
    bus = MemoryBus()
    svc = DetectorService(Watched(bus), pipe, poll_timeout=0.01, clock=clock)
    if keys:
        pipe.backlog.key_of = lambda run: "job"
    for step in range(2):
        bus.append(
            TOPIC,
            b"real",
            encode_batch([Record("real", step, r, 8, "h", 0.0, 0, {"loss": 1.0}, {}, {}) for r in range(8)]),
        )
    svc.step()  # one run: as read, nothing waits
    assert calls == ["poll"] and not pipe.backlog.ready
    for i in range(4 * PASS):
        bus.append(TOPIC, b"junk", encode(junk(f"junk-{i}", 0)))
    svc.step()  # more than a pass of many runs: the excess waits
    assert pipe.backlog.ready and calls == ["poll", "poll"]
    calls.clear()
    svc.step()
    assert calls[:2] == ([f"catch_up {READ_FIRST_S}", "poll"] if keys else ["poll"])
