"""Incidents show their onset: the finding that opened an incident (step, rank, module, message,
evidence) is kept beside the latest evidence, read back by ``sdcwatch incidents`` (table and --json),
and an incident written before it was kept still reads."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from polling import wait_for
from sdcwatch.core.incident import Incident
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC
from sdcwatch.incidents import IncidentBoard, incident_line
from sdcwatch.service.incidents import IncidentBook
from sdcwatch.service.ingest import IngestDecoder
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.telemetry import Emitter
from sdcwatch.telemetry.wire.transports import MemoryBus, MemoryTransport
from serve_process import ServeProcess, Topics

NAMES = [f"h.{k}.mlp.c_fc" for k in range(4)]
ONSET, SPREAD, STEPS = 20, 25, 90


def _job(emitters: list) -> None:
    """Rank 2's product 2 (h.2.mlp.c_fc) goes NaN at ONSET, all four of its products at SPREAD."""
    for em in emitters:
        em.set_names({"products": NAMES})
    for step in range(STEPS):
        for r, em in enumerate(emitters):
            products = [3.0] * len(NAMES)
            if r == 2 and step == ONSET:
                products[2] = float("nan")
            if r == 2 and step == SPREAD:
                products = [float("nan")] * len(NAMES)
            em.emit(step, loss=2.0, layers={"gemm_out": products})
    for em in emitters:
        em.close()


def _check(incident: dict) -> None:
    """The incident's latest evidence is SPREAD's (four products), its onset ONSET's (one, named)."""
    assert incident["evidence"]["values_bad"] == len(NAMES)
    onset = incident["onset"]
    assert (onset["step"], onset["ranks"], onset["layer_name"], onset["metric"]) == (
        ONSET,
        [2],
        "h.2.mlp.c_fc",
        "gemm_out",
    )
    assert onset["evidence"]["values_bad"] == 1
    assert [h["layer_name"] for h in onset["evidence"]["hits"]] == ["h.2.mlp.c_fc"]
    assert f"at step {ONSET}" in onset["message"] and "h.2.mlp.c_fc" in onset["message"]


def test_the_pipeline_keeps_the_onset_beside_the_latest_evidence_and_through_a_snapshot():
    bus = MemoryBus()
    _job([Emitter(MemoryTransport(bus), run="r", rank=r, world=4, batch=1) for r in range(4)])
    items, rejected = IngestDecoder().decode(("t", k, v) for k, v in bus.messages(TELEMETRY_TOPIC))
    assert not rejected
    pipeline = DetectionPipeline()
    events = pipeline.process(items) + pipeline.flush()
    (resolved,) = [e for e in events if e.change == "resolved" and e.incident.kind == "nonfinite"]
    _check(resolved.incident.to_dict())
    again = Incident.from_dict(json.loads(json.dumps(resolved.incident.to_dict())))
    assert again.onset == resolved.incident.to_dict()["onset"]
    book = IncidentBook()
    book.restore({"open": [], "resolved": [resolved.incident.to_dict()], "opened_total": []})
    _check(json.loads(json.dumps(book.snapshot()))["resolved"][0])


def test_an_incident_without_an_onset_still_reads_and_a_malformed_one_is_refused():
    older = {
        "id": "r:nonfinite:3",
        "run": "r",
        "kind": "nonfinite",
        "severity": "critical",
        "step": 3,
        "message": "nan",
    }
    inc = Incident.from_dict(older)
    assert inc.onset is None and "onset" not in inc.to_dict()
    board = IncidentBoard()
    assert board.take(json.dumps({**older, "change": "opened"}).encode(), 0)["id"] == "r:nonfinite:3"
    assert board.take(json.dumps({**older, "id": "x", "onset": "step 3"}).encode(), 0) is None
    assert board.unreadable == 1
    with pytest.raises(ValueError, match="'onset' has the wrong type"):
        Incident.from_dict({**older, "onset": [3]})


def test_the_table_line_adds_the_onset_only_when_a_later_finding_changed_the_message():
    event = {"id": "r:rank_fault:9", "run": "r", "kind": "sdc_suspected", "severity": "critical", "first_step": 9}
    event |= {"last_step": 30, "message": "SDC suspected on rank 1"}
    onset = {"step": 9, "ranks": [1], "message": "rank 1 an outlier at step 9 in h.2.mlp.c_fc"}
    line = incident_line({**event, "onset": onset}, "open")
    assert line.endswith("SDC suspected on rank 1  (onset: rank 1 an outlier at step 9 in h.2.mlp.c_fc)")
    same = incident_line({**event, "onset": {**onset, "message": event["message"]}}, "open")
    assert same == incident_line(event, "open") and "onset" not in same


@pytest.mark.integration
def test_sdcwatch_incidents_shows_the_onset_beside_the_latest_evidence(bootstrap, tmp_path):
    topics, run = Topics.fresh(), f"onset-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, "-m", "sdcwatch.cli", "incidents", "--run", run, "--bootstrap", bootstrap]
    cmd += ["--topic", topics.anomalies]

    def resolved() -> dict | None:
        out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60, check=True).stdout
        found = [json.loads(line) for line in out.splitlines() if line.strip()]
        return next((i for i in found if i["kind"] == "nonfinite" and not i["open"]), None)

    with ServeProcess(bootstrap, topics, tmp_path / "state", "--detectors-align-timeout-s", "1") as serve:
        serve.wait_banner()
        _job([Emitter(run=run, rank=r, world=4, bootstrap=bootstrap, topic=topics.telemetry) for r in range(4)])
        incident = wait_for(resolved, 90, "the NaN incident resolved on the anomalies topic", interval=1.0)
    _check(incident)
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"{incident['id']}  non-finite value at step {ONSET}: gemm_out of h.2.mlp.c_fc" in table
