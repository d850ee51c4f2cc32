"""The control policy and the sink that publishes its decisions; the guard-action findings."""

from __future__ import annotations

import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.control import decode_decision
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import Incident, IncidentEvent, Severity
from sdcwatch.core.vocabulary import CONTROL_TOPIC
from sdcwatch.detectors.guard_actions import GuardActionDetector
from sdcwatch.exporters.topics import ControlTopicSink
from memory_source import bus_sink
from sdcwatch.service.control_policy import ControlPolicy
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.telemetry import MemoryBus

ON = ControlPolicy(actions=True)


def incident(kind, ranks=(5,), severity=Severity.CRITICAL, evidence=None, ident=None):
    return Incident(
        id=ident or f"r1:{kind}:40",
        run="r1",
        kind=kind,
        severity=severity,
        first_step=40,
        last_step=42,
        message="m",
        ranks=tuple(ranks),
        hosts=tuple(f"h{r // 2}" for r in ranks),
        evidence=evidence or {},
    )


def test_default_policy_decides_nothing():
    assert ControlPolicy().decide(incident("sdc_suspected")) is None


@pytest.mark.parametrize(
    "kind,evidence,action",
    [
        ("sdc_suspected", None, "evict"),
        ("silent_drift", None, "evict"),
        ("replica_divergence", {"metrics": {"param_fp": [5], "canary_fp": [5]}}, "rollback"),
        ("replica_divergence", {"metrics": {"canary_fp": [5]}}, "evict"),
        ("loss_spike", None, None),
        ("grad_spike", None, None),
        ("nonfinite", None, None),
        ("rank_outlier", None, None),
        ("guard_skip", None, None),
    ],
)
def test_policy_rules(kind, evidence, action):
    d = ON.decide(incident(kind, evidence=evidence))
    assert (d.action if d else None) == action
    if d is not None:
        assert d.ranks == (5,) and d.hosts == ("h2",) and d.since_step == 40 and d.run == "r1"
        assert kind in d.reason and d.incident == f"r1:{kind}:40"


def test_an_incident_asks_for_the_strongest_rule_of_the_findings_it_holds_as_related():
    """One fault, one incident: a kind folded into another incident as related evidence keeps its
    rule (a parameter divergence, rollback, folded into a silent drift, evict, asks for evict)."""
    related = [{"kind": "silent_drift", "ranks": [5], "first_step": 41}]
    folded = incident("replica_divergence", evidence={"metrics": {"param_fp": [5]}, "related": related})
    assert ON.decide(folded).action == "evict"
    milder = incident("silent_drift", evidence={"related": [{"kind": "replica_divergence", "ranks": [5]}]})
    assert ON.decide(milder).action == "evict"
    only_info = incident("nonfinite", evidence={"related": [{"kind": "checksum_mismatch", "ranks": [5]}]})
    assert ON.decide(only_info) is None  # neither rule acts by default


def test_min_severity_and_one_rank_for_an_eviction():
    strict = ControlPolicy(actions=True, min_severity="critical")
    assert strict.decide(incident("silent_drift", severity=Severity.WARNING)) is None
    assert ON.decide(incident("silent_drift", severity=Severity.WARNING)).action == "evict"
    assert ON.decide(incident("sdc_suspected", ranks=(1, 2))) is None
    assert ON.decide(incident("sdc_suspected", ranks=())) is None


def test_policy_errors_name_the_key():
    with pytest.raises(ConfigError, match="guard.on_loss_spike"):
        ControlPolicy(on_loss_spike="reboot")
    with pytest.raises(ConfigError, match="guard.min_severity"):
        ControlPolicy(min_severity="info")
    with pytest.raises(ConfigError, match="guard.on_loss_spkie"):
        ControlPolicy.from_dict({"on_loss_spkie": "none"})


def test_sink_publishes_each_decision_once_as_json_on_the_control_topic():
    bus = MemoryBus()
    sink = bus_sink(ControlTopicSink, bus, policy=ON)
    inc = incident("silent_drift")
    for change in ("opened", "updated", "updated", "resolved"):
        sink.publish(IncidentEvent(change, inc))
    sink.publish(IncidentEvent("updated", incident("sdc_suspected", ident=inc.id)))  # escalated: same action
    sink.publish(IncidentEvent("opened", incident("loss_spike", ranks=())))
    msgs = bus.messages(CONTROL_TOPIC)
    assert len(msgs) == 1 and sink.published == 1 and sink.errors == 0
    key, value = msgs[0]
    d = decode_decision(value)
    assert key == b"r1" and (d.action, d.ranks, d.hosts, d.since_step) == ("evict", (5,), ("h2",), 40)


def test_guard_actions_become_incidents_and_counted_findings():
    synth = SyntheticRun(
        seed=2, faults=[Fault("guard_action", step=30, rank=3), Fault("guard_action", step=33, rank=3)]
    )
    pipeline = DetectionPipeline()
    events = [ev for s in range(40) for ev in pipeline.process_frame(synth.frame(s))]
    guard = [ev for ev in events if ev.incident.kind.startswith("guard_")]
    assert [(ev.change, ev.incident.kind, ev.incident.last_step) for ev in guard] == [
        ("opened", "guard_skip", 30),
        ("updated", "guard_skip", 33),
    ]  # every action is an event
    inc = guard[0].incident
    assert inc.ranks == (3,) and inc.hosts == ("node0",) and inc.severity is Severity.WARNING
    assert "skipped the update of step 30" in inc.message and "rerun verdict: data" in inc.message
    assert pipeline.view().findings_total[(GuardActionDetector.name, "guard_skip")] == 2


def test_a_checksum_incident_asks_for_the_action_its_rule_names():
    inc = incident("checksum_mismatch", ranks=(3,), severity=Severity.CRITICAL)
    assert ControlPolicy(actions=True).decide(inc) is None  # the guard's own check reruns it
    decision = ControlPolicy(actions=True, on_checksum_mismatch="rollback").decide(inc)
    assert (decision.action, decision.ranks, decision.since_step) == ("rollback", (3,), 40)
