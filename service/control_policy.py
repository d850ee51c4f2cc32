"""Closing the loop: incidents become decisions for the training job's guard, on the control topic.

:class:`ControlPolicy` says which action (``skip``, ``rollback``, ``evict`` or none) an incident of
each kind asks for, from which severity on; :class:`ControlTopicSink` is an incident sink that
applies it to every opened or updated incident and publishes each new decision, once per incident
and action, as JSON (:class:`~sdcwatch.core.control.Decision`) keyed by run to
``sdcwatch.control``, numbered, and signed with the run's job key when the run signs its telemetry. The guard on rank 0 of the run reads it and the ranks agree on it at the next
step boundary. The policy's default takes no action: sdcwatch detects and reports until the user
turns actions on (``[guard] actions = true``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

from sdcwatch.core.control import Decision
from sdcwatch.core.errors import ConfigError, ControlError
from sdcwatch.core.incident import Incident, IncidentEvent, Severity
from sdcwatch.core.signing import JobKey
from sdcwatch.core.vocabulary import CONTROL_TOPIC
from sdcwatch.detectors.replica import PEER_VOTED
from sdcwatch.service.bus import TopicWriter

__all__ = ["ControlPolicy", "ControlTopicSink", "POLICY_ACTIONS"]

log = logging.getLogger("sdcwatch.service.control_policy")

#: What a policy rule may say.
POLICY_ACTIONS = ("none", "skip", "rollback", "evict")


@dataclass
class ControlPolicy:
    """Which decision each incident kind asks for. Rules name an action from :data:`POLICY_ACTIONS`:
    "none", "skip" (the update of the next step), "rollback" (to the guard's last snapshot before
    the incident began; replicas resynchronised from a healthy one), "evict" (the rank the incident
    names; the job exits with code 16 naming the host).

    A replica divergence is split by its evidence: parameter fingerprints that disagree are a
    replica's memory gone wrong (``on_replica_divergence``, by default a rollback that resynchronises
    the replicas from a healthy one); only a canary disagreeing (the whole-model ``canary_fp`` or
    the per-product ``gemm_canary_fp``) is that rank computing wrongly
    (``on_canary_divergence``, by default an eviction). ``sdcwatch serve`` takes these settings from
    its ``[guard]`` table (:class:`sdcwatch.config.GuardPolicyConfig`).
    """

    actions: bool = False
    """Publish decisions to the control topic at all; off by default (detect and report only)."""
    min_severity: str = "warning"
    """Incidents below this severity (warning, critical) never cause a decision."""
    on_nonfinite: str = "none"
    """Non-finite values. The guard's own check already reruns or skips that step, before the
    update; "rollback" here also undoes what reached the weights when no guard acted."""
    on_checksum_mismatch: str = "none"
    """A product's checksum above its rounding bound on a rank. As with a non-finite value, the
    guard's own check (``on_checksum``) already reruns that step before the update; "rollback"
    here also undoes what reached the weights when no guard checked it."""
    on_checksum_outlier: str = "none"
    """One rank's checksum residual far above the other ranks' (under the bound): a warning."""
    on_loss_spike: str = "none"
    """A loss spike on every rank alike: the data or the optimisation, not a rank."""
    on_grad_spike: str = "none"
    """A gradient spike on every rank alike."""
    on_replica_divergence: str = "rollback"
    """One replica's parameter fingerprint disagrees with the others (its memory changed)."""
    on_canary_divergence: str = "evict"
    """Only a rank's canary output (whole model or one product) disagrees: that rank computes wrongly."""
    on_rank_outlier: str = "none"
    """One rank's statistics deviate, not yet with confidence."""
    on_silent_drift: str = "evict"
    """One rank deviates persistently, with confidence (an unhealthy node)."""
    on_sdc_suspected: str = "evict"
    """A spike joined with one rank's evidence: SDC suspected on that rank."""
    lr_factor: float = 1.0
    """Learning-rate factor a rollback decision carries, in (0, 1] (1.0: unchanged)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.startswith("on_") and getattr(self, f.name) not in POLICY_ACTIONS:
                raise ConfigError(
                    f"guard.{f.name}", f"must be one of {', '.join(POLICY_ACTIONS)}, got {getattr(self, f.name)!r}"
                )
        if self.min_severity not in ("warning", "critical"):
            raise ConfigError("guard.min_severity", f"must be warning or critical, got {self.min_severity!r}")
        if (
            isinstance(self.lr_factor, bool)
            or not isinstance(self.lr_factor, (int, float))
            or not (0 < self.lr_factor <= 1)
        ):
            raise ConfigError("guard.lr_factor", f"must be a number in (0, 1], got {self.lr_factor!r}")

    def rule(self, incident: Incident) -> tuple[str, str]:
        """(rule name, action) for an incident: the strongest of its own kind's rule and those of
        the findings of the same fault it holds as related evidence (a replica divergence folded
        into a silent drift still asks for what either asks for)."""
        evidence = incident.evidence if isinstance(incident.evidence, dict) else {}
        rules = [self._kind_rule(incident.kind, evidence)]
        for rel in evidence.get("related", ()) or ():
            if isinstance(rel, dict) and isinstance(rel.get("kind"), str):
                rules.append(self._kind_rule(rel["kind"], rel))
        return max(rules, key=lambda r: POLICY_ACTIONS.index(r[1]) if r[1] in POLICY_ACTIONS else 0)

    def _kind_rule(self, kind: str, evidence: Any) -> tuple[str, str]:
        if kind == "replica_divergence":
            metrics = evidence.get("metrics") if isinstance(evidence, dict) else None
            if isinstance(metrics, dict) and metrics and "param_fp" not in metrics and PEER_VOTED & set(metrics):
                kind = "canary_divergence"
        name = f"on_{kind}"
        return name, getattr(self, name, "none")

    def decide(self, incident: Incident) -> Decision | None:
        """The decision an incident asks for, or None."""
        if not self.actions or incident.severity.rank < Severity(self.min_severity).rank:
            return None
        name, action = self.rule(incident)
        if action == "none":
            return None
        ranks: tuple[int, ...] = tuple(int(r) for r in incident.ranks)
        if action == "evict" and len(ranks) != 1:
            log.warning(
                "incident %s: %s = evict, but it names %s rank(s), not one: no decision", incident.id, name, len(ranks)
            )
            return None
        reason = (
            f"{incident.kind} since step {incident.first_step}"
            + (f" on rank {ranks[0]}" if len(ranks) == 1 else "")
            + f" (incident {incident.id})"
        )
        try:
            return Decision(
                run=incident.run,
                action=action,
                reason=reason,
                ranks=ranks if action != "skip" else (),
                hosts=tuple(incident.hosts)[: len(ranks)] if action != "skip" else (),
                since_step=int(incident.first_step),
                incident=incident.id,
                lr_factor=float(self.lr_factor) if action == "rollback" else 1.0,
                issued_at=time.time(),
            )
        except ControlError as exc:  # an incident the wire format cannot carry: say so, act on nothing
            log.warning("incident %s: no decision: %s", incident.id, exc)
            return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ControlPolicy":
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ConfigError(f"guard.{key}", f"unknown setting (known: {', '.join(sorted(known))})")
        return cls(**d)


class ControlTopicSink(TopicWriter):
    """An incident sink that publishes the policy's decisions to the control topic.

    Each (incident, action) is decided once: an incident updated every step does not repeat its
    decision, one that escalates to a kind with another action gets the new one. Never raises.
    """

    DEFAULT_TOPIC = CONTROL_TOPIC
    KAFKA_SETTINGS = {"linger_ms": 0}
    LABEL = "control"

    def __init__(
        self,
        send: Callable[[bytes, bytes], Any],
        flush: Callable[[], bool] = lambda: True,
        close: Callable[[], Any] | None = None,
        *,
        policy: ControlPolicy | None = None,
        remember: int = 10_000,
        keys: Callable[[str], JobKey | None] | None = None,
    ) -> None:
        super().__init__(send, flush, close)
        self.policy = policy or ControlPolicy()
        self.keys = keys
        """The key a run is bound to (``Authenticator.key_of``): its decisions are signed with it."""
        self._seq = 0
        self.decisions: list[Decision] = []
        """Decisions published so far (the newest ``remember``)."""
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._remember = int(remember)

    def _next_seq(self) -> int:
        """An increasing number, across restarts too: microseconds of wall time, or one more than
        the last (a guard acts on each number of its run once and refuses older ones)."""
        self._seq = max(self._seq + 1, time.time_ns() // 1000)
        return self._seq

    @classmethod
    def to_kafka(
        cls,
        bootstrap: str,
        topic: str | None = None,
        *,
        policy: ControlPolicy | None = None,
        keys: Callable[[str], JobKey | None] | None = None,
        **producer_settings: Any,
    ) -> "ControlTopicSink":
        sink = super().to_kafka(bootstrap, topic, **producer_settings)
        sink.policy = policy or ControlPolicy()
        sink.keys = keys
        return sink

    @classmethod
    def to_bus(
        cls,
        bus: Any,
        topic: str | None = None,
        *,
        policy: ControlPolicy | None = None,
        keys: Callable[[str], JobKey | None] | None = None,
    ) -> "ControlTopicSink":
        sink = super().to_bus(bus, topic)
        sink.policy = policy or ControlPolicy()
        sink.keys = keys
        return sink

    @classmethod
    def with_policy(cls, policy: ControlPolicy, to: Callable[[Decision], Any]) -> "ControlTopicSink":
        """A sink that hands decisions to ``to`` in process (the campaign's closed loop, tests)."""
        sink = cls(lambda key, value: None, policy=policy)
        sink._deliver = to  # type: ignore[attr-defined]
        return sink

    def publish(self, event: IncidentEvent) -> None:
        try:
            if event.change == "resolved":
                return
            decision = self.policy.decide(event.incident)
            if decision is None:
                return
            key = (event.incident.id, decision.action)
            if key in self._seen:
                return
            self._seen[key] = None
            while len(self._seen) > self._remember:
                self._seen.popitem(last=False)
            deliver = getattr(self, "_deliver", None)
            if deliver is not None:
                deliver(decision)
            else:
                job_key = self.keys(decision.run) if self.keys is not None else None
                if job_key is None:  # an unsigned decision, as an earlier release reads it
                    self._send(decision.run.encode("utf-8"), decision.encode())
                else:  # numbered and signed: the job's guard takes each number once
                    decision = replace(decision, seq=self._next_seq())
                    self._send(decision.run.encode("utf-8"), decision.sign(job_key))
            self.decisions.append(decision)
            del self.decisions[: -self._remember]
            self.published += 1
            log.warning(
                "control decision for run %s: %s %s (%s)",
                decision.run,
                decision.action,
                list(decision.ranks) or "the run",
                decision.reason,
            )
        except Exception:  # a sink must never stall or break detection
            self.errors += 1
            log.exception("control topic: could not publish a decision for incident %s", event.incident.id)
