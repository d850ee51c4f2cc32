"""The host ledger: evidence per host across runs, its decay, its bounds, the operator's clear, its
state in the pipeline's snapshot, and which findings credit a host at all."""

from __future__ import annotations

import json

import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.signing import JobKey, Keyring
from sdcwatch.service.changelog import StateChangelog, resume_state
from sdcwatch.service.hosts import HostLedger, HostSettings, HostVerdict, credit_hosts
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.summary import decode_summary, encode_summary

DAY = 86400.0


def credit(
    ledger: HostLedger,
    run: str,
    host: str = "node17",
    *,
    kind: str = "checksum",
    weight: float = 0.6,
    wall: float = 0.0,
    step: int = 1,
) -> None:
    ledger.credit(run=run, step=step, host=host, kind=kind, weight=weight, wall=wall)


def whole_runs(**settings) -> HostLedger:
    """A ledger in which a run counts whole even when its evidence is one step (as these tests credit
    it); the rule that a one-off counts half has a test of its own."""
    return HostLedger(HostSettings(one_off_run=1.0, **settings))


def verdict(ledger: HostLedger, host: str, wall: float = 0.0) -> HostVerdict:
    return {v.host: v for v in ledger.verdicts(wall)}[host]


def finding(kind: str, ranks: tuple[int, ...], run: str = "job", step: int = 5, **kw) -> Finding:
    return Finding("det", kind, kw.pop("severity", Severity.CRITICAL), run, step, 1.0, "msg", ranks=ranks, **kw)


HOSTS = ("node0",) * 4 + ("node1",) * 4


# -- verdicts ---------------------------------------------------------------------------------------


def test_one_run_alone_never_makes_a_verdict_however_much_it_says() -> None:
    ledger = whole_runs()
    for step in range(200):
        credit(ledger, "job-a", step=step)
    v = verdict(ledger, "node17")
    assert (v.verdict, v.runs, v.steps) == ("clean", ("job-a",), 200)
    assert v.score == pytest.approx(ledger.settings.run_cap)


def test_independent_runs_make_a_suspect_then_a_quarantine_saying_on_what_and_since_when() -> None:
    ledger = whole_runs()
    credit(ledger, "job-a", weight=1.0, wall=10.0)
    credit(ledger, "job-b", weight=0.2, wall=20.0)
    v = verdict(ledger, "node17", 20.0)
    assert (v.verdict, v.runs) == ("clean", ("job-a",))  # job-b's share is under run_floor
    credit(ledger, "job-b", weight=0.4, kind="rank_outlier", wall=30.0)
    v = verdict(ledger, "node17", 30.0)
    assert (v.verdict, v.runs, v.kinds, v.steps, v.since) == (
        "suspect",
        ("job-a", "job-b"),
        ("checksum", "rank_outlier"),
        3,
        30.0,
    )
    assert "2 runs" in v.reason
    credit(ledger, "job-c", weight=1.0, wall=40.0)
    assert verdict(ledger, "node17", 40.0).verdict == "suspect"  # 2.6 from three runs: not yet decisive
    credit(ledger, "job-d", weight=1.0, wall=50.0)
    v = verdict(ledger, "node17", 50.0)
    assert (v.verdict, v.since, len(v.runs)) == ("quarantine", 50.0, 4)


def test_evidence_halves_every_half_life_and_a_suspect_fades_but_a_quarantine_stays() -> None:
    ledger = whole_runs(half_life_s=DAY)
    for run in ("a", "b"):
        credit(ledger, run, weight=1.0)
    assert verdict(ledger, "node17").verdict == "suspect"
    assert verdict(ledger, "node17", DAY).score == pytest.approx(1.0)
    ledger.review(2 * DAY)  # the service judges again at its snapshot
    assert verdict(ledger, "node17", 2 * DAY).verdict == "clean"  # 0.5 < half the suspect bound
    assert verdict(ledger, "node17", 2 * DAY).runs == ()  # each run's share is under run_floor now
    for run in ("c", "d", "e"):
        credit(ledger, run, weight=1.0, wall=3 * DAY)
    assert verdict(ledger, "node17", 3 * DAY).verdict == "quarantine"
    ledger.review(30 * DAY)
    assert verdict(ledger, "node17", 30 * DAY).verdict == "quarantine"  # decisive: until an operator clears it


def test_reading_a_verdict_changes_nothing_it_says_what_the_ledger_last_judged() -> None:
    ledger = whole_runs(half_life_s=DAY)
    for run in ("a", "b"):
        credit(ledger, run, weight=1.0)
    state, changed = ledger.snapshot(), ledger.take_changed()
    late = verdict(ledger, "node17", 5 * DAY)  # a reader's clock long after: the evidence has faded
    assert (late.verdict, late.since) == ("suspect", 0.0) and late.score == pytest.approx(2 * 0.5**5)
    assert ledger.snapshot() == state and ledger.take_changed() == set() and changed == {"node17"}
    ledger.review(5 * DAY)
    assert verdict(ledger, "node17", 5 * DAY).verdict == "clean" and ledger.take_changed() == {"node17"}


