"""Checkpoints certified on evidence: a fault the job's guard skipped, reran clean or rolled back
leaves the weights clean, so does a finite flip whose effect stayed within the checks' bounds;
each marking says what it rests on (through the pipeline, and through a real broker and serve)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid

import pytest
from polling import wait_for
from sdcwatch.core.control import ACTIONS, REASONS, VERDICTS
from sdcwatch.core.incident import Incident, IncidentEvent, Severity
from sdcwatch.core.rank_notes import CheckpointMark, CheckpointNote
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC
from sdcwatch.service.checkpoint_marks import CheckpointBook, marking
from sdcwatch.service.ingest import IngestDecoder
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.telemetry import Emitter
from sdcwatch.telemetry.wire.transports import MemoryBus, MemoryTransport
from serve_process import ServeProcess, Topics

WORLD, FAULT, CHECKPOINTS = 4, 50, (20, 40, 60, 80)


def _guard(action: str, reason: str = "nonfinite", verdict: str = "") -> dict[str, float]:
    """The scalars a rank's guard puts on the record of a step it acted at."""
    return {
        "guard_action": float(ACTIONS.index(action)),
        "guard_reason": float(REASONS.index(reason)),
        "guard_verdict": float(VERDICTS.index(verdict)),
    }


def _job(emitters: list, fault: str, guard: dict[str, float] | None, steps: int = 100) -> None:
    """Four ranks: a NaN loss on every rank at FAULT (``fault="nan"``) or rank 1's first matrix product
    off by 40 x its checksum's rounding bound, finite (``fault="flip"``); the guard's scalars at FAULT."""
    rng = random.Random(3)
    for step in range(steps):
        for r, em in enumerate(emitters):
            loss = 2.0 + rng.gauss(0, 0.01)
            extra = dict(guard or {}) if step == FAULT else {}
            if fault == "nan" and step == FAULT:
                loss = float("nan")
            ratio = 40.0 if fault == "flip" and step == FAULT and r == 1 else 0.01
            em.emit(step, loss=loss, grad_norm=1.0 + rng.gauss(0, 0.01), layers={"gemm_fwd": [ratio, 0.01]}, **extra)
        if step in CHECKPOINTS:
            emitters[0].checkpoint(step, f"c-{step}")
    for em in emitters:
        em.close()


def _marks_in_process(fault: str, guard: dict[str, float] | None) -> dict[int, CheckpointMark]:
    """The pipeline's latest marking of each checkpoint of a job run through it in process."""
    bus = MemoryBus()
    _job([Emitter(MemoryTransport(bus), run="r", rank=r, world=WORLD, batch=1) for r in range(WORLD)], fault, guard)
    items, rejected = IngestDecoder().decode(("t", k, v) for k, v in bus.messages(TELEMETRY_TOPIC))
    assert not rejected
    pipeline = DetectionPipeline()
    pipeline.process(items)
    pipeline.flush()
    return {m.step: m for m in pipeline.take_marks()}


def test_a_nan_the_guard_skipped_leaves_the_later_checkpoints_clean_and_says_why():
    unguarded = _marks_in_process("nan", None)
    assert [unguarded[s].mark for s in CHECKPOINTS] == ["clean", "clean", "after-fault", "after-fault"]
    assert unguarded[60].evidence[0]["effect"] == "after-fault"
    skipped = _marks_in_process("nan", _guard("skip"))
    assert [skipped[s].mark for s in CHECKPOINTS] == ["clean"] * 4
    (kept,) = skipped[60].evidence
    assert kept["effect"] == "none" and kept["incident"].startswith("r:nonfinite:50")
    assert "the guard skipped the update of step 50" in kept["why"]
    assert "skipped the update of step 50" in skipped[60].reason
    assert skipped[40].evidence == ()  # before the fault: nothing to rest on but the absence of incidents


def test_a_rerun_counts_only_with_a_transient_verdict():
    transient = _marks_in_process("nan", _guard("rerun", verdict="transient"))
    assert transient[60].mark == "clean" and "reran" in transient[60].evidence[0]["why"]
    persistent = _marks_in_process("nan", _guard("rerun", verdict="persistent"))
    assert persistent[60].mark == "after-fault"


def test_a_finite_flip_within_the_checks_bounds_is_clean_with_a_note_and_one_with_a_spike_is_not():
    marks = _marks_in_process("flip", None)
    assert [marks[s].mark for s in CHECKPOINTS] == ["clean"] * 4
    (note,) = marks[60].evidence
    assert note["incident"].startswith("r:checksum_mismatch:50") and note["effect"] == "none"
    assert "a finite flip (40 x" in note["why"]
    rows = [("f", "after-fault", 50, None, 50, note["why"])]
    assert marking(60, rows)[0] == "clean"
    assert marking(60, [*rows, ("s", "spike", 52, None, 52, "")])[:2] == ("after-fault", ("f",))  # it reached the loss
    assert marking(60, [*rows, ("s", "spike", 70, None, 70, "")])[0] == "clean"  # a spike after this checkpoint


