"""Incident book, attribution and the whole pipeline on synthetic jobs with known answers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.errors import ConfigError
from sdcwatch.detectors import Finding, Severity
from sdcwatch.core.incident import Incident
from sdcwatch.service.incidents import IncidentBook
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings


def finding(step, kind="loss_spike", sev=Severity.WARNING, ranks=(), msg="m", detector="d", score=1.0, **kw):
    return Finding(
        detector=detector, kind=kind, severity=sev, run="r", step=step, score=score, message=msg, ranks=ranks, **kw
    )


def run_pipeline(faults, steps=300, world=8, seed=2, pipe=None):
    pipe = pipe or DetectionPipeline()
    synth = SyntheticRun(world=world, seed=seed, faults=faults)
    events = []
    for s in range(steps):
        events += pipe.process(synth.records(s))
    events += pipe.flush()
    return pipe, events


# -- the book -----------------------------------------------------------------------------------


def test_one_incident_per_problem_and_resolution_after_quiet_steps():
    book = IncidentBook(quiet_steps=10)
    events = []
    for s in range(100, 130):
        events += book.add([finding(s, kind="nonfinite", sev=Severity.CRITICAL, msg=f"nan at {s}")])
        events += book.advance("r", s)
    for s in range(130, 145):
        events += book.advance("r", s)
    assert [e.change for e in events] == ["opened", "resolved"]
    inc = events[-1].incident
    assert (inc.first_step, inc.last_step, inc.resolved_step) == (100, 129, 139)
    assert inc.message == "nan at 100"  # not rewritten every step


def test_rank_local_problems_get_one_incident_per_rank_and_escalate_in_place():
    book = IncidentBook()
    ev = book.add([finding(5, kind="silent_drift", ranks=(3,)), finding(5, kind="silent_drift", ranks=(4,))])
    assert [e.change for e in ev] == ["opened", "opened"]
    ev = book.add([finding(9, kind="sdc_suspected", sev=Severity.CRITICAL, ranks=(3,), msg="SDC on 3")])
    assert [(e.change, e.incident.kind, e.incident.severity) for e in ev] == [
        ("updated", "sdc_suspected", Severity.CRITICAL)
    ]
    assert len([i for i in book.current() if i.open]) == 2
    # the counter alert rules read: the escalation counts as an SDC-suspected incident too
    assert book.opened_total == {("silent_drift", "warning"): 2, ("sdc_suspected", "critical"): 1}


def test_incident_metric_and_layer_are_those_its_message_names():
    """A later, stronger finding of the same problem must not move the metric and layer away from
    what the message says (a non-finite streak: the onset names attn_logit_max layer 1, a later step
    has more bad values in attn_entropy layer 0)."""
    book = IncidentBook()
    nonfinite = dict(kind="nonfinite", sev=Severity.CRITICAL, ranks=(3,), detector="nonfinite")
    onset = "non-finite value at step 88: attn_logit_max layer 1 = nan on rank 3"
    book.add([finding(88, msg=onset, metric="attn_logit_max", layer=1, **nonfinite)])
    streak = "non-finite values since step 88, which began on rank 3"
    book.add([finding(89, msg=streak, metric="attn_entropy", layer=0, score=40.0, **nonfinite)])
    (inc,) = [i for i in book.current() if i.open]
    assert inc.message.startswith("non-finite value at step 88: attn_logit_max layer 1")
    assert (inc.metric, inc.layer) == ("attn_logit_max", 1)
    assert (inc.score, inc.peak_step) == (40.0, 89)


def test_info_findings_never_open_incidents():
    book = IncidentBook()
    assert book.add([finding(1, kind="rank_deviation", sev=Severity.INFO, ranks=(1,))]) == []


def test_incident_round_trips_through_its_dict():
    book = IncidentBook()
    (ev,) = book.add(
        [
            finding(
                7,
                kind="nonfinite",
                sev=Severity.CRITICAL,
                ranks=(2,),
                hosts=("h",),
                layer=1,
                metric="q",
                evidence={"x": float("nan")},
            )
        ]
    )
    d = json.loads(json.dumps(ev.incident.to_dict(), allow_nan=False))
    back = Incident.from_dict(d)
    assert (back.id, back.kind, back.severity, back.ranks, back.hosts, back.layer) == (
        ev.incident.id,
        "nonfinite",
        Severity.CRITICAL,
        (2,),
        ("h",),
        1,
    )


def test_bad_book_settings_are_named():
    with pytest.raises(ConfigError, match="incidents.quiet_steps"):
        IncidentBook(quiet_steps=0)
    with pytest.raises(ConfigError, match="detectors.align_timeout_s"):
        PipelineSettings(align_timeout_s=-1)


# -- attribution through the pipeline ---------------------------------------------------------------


def incidents_by_kind(pipe):
    out = {}
    for inc in pipe.incidents():
        out.setdefault(inc.kind, []).append(inc)
    return out


def test_benign_spike_on_all_ranks_is_optimisation_instability_and_blames_no_rank():
    pipe, _ = run_pipeline([Fault("loss_spike", 200)])
    kinds = incidents_by_kind(pipe)
    assert set(kinds) == {"loss_spike"}
    (inc,) = kinds["loss_spike"]
    assert inc.first_step == 200 and inc.ranks == ()
    assert "ranks consistent, optimisation/data instability" in inc.message
    assert inc.evidence["attribution"] == "optimisation_data"


def test_bad_batch_on_one_rank_is_not_blamed_on_that_rank():
    pipe = DetectionPipeline()
    synth = SyntheticRun(seed=3)
    for s in range(250):
        recs = synth.records(s)
        if s == 200:  # rank 4's batch is bad: its loss and local gradient jump, internals do not
            r = recs[4]
            sc = dict(r.scalars, loss=r.scalars["loss"] * 12, grad_norm_local=r.scalars["grad_norm_local"] * 30)
            recs[4] = type(r)(**{**{k: getattr(r, k) for k in r.__slots__}, "scalars": sc})
        pipe.process(recs)
    kinds = incidents_by_kind(pipe)
    assert "loss_spike" in kinds and "sdc_suspected" not in kinds
    assert all(inc.ranks == () for inc in kinds["loss_spike"])
    assert "rank 4's own loss" in kinds["loss_spike"][0].message


def test_persistent_rank_deviation_without_spike_is_silent_drift_on_that_rank():
    pipe, _ = run_pipeline([Fault("rank_shift", 150, rank=5, layer=2)])
    kinds = incidents_by_kind(pipe)
    assert set(kinds) == {"silent_drift"}
    (inc,) = kinds["silent_drift"]
    assert inc.ranks == (5,) and inc.hosts == ("node1",) and inc.layer == 2
    assert inc.message.startswith("silent drift suspected on rank 5 (host node1), layer 2 attention")
    assert 150 < inc.first_step <= 200


def test_spike_with_rank_local_evidence_is_sdc_suspected_on_that_rank_once():
    pipe, events = run_pipeline([Fault("rank_shift", 150, rank=5, layer=2), Fault("loss_spike", 190)])
    kinds = incidents_by_kind(pipe)
    (sdc,) = kinds["sdc_suspected"]
    assert sdc.ranks == (5,) and sdc.severity is Severity.CRITICAL and sdc.layer == 2
    assert sdc.message.startswith("SDC suspected on rank 5 (host node1), layer 2 attention")
    (spike,) = kinds["loss_spike"]
    assert "SDC suspected on rank 5" in spike.message
    opened = [e.incident.id for e in events if e.change == "opened"]
    assert len(opened) == len(set(opened)) == 2  # the rank's incident escalated, not re-opened


def test_rank_evidence_first_showing_after_a_run_wide_spike_is_not_blamed():
    # an lr spike throws every rank; one ends up furthest out a few steps later: a consequence
    pipe, _ = run_pipeline([Fault("loss_spike", 150), Fault("rank_shift", 152, rank=6, layer=0, length=40)], steps=260)
    kinds = incidents_by_kind(pipe)
    assert "sdc_suspected" not in kinds
    (spike,) = kinds["loss_spike"]
    assert spike.evidence["attribution"] == "optimisation_data" and spike.ranks == ()


def test_nonfinite_on_one_rank_is_one_critical_incident_naming_it():
    pipe, events = run_pipeline([Fault("nonfinite", 120, rank=2, layer=3)])
    (inc,) = pipe.incidents()
    assert (inc.kind, inc.first_step, inc.ranks, inc.layer, inc.metric) == ("nonfinite", 120, (2,), 3, "attn_logit_max")


def test_clean_job_raises_nothing():
    pipe, events = run_pipeline([], steps=400)
    assert events == [] and pipe.incidents() == []


# -- view and state ---------------------------------------------------------------------------------


def test_view_fills_run_and_pipeline_health():
    pipe, _ = run_pipeline([Fault("rank_shift", 100, rank=5, layer=2), Fault("missing", 280, rank=1)], steps=300)
    v = pipe.view()
    (run,) = v.runs
    assert run.world == 8 and run.last_step == 299 and run.steps_total == 300
    rank_scores = run.detector_values["sdcwatch_rank_outlier_score"]
    assert rank_scores.shape == (8,) and rank_scores.argmax() == 5
    assert run.hosts[1] == "node0"  # remembered although rank 1 stopped reporting
    assert run.late_ranks == 1 and run.detector_values["sdcwatch_pipeline_missing_ranks"] == 1
    stats = run.scalar_stats["loss"]
    assert stats.shape == (5,) and np.all(np.diff(stats) >= 0)
    assert run.layer_stats["q_norm_mean"].shape == (4, 5)
    assert v.pipeline.records_total == 300 * 8 - 20 * 1
    assert v.incidents_total[("silent_drift", "warning")] == 1
    assert v.findings_total[("rank_outlier", "rank_outlier")] > 0


def test_emitter_dropped_sums_the_latest_value_of_each_rank():
    pipe = DetectionPipeline()
    synth = SyntheticRun(world=4)
    for s in range(3):
        recs = synth.records(s)
        recs = [
            type(r)(
                **{
                    **{k: getattr(r, k) for k in r.__slots__},
                    "scalars": dict(r.scalars, emitter_dropped=float(10 * s + r.rank)),
                }
            )
            for r in recs
        ]
        pipe.process(recs)
    assert pipe.view().runs[0].emitter_dropped == sum(20 + r for r in range(4))


def test_save_and_load_resume_without_warmup_or_repeats(tmp_path):
    faults = [Fault("rank_shift", 150, rank=5, layer=2), Fault("loss_spike", 230)]
    whole, whole_events = run_pipeline(faults, steps=300)
    synth = SyntheticRun(seed=2, faults=faults)
    first = DetectionPipeline()
    ev = []
    for s in range(200):
        ev += first.process(synth.records(s))
    first.save(tmp_path / "state.json")
    second = DetectionPipeline()
    assert second.load(tmp_path / "state.json")
    for s in range(150, 300):  # redelivery of 50 steps already seen
        ev += second.process(synth.records(s))
    ev += second.flush()

    def key(evs):
        return [(e.change, e.incident.id, e.incident.kind) for e in evs]

    assert key(ev) == key(whole_events)
    assert second.aligner.late_records == 50 * 8
    assert second.view().pipeline.late_records_total == 50 * 8  # exported as a metric


def test_a_run_that_goes_silent_has_its_incidents_resolved_after_run_stale_s():
    now = [1000.0]
    pipe = DetectionPipeline(PipelineSettings(run_stale_s=60), wall=lambda: now[0])
    synth = SyntheticRun(seed=2, faults=[Fault("replica", 20, rank=6)])
    for s in range(40):
        pipe.process(synth.records(s))
    assert [i.open for i in pipe.incidents()] == [True]
    now[0] += 59
    assert pipe.expire() == []
    now[0] += 2
    (ev,) = pipe.expire()
    assert ev.change == "resolved" and ev.incident.resolved_step == 39
