"""One fault, one incident: findings of other kinds naming the same rank(s) near the fault's onset
join its incident as related evidence (a flip seen as a NaN and by the forward checksums, an
unhealthy node seen as a diverged replica and by its rank evidence); other faults stay apart."""

from __future__ import annotations

import json

from detector_synth import Fault, SyntheticRun
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.service.incidents import IncidentBook
from sdcwatch.service.pipeline import DetectionPipeline


def run(faults, steps=140, world=8):
    pipe = DetectionPipeline()
    synth = SyntheticRun(world=world, seed=2, faults=faults)
    events = []
    for s in range(steps):
        events += pipe.process(synth.records(s))
    return pipe, events + pipe.flush()


def finding(step, kind, ranks=(3,), sev=Severity.CRITICAL, metric="m", score=1.0):
    return Finding("d", kind, sev, "r", step, score, f"{kind} at {step}", ranks=ranks, metric=metric)


def test_one_flip_seen_as_a_nan_and_by_the_forward_checksums_is_one_incident():
    pipe, events = run([Fault("nonfinite", 40, rank=3, layer=1), Fault("checksum", 40, rank=3, layer=1)])
    (inc,) = pipe.incidents()
    assert (inc.kind, inc.first_step, inc.ranks, inc.hosts, inc.metric) == (
        "nonfinite",
        40,
        (3,),
        ("node0",),
        "attn_logit_max",
    )
    (rel,) = inc.evidence["related"]
    assert (rel["kind"], rel["detector"], rel["ranks"], rel["metric"], rel["layer"]) == (
        "checksum_mismatch",
        "checksum",
        [3],
        "gemm_fwd",
        1,
    )
    assert (rel["first_step"], rel["last_step"], rel["findings"], rel["severity"]) == (40, 40, 1, "critical")
    assert rel["message"].startswith("checksum mismatch at step 40 on rank 3 (host node0): gemm_fwd")
    assert [(e.change, e.incident.id) for e in events] == [(c, inc.id) for c in ("opened", "updated", "resolved")]
    assert pipe.book.opened_total == {("nonfinite", "critical"): 1}
    said = json.loads(json.dumps(inc.to_dict(), allow_nan=False))  # what the topic, demo and sinks carry
    assert said["evidence"]["related"][0]["kind"] == "checksum_mismatch"


def test_an_unhealthy_node_is_one_incident_with_its_rank_evidence_related():
    """Rank 3's replica diverges at step 40 and its attention statistics go off from then on: the
    diverged replica is the incident; the rank evidence that follows (silent drift, escalating) is
    related, and keeps the incident open while it goes on."""
    pipe, events = run([Fault("replica", 40, rank=3), Fault("rank_gross", 40, rank=3)])
    (inc,) = pipe.incidents()
    assert (inc.kind, inc.first_step, inc.ranks, inc.severity) == ("replica_divergence", 40, (3,), Severity.CRITICAL)
    kinds = [r["kind"] for r in inc.evidence["related"]]
    assert kinds and set(kinds) <= {"rank_outlier", "silent_drift", "sdc_suspected"} and len(kinds) == len(set(kinds))
    last = max(r["last_step"] for r in inc.evidence["related"])
    assert inc.last_step == last == 139
    assert len({e.incident.id for e in events}) == 1


def test_faults_on_other_ranks_stay_their_own_incidents():
    pipe, _ = run([Fault("replica", 40, rank=3), Fault("rank_gross", 40, rank=5)])
    got = sorted((i.kind, i.ranks) for i in pipe.incidents())
    assert got == [("replica_divergence", (3,)), ("silent_drift", (5,))]
    assert all("related" not in i.evidence for i in pipe.incidents())
    pipe, _ = run([Fault("nonfinite", 40, rank=3, layer=1), Fault("checksum", 40, rank=6, layer=1)])
    assert sorted((i.kind, i.ranks) for i in pipe.incidents()) == [("checksum_mismatch", (6,)), ("nonfinite", (3,))]


def test_the_window_is_from_the_onset_and_a_related_kind_goes_on_joining():
    book = IncidentBook(related_steps=10)
    ev = book.add([finding(100, "replica_divergence")])
    ev += book.add([finding(108, "checksum_mismatch", metric="gemm_fwd", score=5.0)])  # 8 steps in: related
    ev += book.add([finding(130, "replica_divergence")])
    ev += book.add([finding(130, "checksum_mismatch", score=9.0)])  # a related kind goes on joining
    (inc,) = [i for i in book.current() if i.open]
    (rel,) = inc.evidence["related"]
    assert (rel["first_step"], rel["last_step"], rel["findings"], rel["score"]) == (108, 130, 2, 9.0)
    assert [e.change for e in ev] == ["opened", "updated"]  # only a new related kind is news
    # a finding that begins long after the onset, of a kind not related yet, is a new event
    ev = book.add([finding(131, "nonfinite")])
    assert [(e.change, e.incident.kind) for e in ev] == [("opened", "nonfinite")]
    # a finding naming a rank the incident does not name is not its evidence
    book = IncidentBook()
    book.add([finding(10, "nonfinite")])
    ev = book.add([finding(11, "replica_divergence", ranks=(3, 4))])
    assert [(e.change, e.incident.kind, e.incident.ranks) for e in ev] == [("opened", "replica_divergence", (3, 4))]
    # a rank-local finding naming several ranks is placed rank by rank: rank 3's part is related
    ev = book.add([finding(12, "checksum_mismatch", ranks=(3, 5))])
    assert [(e.change, e.incident.kind, e.incident.ranks) for e in ev] == [
        ("updated", "nonfinite", (3,)),
        ("opened", "checksum_mismatch", (5,)),
    ]


def test_a_related_finding_raises_the_severity_and_survives_a_restart():
    book = IncidentBook()
    book.add([finding(10, "silent_drift", sev=Severity.WARNING)])
    (ev,) = book.add([finding(12, "replica_divergence")])
    assert (ev.change, ev.incident.kind, ev.incident.severity) == ("updated", "silent_drift", Severity.CRITICAL)
    again = IncidentBook()
    again.restore(json.loads(json.dumps(book.snapshot())))
    assert again.add([finding(70, "replica_divergence")]) == []  # goes on joining, no news
    (inc,) = [i for i in again.current() if i.open]
    assert [(r["kind"], r["first_step"], r["last_step"]) for r in inc.evidence["related"]] == [
        ("replica_divergence", 12, 70)
    ]
    assert ev.incident.evidence["related"][0]["last_step"] == 12  # an event keeps what it said


def test_spikes_and_findings_naming_no_rank_are_never_folded():
    book = IncidentBook()
    book.add([finding(10, "nonfinite")])
    ev = book.add(
        [finding(10, "loss_spike", ranks=(), sev=Severity.WARNING), finding(11, "checksum_mismatch", ranks=())]
    )
    assert [(e.change, e.incident.kind) for e in ev] == [("opened", "loss_spike"), ("opened", "checksum_mismatch")]
