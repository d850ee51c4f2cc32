"""Certified checkpoints: the note's codec and bounds, the marking rules, the pipeline's state, the
stage split, and a rollback naming the newest clean checkpoint."""

from __future__ import annotations

import json
import random

import pytest
from sdcwatch.core.rank_notes import CheckpointNote, decode_note, encode_note
from sdcwatch.core.errors import RecordError
from sdcwatch.core.incident import Incident, IncidentEvent, Severity
from memory_source import MemorySource, bus_sink
from sdcwatch.service.checkpoint_marks import CertifiedPolicy, CheckpointBook, marking
from sdcwatch.exporters.topics import AnomalyTopicSink, ControlTopicSink
from sdcwatch.service.control_policy import ControlPolicy
from sdcwatch.service.ingest import IngestDecoder
from sdcwatch.service.loop import DetectorService
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.summary import decode_summary, encode_summary
from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport


def test_note_round_trips_and_a_bad_path_is_dead_lettered_with_its_reason():
    note = CheckpointNote("r", 3, 8, 40, "/ckpt/checkpoint-40")
    assert decode_note(encode_note(note)) == note
    bad = encode_note(note).replace(b"/ckpt/", b"/ck\x1bt/")  # an escape sequence in the path
    items, rejected = IngestDecoder().decode([("t/0/0", b"k", encode_note(note)), ("t/0/1", b"k", bad)])
    assert items == [note]
    assert len(rejected) == 1 and "control character" in rejected[0].reason and rejected[0].code == "malformed"
    with pytest.raises(RecordError, match="longer than 1024"):
        CheckpointNote("r", 0, 1, 1, "x" * 1025)


def _event(change, kind, first, resolved=None, run="r"):
    inc = Incident(f"{run}:{kind}:{first}", run, kind, Severity.CRITICAL, first, first, "m", resolved_step=resolved)
    return IncidentEvent(change, inc)


def test_marking_rules_clean_suspect_after_fault_and_resolution():
    def mark_of(step, incidents):  # incidents as (id, weight, first, resolved): no guard, no measured reach
        return marking(step, [(iid, weight, first, resolved, first, "") for iid, weight, first, resolved in incidents])[
            :2
        ]

    assert mark_of(40, [("a", "suspect", 50, None)]) == ("clean", ())
    assert mark_of(50, [("a", "suspect", 50, None)]) == ("suspect", ("a",))
    assert mark_of(60, [("a", "suspect", 50, 70), ("b", "after-fault", 55, None)]) == ("after-fault", ("a", "b"))
    assert mark_of(60, [("b", "after-fault", 55, None), ("a", "suspect", 50, 70)])[0] == "after-fault"
    assert mark_of(80, [("a", "suspect", 50, 70)]) == ("clean", ())  # resolved before it


def test_an_incident_found_later_re_marks_a_checkpoint_and_says_so():
    book = CheckpointBook(clock=lambda: 1.0)
    for step in (20, 40, 60):
        book.note(CheckpointNote("r", 0, 4, step, f"c-{step}"))
    book.judged("r", 70)
    assert [m.mark for m in book.take_marks()] == ["clean", "clean", "clean"]
    book.events([_event("opened", "silent_drift", 50)])  # found at step 75, onset 50
    marks = book.take_marks()
    assert [(m.step, m.mark, m.was) for m in marks] == [(60, "suspect", "clean")]
    assert "re-marked: was clean" in marks[0].reason
    book.note(CheckpointNote("r", 0, 4, 80, "c-80"))
    book.judged("r", 80)
    assert [(m.step, m.mark) for m in book.take_marks()] == [(80, "suspect")]  # later ones stay suspect
    book.events([_event("resolved", "silent_drift", 50, resolved=90)])
    assert book.take_marks() == []  # resolved after them: still suspect
    book.note(CheckpointNote("r", 0, 4, 100, "c-100"))
    book.judged("r", 100)
    assert [(m.step, m.mark) for m in book.take_marks()] == [(100, "clean")]
    assert book.rollback_target("r", 55).path == "c-40"
    restored = CheckpointBook()
    restored.restore(json.loads(json.dumps(book.snapshot())))
    assert restored.marks("r") == book.marks("r")