def test_a_one_off_in_a_run_counts_half_a_run_evidence_that_recurs_counts_whole() -> None:
    """Three cosmic rays on one clean host in three runs (one checksum mismatch each) are not two
    independent runs' evidence; a part that errs twice in each of two runs is."""
    ledger = HostLedger()
    for run in ("a", "b", "c"):
        credit(ledger, run, host="unlucky", step=40)
        credit(ledger, run, host="unlucky", kind="rank_outlier", weight=0.15, step=40)  # same step: still one
    v = verdict(ledger, "unlucky")
    assert (v.verdict, v.runs) == ("clean", ("a", "b", "c")) and v.score >= ledger.settings.suspect_score
    credit(ledger, "d", host="unlucky", step=7)
    assert verdict(ledger, "unlucky").verdict == "suspect"  # four one-offs on one host: no longer chance
    for run in ("a", "b"):
        for step in (10, 250):
            credit(ledger, run, host="faulty", step=step, weight=0.4)
    assert verdict(ledger, "faulty").verdict == "suspect"
    saved = {"hosts": {"old": {"runs": {"a": [1.0, 0.0], "b": [1.0, 0.0]}}}}  # before steps were kept
    ledger.restore(saved)
    ledger.review(0.0)
    assert verdict(ledger, "old").verdict == "suspect"


def test_verdicts_are_worst_first() -> None:
    ledger = whole_runs()
    credit(ledger, "a", host="calm")
    for run in "abc":
        credit(ledger, run, host="bad", weight=1.0)
    for run in "ab":
        credit(ledger, run, host="odd", weight=1.0)
    assert [v.host for v in ledger.verdicts(0.0)] == ["bad", "odd", "calm"]
    assert [v.verdict for v in ledger.verdicts(0.0)] == ["quarantine", "suspect", "clean"]


def test_a_verdict_goes_through_json_unchanged() -> None:
    v = HostVerdict("n1", "suspect", 1.5, ("a", "b"), ("checksum",), 3, 12.0, ("GPU-1",), reason="r")
    d = v.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert (d["runs"], d["kinds"], d["gpus"], d["cleared_by"], d["reason"]) == (
        ["a", "b"],
        ["checksum"],
        ["GPU-1"],
        "",
        "r",
    )


# -- the operator's clear ---------------------------------------------------------------------------


def test_a_clear_is_recorded_drops_the_evidence_and_new_evidence_counts_afresh() -> None:
    ledger = whole_runs()
    for run in "abc":
        credit(ledger, run, weight=1.0)
    assert ledger.clear("node17", by="alice", reason="GPU 3 replaced", wall=100.0)
    assert not ledger.clear("node99", by="alice", reason="typo", wall=100.0)
    v = verdict(ledger, "node17", 100.0)
    assert (v.verdict, v.cleared_by, v.reason, v.since, v.score, v.runs) == (
        "cleared",
        "alice",
        "GPU 3 replaced",
        100.0,
        0.0,
        (),
    )
    credit(ledger, "d", weight=1.0, wall=200.0)
    assert verdict(ledger, "node17", 200.0).verdict == "cleared"  # one run: not enough again
    credit(ledger, "e", weight=1.0, wall=300.0)
    assert verdict(ledger, "node17", 300.0).verdict == "suspect"


# -- bounds -----------------------------------------------------------------------------------------


def test_a_flood_of_invented_hosts_evicts_only_the_weakest_clean_ones_and_is_counted() -> None:
    ledger = whole_runs(max_hosts=3, max_label=16)
    for run in "ab":
        credit(ledger, run, host="bad", weight=1.0)
    credit(ledger, "a", host="weak", weight=0.1)
    credit(ledger, "a", host="strong", weight=0.9)
    credit(ledger, "x", host="junk1", weight=0.5)  # takes the place of "weak"
    assert {v.host for v in ledger.verdicts(0.0)} == {"bad", "strong", "junk1"}
    for run in "bc":
        credit(ledger, run, host="strong", weight=1.0)
        credit(ledger, run, host="junk1", weight=1.0)
    assert all(v.verdict in ("suspect", "quarantine") for v in ledger.verdicts(0.0))
    credit(ledger, "x", host="junk2", weight=1.0)  # nobody to evict: refused
    credit(ledger, "x", host="h" * 17, weight=1.0)  # label too long
    credit(ledger, "x", host="", weight=1.0)
    assert len(ledger) == 3 and "junk2" not in {v.host for v in ledger.verdicts(0.0)}
    assert ledger.refused == {"full": 1, "label": 2}


