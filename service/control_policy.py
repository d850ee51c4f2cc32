"""Closing the loop: which decision (``skip``, ``rollback``, ``evict`` or none) for the training job's guard
an incident asks for; the control topic's sink publishes it and the guard on rank 0 of the run reads it. The
default takes no action: sdcwatch detects and reports until the user sets ``[guard] actions = true``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from typing import Any

from sdcwatch.core.control import Decision
from sdcwatch.core.errors import ControlError
from sdcwatch.core.incident import Incident, Severity
from sdcwatch.core.validate import check_choice, check_number, settings_from
from sdcwatch.detectors.replica import PEER_VOTED

__all__ = ["ControlPolicy", "POLICY_ACTIONS"]

log = logging.getLogger("sdcwatch.service.control_policy")

#: What a policy rule may say.
POLICY_ACTIONS = ("none", "skip", "rollback", "evict")


@dataclass
class ControlPolicy:
    """Which decision each incident kind asks for, one of :data:`POLICY_ACTIONS`: "skip" (the update of
    the next step), "rollback" (to the guard's last snapshot before the incident began; replicas resynchronised
    from a healthy one), "evict" (the rank it names; the job exits with code 16 naming the host). A replica
    divergence is split by its evidence: parameter fingerprints (``on_replica_divergence``) or only a canary,
    ``canary_fp`` or ``gemm_canary_fp`` (``on_canary_divergence``). ``sdcwatch serve``'s ``[guard]`` table."""

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
        for f in fields(ControlPolicy):
            if f.name.startswith("on_"):
                check_choice(f"guard.{f.name}", getattr(self, f.name), POLICY_ACTIONS)
        check_choice("guard.min_severity", self.min_severity, ("warning", "critical"))
        check_number("guard.lr_factor", self.lr_factor, 0, 1, lo_open=True)

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
        """The policy of a table of settings; an unknown key is refused, naming the known ones."""
        return settings_from(cls, "guard", d)