def _job(bus, *, diverge_at=50, steps=100, saves=(20, 40, 60, 80)):
    """4 data-parallel ranks; rank 2's parameters diverge from ``diverge_at``; rank 0 saves checkpoints."""
    rng = random.Random(0)
    ems = [Emitter(MemoryTransport(bus), run="r", rank=r, world=4, host=f"h{r}") for r in range(4)]
    for step in range(steps):
        for r, em in enumerate(ems):
            fp = 1000 + step + (7 if r == 2 and step >= diverge_at else 0)
            em.emit(
                step, loss=2.0 + rng.gauss(0, 0.01), grad_norm=1.0 + rng.gauss(0, 0.01), fingerprints={"param_fp": fp}
            )
        if step in saves:
            ems[0].checkpoint(step, f"/ckpt/step-{step}")
    for em in ems:
        em.close()
    assert ems[0].notes.sent == len(saves)


def _drain(svc):
    for _ in range(20):
        svc.step()
    svc._publish(svc.pipeline.flush())
    svc.step()


def test_service_marks_publishes_and_a_rollback_names_the_newest_clean_checkpoint(tmp_path):
    bus = MemoryBus()
    _job(bus)
    pipeline = DetectionPipeline()
    control = bus_sink(
        ControlTopicSink, bus, policy=CertifiedPolicy.around(ControlPolicy(actions=True), pipeline.checkpoints)
    )
    svc = DetectorService(
        MemorySource(bus), pipeline, sinks=[bus_sink(AnomalyTopicSink, bus), control], poll_timeout=0.01
    )
    _drain(svc)
    marks = {
        d["step"]: d for _, v in bus.messages("sdcwatch.anomalies") if (d := json.loads(v))["change"] == "checkpoint"
    }
    assert {s: d["mark"] for s, d in marks.items()} == {20: "clean", 40: "clean", 60: "after-fault", 80: "after-fault"}
    assert marks[60]["incidents"] == ["r:replica_divergence:50"] and marks[60]["path"] == "/ckpt/step-60"
    [decision] = control.decisions
    assert decision.action == "rollback" and decision.checkpoint == "/ckpt/step-40"
    view = svc.view()
    assert [(m.step, m.mark) for m in view.checkpoints][:2] == [(80, "after-fault"), (60, "after-fault")]


def test_the_split_stages_forward_the_notes_to_the_temporal_stage():
    bus = MemoryBus()
    _job(bus)
    spatial = DetectionPipeline(stage="spatial")
    temporal = DetectionPipeline(stage="temporal")
    source = MemorySource(bus)
    for _ in range(5):
        spatial.process(source.poll())
    spatial.flush()
    wire = [decode_summary(encode_summary(s)) for s in spatial.take_summaries()]  # over the summaries topic
    temporal.process_summaries(wire)
    temporal.flush()
    assert {m.step: m.mark for m in temporal.checkpoints.marks("r")} == {
        20: "clean",
        40: "clean",
        60: "after-fault",
        80: "after-fault",
    }
    assert spatial.checkpoints.marks("r") == []  # the spatial stage marks nothing: it forwards


# -- issue 36 item 8: faked checkpoint marks ----------------------------------------------------


def test_two_paths_noted_for_one_step_certify_neither_and_a_rollback_names_the_step():
    """Before: the first note for a step won, so a forger's note sent first certified its path."""
    book = CheckpointBook(clock=lambda: 1.0)
    book.note(CheckpointNote("r", 0, 4, 40, "/attacker/x"))
    book.note(CheckpointNote("r", 0, 4, 40, "/real/c-40"))
    book.note(CheckpointNote("r", 1, 4, 40, "/real/c-40"))
    book.judged("r", 45)
    (mark,) = book.take_marks()
    assert (mark.step, mark.path, mark.mark) == (40, "", "clean") and book.disputed == 1
    policy = CertifiedPolicy.around(ControlPolicy(actions=True, on_nonfinite="rollback"), book)
    inc = Incident("r:nonfinite:50", "r", "nonfinite", Severity.CRITICAL, 50, 50, "m", ranks=(2,))
    assert policy.decide(inc).checkpoint == "step 40"
    book.note(CheckpointNote("r", 0, 4, 50, "/real/c-50"))
    book.judged("r", 52)
    book.note(CheckpointNote("r", 0, 4, 50, "/attacker/y"))  # after its marking: published again, no path
    assert [(m.step, m.path) for m in book.take_marks()] == [(50, "/real/c-50"), (50, "")]