def test_runs_kept_per_host_are_bounded() -> None:
    ledger = whole_runs(max_runs_per_host=4)
    for i in range(10):
        credit(ledger, f"run{i}", weight=0.1 * (i + 1))
    assert verdict(ledger, "node17").runs == ("run6", "run7", "run8", "run9")


def test_settings_are_checked_by_their_dotted_key() -> None:
    with pytest.raises(ConfigError, match="hosts.max_host"):
        HostSettings.from_dict({"max_host": 3})
    with pytest.raises(ConfigError, match="hosts.half_life_s"):
        HostSettings(half_life_s=0)
    with pytest.raises(ConfigError, match="hosts.quarantine_score"):
        HostSettings(suspect_score=2.0, quarantine_score=1.0)


# -- state ------------------------------------------------------------------------------------------


def test_snapshot_and_restore_keep_evidence_verdicts_clears_and_counts() -> None:
    ledger = whole_runs()
    for run in "abc":
        credit(ledger, run, host="bad", weight=1.0, wall=5.0)
    credit(ledger, "a", host="fixed", weight=1.0)
    credit(ledger, "b", host="fixed", weight=1.0)
    ledger.clear("fixed", by="bob", reason="reseated", wall=9.0)
    credit(ledger, "a", host="x" * 300)
    again = whole_runs()
    again.restore(json.loads(json.dumps(ledger.snapshot())))
    assert again.verdicts(50.0) == ledger.verdicts(50.0)
    assert again.refused == ledger.refused == {"label": 1, "full": 0}
    credit(again, "d", host="bad", wall=60.0)  # it goes on from where it was
    assert verdict(again, "bad", 60.0).steps == 4


def test_one_host_state_is_adopted_or_forgotten_by_its_key() -> None:
    ledger = whole_runs()
    for run in "ab":
        credit(ledger, run, weight=1.0)
    assert ledger.take_changed() == {"node17"} and ledger.take_changed() == set()
    other = whole_runs()
    other.adopt("node17", ledger.host_state("node17"))
    assert other.verdicts(0.0) == ledger.verdicts(0.0)
    other.adopt("node17", None)
    assert other.verdicts(0.0) == [] and ledger.host_state("nobody") is None


def test_adopting_merges_each_instances_runs_and_keeps_the_later_clear() -> None:
    east, west = whole_runs(), whole_runs()
    credit(east, "r1", weight=1.0, wall=1.0)
    credit(west, "r2", weight=1.0, wall=2.0)
    east.adopt("node17", west.host_state("node17"))
    v = verdict(east, "node17", 2.0)
    assert (v.verdict, v.runs) == ("suspect", ("r1", "r2"))  # neither alone had two runs
    before_clear = east.host_state("node17")
    west.clear("node17", by="ops", reason="fixed", wall=3.0)
    east.adopt("node17", west.host_state("node17"))
    v = verdict(east, "node17", 3.0)
    assert (v.verdict, v.cleared_by, v.runs) == ("cleared", "ops", ())
    east.adopt("node17", before_clear)  # an older state arriving late does not undo the clear
    assert verdict(east, "node17", 3.0).verdict == "cleared"


# -- which findings credit a host -------------------------------------------------------------------


def test_rank_local_findings_credit_their_host_by_specificity_and_shared_ones_none() -> None:
    ledger = whole_runs()
    credit_hosts(ledger, [finding("checksum_mismatch", (5,))], HOSTS, 0.0, gpus=("",) * 5 + ("GPU-5",) + ("",) * 2)
    credit_hosts(ledger, [finding("rank_outlier", (1,), severity=Severity.WARNING)], HOSTS, 0.0)
    scores = {v.host: v for v in ledger.verdicts(0.0)}
    assert scores["node1"].score > scores["node0"].score > 0  # a checksum mismatch weighs more
    assert scores["node1"].gpus == ("GPU-5",) and scores["node1"].kinds == ("checksum",)
    empty = HostLedger()
    credit_hosts(empty, [finding("checksum_mismatch", tuple(range(8)))], HOSTS, 0.0)  # every host alike
    credit_hosts(empty, [finding("loss_spike", (2,)), finding("straggler", (3,))], HOSTS, 0.0)  # not SDC evidence
    credit_hosts(empty, [finding("nonfinite", ())], HOSTS, 0.0)  # names no rank
    assert len(empty) == 0