def test_a_rollback_cleans_the_checkpoints_after_it_not_those_between_the_fault_and_it():
    rows = [("n", "after-fault", 50, None, 50, "")]
    guarded = {55: "rollback"}
    assert marking(52, rows, guarded)[0] == "after-fault"  # saved before the rollback: it holds the fault
    mark, ids, (entry,) = marking(60, rows, guarded)
    assert (mark, ids, entry["effect"]) == ("clean", (), "none") and "rolled back at step 55" in entry["why"]
    assert marking(60, [("n", "after-fault", 50, None, 58, "")], guarded)[0] == "after-fault"  # seen after it


def test_the_book_keeps_the_guard_s_steps_across_a_snapshot_and_reads_an_older_one():
    def event(kind, step, **evidence):
        inc = Incident(f"r:{kind}:{step}", "r", kind, Severity.CRITICAL, step, step, "m", evidence=evidence)
        return IncidentEvent("opened", inc)

    book = CheckpointBook(clock=lambda: 1.0)
    book.events([event("guard_skip", 50, action="skip"), event("nonfinite", 50)])
    copy = CheckpointBook(clock=lambda: 1.0)
    copy.restore(json.loads(json.dumps(book.snapshot())))
    for b in (book, copy):
        b.note(CheckpointNote("r", 0, WORLD, 60, "c-60"))
        b.judged("r", 60)
        assert [(m.mark, m.evidence[0]["effect"]) for m in b.take_marks()] == [("clean", "none")]
    older = {"runs": {"r": {"judged": 60, "checkpoints": [[60, "c", "after-fault", ["x"]]], "incidents": [["x", "after-fault", 50, None]]}}}  # fmt: skip
    book = CheckpointBook()
    book.restore(older)
    assert [(m.mark, m.evidence) for m in book.marks("r")] == [("after-fault", ())]
    assert CheckpointMark.from_dict({"step": 1, "mark": "clean"}).evidence == ()  # an older marking


def _listing(bootstrap: str, topic: str, run: str) -> dict:
    cmd = [sys.executable, "-m", "sdcwatch.cli", "checkpoints", "--run", run, "--json"]
    out = subprocess.run(
        [*cmd, "--bootstrap", bootstrap, "--topic", topic], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.integration
def test_sdcwatch_checkpoints_json_shows_the_evidence_of_a_skipped_nan_and_of_a_contained_flip(bootstrap, tmp_path):
    topics, tag = Topics.fresh(), uuid.uuid4().hex[:6]
    runs = {f"skip-{tag}": ("nan", _guard("skip")), f"nan-{tag}": ("nan", None), f"flip-{tag}": ("flip", None)}
    with ServeProcess(bootstrap, topics, tmp_path / "state", "--detectors-align-timeout-s", "1") as serve:
        serve.wait_banner()
        for run, (fault, guard) in runs.items():
            ems = [Emitter(run=run, rank=r, world=WORLD, bootstrap=bootstrap, topic=topics.telemetry) for r in range(4)]
            _job(ems, fault, guard)

        def listed(run: str) -> dict | None:
            got = _listing(bootstrap, topics.anomalies, run)
            return got if len(got["checkpoints"]) == len(CHECKPOINTS) else None

        got = {run: wait_for(lambda r=run: listed(r), 90, f"{run}'s checkpoints marked", interval=1.0) for run in runs}
    marks = {run: [c["mark"] for c in g["checkpoints"]] for run, g in got.items()}
    assert marks[f"nan-{tag}"] == ["clean", "clean", "after-fault", "after-fault"]
    assert marks[f"skip-{tag}"] == marks[f"flip-{tag}"] == ["clean"] * 4
    assert got[f"skip-{tag}"]["newest_clean"]["step"] == 80
    for run, needle in ((f"skip-{tag}", "the guard skipped the update of step 50"), (f"flip-{tag}", "a finite flip")):
        (entry,) = got[run]["checkpoints"][2]["evidence"]
        assert entry["effect"] == "none" and needle in entry["why"], entry
    (entry,) = got[f"nan-{tag}"]["checkpoints"][2]["evidence"]
    assert entry == {
        "incident": entry["incident"],
        "effect": "after-fault",
        "why": "began at step 50 and had not resolved",
    }