def test_a_disputed_checkpoint_stays_disputed_across_a_restart():
    """Before: the snapshot kept a disputed step's empty path but not the dispute, so after a restart
    a third note (the forger's again) certified its path."""
    book = CheckpointBook(clock=lambda: 1.0)
    book.note(CheckpointNote("r", 0, 4, 40, "/attacker/x"))
    book.note(CheckpointNote("r", 0, 4, 40, "/real/c-40"))
    book.note(CheckpointNote("r", 0, 4, 60, "/real/c-60"))
    restored = CheckpointBook(clock=lambda: 1.0)
    restored.restore(json.loads(json.dumps(book.snapshot())))
    restored.note(CheckpointNote("r", 0, 4, 40, "/attacker/x"))
    restored.note(CheckpointNote("r", 0, 4, 60, "/attacker/y"))  # a second path: disputed now, after the restart
    restored.judged("r", 70)
    assert [(m.step, m.path) for m in restored.take_marks()] == [(40, ""), (60, "")]
    assert restored.rollback_target("r", 70).path == ""


def test_notes_of_a_thousand_runs_nobody_watches_do_not_push_out_a_watched_runs_checkpoints():
    """Before: 1,000 notes of another tenant's runs pushed the real run's checkpoints out of the record."""
    watched = {"real"}
    book = CheckpointBook(max_runs=100, clock=lambda: 1.0, holds=watched.__contains__)
    book.note(CheckpointNote("real", 0, 4, 40, "/real/c-40"))
    book.judged("real", 45)
    for i in range(1000):
        book.note(CheckpointNote(f"junk-{i}", 0, 1, 1, f"/junk/{i}"))
    assert [(m.step, m.path) for m in book.marks("real")] == [(40, "/real/c-40")]


def test_a_reader_with_the_key_file_believes_only_the_services_signature_on_the_anomalies_topic():
    """Before: `sdcwatch checkpoints` believed an unsigned marking (one made /attacker/x the newest clean)."""
    from sdcwatch.bus_reading import anomaly_opener
    from sdcwatch.checkpoint_list import CheckpointList
    from sdcwatch.core.signing import AuthError, JobKey, Keyring

    ring = Keyring([JobKey("job-a", b"a-secret-of-job-a-0123"), JobKey("job-b", b"b-secret-of-job-b-0123")])
    bus = MemoryBus()
    sink = bus_sink(AnomalyTopicSink, bus, "a", key=ring.service_key("anomalies"))
    book = CheckpointBook(clock=lambda: 1.0)
    book.note(CheckpointNote("r", 0, 4, 40, "/real/c-40"))
    book.judged("r", 45)
    sink.publish_mark(book.take_marks()[0])
    forged = b'{"change": "checkpoint", "run": "r", "step": 50, "path": "/attacker/x", "mark": "clean"}'
    values = [forged, ring.get("job-b").sign(forged), *(v for _, v in bus.messages("a"))]
    board, refused = CheckpointList("r"), []
    open_anomaly = anomaly_opener(ring)
    for value in values:
        try:
            board.take(open_anomaly(value))
        except AuthError as exc:
            refused.append(exc.problem)
    assert board.newest_clean()["path"] == "/real/c-40" and len(refused) == 2
    assert "not signed by the service" in refused[0] and "job-b" in refused[1]
    without_keys = CheckpointList("r")  # no key file: unsigned read as before, a signed one refused
    with pytest.raises(AuthError):
        without_keys.take(anomaly_opener(None)(values[-1]))
    assert without_keys.take(anomaly_opener(None)(forged))