def test_a_single_step_deviation_counts_unless_a_bad_batch_explains_it() -> None:
    ledger = whole_runs()
    hardware = finding("rank_deviation", (6,), metric="q_norm_max", evidence={"z": 80.0, "loss_z": 1.0})
    batch = finding("rank_deviation", (2,), metric="q_norm_max", evidence={"z": 80.0, "loss_z": 60.0})
    loss = finding("rank_deviation", (3,), metric="loss", evidence={"z": 80.0, "loss_z": 80.0})
    credit_hosts(ledger, [], HOSTS, 0.0, deviations=[hardware, batch, loss])
    assert [(v.host, v.kinds) for v in ledger.verdicts(0.0)] == [("node1", ("rank_outlier",))]


def feed(pipe: DetectionPipeline, synth: SyntheticRun, steps: int, clock: list[float]) -> None:
    for step in range(steps):
        clock[0] += 1.0
        pipe.process_frame(synth.frame(step))
    pipe.evict(synth.run, "finished")


def test_the_pipeline_credits_hosts_across_runs_and_its_state_keeps_the_ledger() -> None:
    clock = [1.7e9]
    pipe = DetectionPipeline(wall=lambda: clock[0])
    for i, run in enumerate(("job-a", "job-b")):  # a checksum mismatch on node0 in each, and a loss spike
        faults = [Fault("checksum", 40, rank=1), Fault("checksum", 70, rank=2), Fault("loss_spike", 90)]
        feed(pipe, SyntheticRun(world=8, run=run, seed=i, faults=faults), 120, clock)
    feed(pipe, SyntheticRun(world=8, run="job-c", seed=7, faults=[Fault("loss_spike", 60)]), 120, clock)
    verdicts = pipe.hosts.verdicts(clock[0])
    assert [(v.host, v.verdict, v.runs, v.kinds) for v in verdicts] == [
        ("node0", "suspect", ("job-a", "job-b"), ("checksum",))
    ]
    again = DetectionPipeline(wall=lambda: clock[0])
    again.restore(json.loads(json.dumps(pipe.snapshot())))
    assert again.hosts.verdicts(clock[0]) == verdicts


def test_split_stages_credit_hosts_as_one_both_stage_does() -> None:
    """Spatial instances observe the steps, the temporal stage judges them from their summaries: its
    ledger holds what a ``both`` instance's holds (the spatial stages' holds nothing to lose)."""
    runs = [
        SyntheticRun(world=8, run=f"job-{i}", seed=i, faults=[Fault("checksum", 30 + i, rank=1), Fault(family, 60, 5)])
        for i, family in enumerate(("checksum", "nonfinite", "rank_gross"))
    ]
    both = DetectionPipeline(wall=lambda: 1.7e9)
    spatial = [DetectionPipeline(stage="spatial", wall=lambda: 1.7e9) for _ in range(2)]
    temporal = DetectionPipeline(stage="temporal", wall=lambda: 1.7e9)
    for synth in runs:
        for step in range(100):
            both.process(synth.records(step))
            spatial[step // 16 % 2].process(synth.records(step))
    both.flush()
    for sp in spatial:
        sp.flush()
        temporal.process_summaries([decode_summary(encode_summary(x)) for x in sp.take_summaries()])
        assert len(sp.hosts) == 0
    temporal.flush()
    verdicts = both.hosts.verdicts(1.7e9)
    assert {v.host for v in verdicts} == {"node0", "node1"} and verdicts[0].verdict != "clean"
    assert temporal.hosts.verdicts(1.7e9) == verdicts


# -- the state topic, keyed by host -------------------------------------------------------------------


def test_host_states_on_the_state_topic_are_adopted_by_an_instance_of_another_group(
    bootstrap, unique_topic, tmp_path
) -> None:
    """Instance A writes its changed hosts keyed by host; an instance of another group, starting
    with no state, adopts them; with keys, a host record not signed with the service's key is ignored."""
    key = Keyring([JobKey("a", b"k" * 32)]).service_key("state")
    ledger = whole_runs()
    for run in "abc":
        credit(ledger, run, host="node17", weight=1.0, wall=5.0)
    credit(ledger, "a", host="calm", weight=0.2, wall=5.0)
    writer = StateChangelog(bootstrap, unique_topic, group="east", stage="both", key=key)
    writer.write_hosts({h: ledger.host_state(h) for h in ledger.take_changed()})
    forged = json.dumps(ledger.host_state("node17")).encode()
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=[bootstrap])
    producer.send(unique_topic, key=b"h:victim", value=forged, partition=0).get(10)  # no key: not ours
    producer.close()
    writer.write_hosts({"calm": None})  # forgotten: a tombstone
    writer.close()
    reader = StateChangelog(bootstrap, unique_topic, group="west", stage="both", key=key)
    pipe = DetectionPipeline()
    assert resume_state(pipe, tmp_path / "state.json", reader) == (None, None)  # no snapshot of its own
    reader.close()
    assert [(v.host, v.verdict, v.runs) for v in pipe.hosts.verdicts(5.0)] == [
        ("node17", "quarantine", ("a", "b", "c"))
    ]
