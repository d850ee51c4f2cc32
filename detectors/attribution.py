"""Attribution: joins the findings of a window into what a person decides on. A spike with
rank-local evidence is *SDC suspected on rank r*; with ranks consistent, *optimisation/data
instability*; with too few ranks to vote that plainly disagreed, *the ranks disagree*; rank-local
evidence without a spike is *silent drift*. The rules: docs/detectors.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.kinds import SPIKE_KINDS, IncidentKind
from sdcwatch.core.mesh import format_coords
from sdcwatch.core.model_place import index_text, noun_of, where
from sdcwatch.core.validate import check_positive
from sdcwatch.core.vocabulary import DATA_METRICS
from sdcwatch.detectors.rank_outlier import disagreement_text

__all__ = ["Attribution", "hardware_like"]


def hardware_like(f: Finding) -> bool:
    """A single-step rank deviation that a bad batch would not explain: not in a data metric, and far
    beyond the rank's own loss deviation (the host ledger weighs the same ones)."""
    loss_z = f.evidence.get("loss_z")
    return f.metric not in DATA_METRICS and (loss_z is None or abs(loss_z) * 4 < abs(f.evidence.get("z", f.score)))


class Attribution:
    """Joins spikes and rank-local evidence within ``window`` steps (one instance per run)."""

    def __init__(self, window: int = 50) -> None:
        check_positive("attribution", window=window)
        self.window = int(window)
        self._spikes: deque[tuple[int, str]] = deque()  # (step, kind) of spike findings
        self._local: deque[tuple[int, dict[str, Any]]] = deque()  # (step, rank evidence) hardware-like
        self._disagree: deque[tuple[int, dict[str, Any]]] = deque()  # (step, evidence) too few ranks to vote

    def _trim(self, step: int) -> None:
        for kept in (self._spikes, self._local, self._disagree):
            while kept and kept[0][0] < step - self.window:
                kept.popleft()

    def _consequence(self, f: Finding, step: int) -> bool:
        """Rank evidence that first shows after a spike's onset: a consequence (a run-wide spike
        throws some rank furthest), unless that rank had hardware-like evidence by the onset."""
        onsets = [s for s, _ in self._spikes if s < step]
        if not onsets or not f.ranks:
            return False
        first = min(onsets)
        return not any(ev["rank"] == f.ranks[0] and s <= first for s, ev in self._local)

    def apply(self, step: int, world: int, findings: list[Finding], ranks_known: bool = True) -> list[Finding]:
        """The attributed findings of one step (call once per step, in step order); ``ranks_known``
        is False for a single series no rank sent (a CSV log)."""
        self._trim(step)
        findings = [
            f for f in findings if f.kind not in ("rank_deviation", "rank_outlier") or not self._consequence(f, step)
        ]
        data_ranks: list[Finding] = []
        for f in findings:
            if f.kind == "rank_outlier" or (f.kind == "rank_deviation" and hardware_like(f)):
                self._local.append((step, _local(f)))
            elif f.kind == "rank_deviation":
                data_ranks.append(f)
            elif f.kind == IncidentKind.RANKS_DISAGREE:
                self._disagree.append((step, dict(f.evidence)))
        self._spikes.extend(
            (step, f.kind) for f in findings if f.kind in SPIKE_KINDS and f.evidence.get("phase") == "onset"
        )
        out: list[Finding] = []
        for f in findings:
            if f.kind in ("rank_deviation", IncidentKind.RANKS_DISAGREE):
                continue
            if f.kind in SPIKE_KINDS:
                out.extend(self._spike(f, world, data_ranks, ranks_known))
            elif f.kind == "rank_outlier":
                out.append(self._rank_local(f))
            else:
                out.append(f)
        return out

    def _spike(self, f: Finding, world: int, data_ranks: list[Finding], ranks_known: bool) -> list[Finding]:
        label = f.message
        if self._local:
            _, ev = max(self._local, key=lambda item: item[1]["score"])
            where = _where(ev)
            attributed = replace(
                f,
                message=f"{label}: SDC suspected on {where}",
                evidence={**f.evidence, "attribution": "sdc", "suspect": ev},
            )
            if f.evidence.get("phase") != "onset":
                return [attributed]
            said = (
                f"SDC suspected on {where}: {f.kind.replace('_', ' ')} at step {f.evidence['onset_step']} "
                f"with rank-local evidence ({ev['message']})"
            )
            sdc = Finding.at(
                f,
                "attribution",
                IncidentKind.SDC_SUSPECTED,
                Severity.CRITICAL,
                float(ev["score"]),
                said,
                ranks=(ev["rank"],),
                hosts=(ev["host"],) if ev["host"] else (),
                metric=ev["metric"],
                layer=ev["layer"],
                layer_name=ev.get("layer_name"),
                evidence={"spike": f.evidence, "rank_evidence": ev},
            )
            return [attributed, sdc]
        disagree = self._disagreement(f)
        if world < 2 and not ranks_known:
            why = "single series (ranks unknown): optimisation/data instability or an unlocalised fault"
        elif world < 2:
            why = "one rank, nothing to compare it with: optimisation/data instability or a fault on that rank"
        elif f.metric == "loss_max":
            r = f.evidence.get("max_rank")
            why = f"only rank {r}'s own loss (a bad batch?), other ranks consistent: data, not hardware"
        elif disagree is not None:
            return [_disagreeing(f, label, disagree)]
        elif data_ranks:
            r = data_ranks[0].ranks[0]
            why = f"ranks consistent except rank {r}'s own loss (a bad batch?): optimisation/data instability"
        else:
            why = "ranks consistent, optimisation/data instability"
        return [replace(f, message=f"{label}: {why}", evidence={**f.evidence, "attribution": "optimisation_data"})]

    def _disagreement(self, f: Finding) -> dict[str, Any] | None:
        """The strongest disagreement of too few ranks to vote at or before the spike's onset (one
        that first shows after it is a consequence, as for rank evidence), or None."""
        onset = f.evidence.get("onset_step", f.step)
        seen = [ev for s, ev in self._disagree if s <= onset]
        return max(seen, key=lambda ev: ev["features"][0]["typical_gaps"]) if seen else None

    def _rank_local(self, f: Finding) -> Finding:
        ev = _local(f)
        where = _where(ev)
        if self._spikes:
            step, kind = self._spikes[-1]
            return replace(
                f,
                kind="sdc_suspected",
                severity=Severity.CRITICAL,
                message=f"SDC suspected on {where}: persistent deviation and a "
                f"{kind.replace('_', ' ')} at step {step} ({f.message})",
                around=None,  # composed from the finding's message, already named
                evidence={**f.evidence, "spike_step": step, "attribution": "sdc"},
            )
        return replace(
            f,
            kind="silent_drift",
            message=f"silent drift suspected on {where}: {f.message}",
            around=None,
            evidence={**f.evidence, "attribution": "silent_drift"},
        )

    def snapshot(self) -> dict[str, Any]:
        state = {"spikes": [list(s) for s in self._spikes], "local": [[s, e] for s, e in self._local]}
        if self._disagree:
            state["disagree"] = [[s, e] for s, e in self._disagree]
        return state

    def restore(self, state: dict[str, Any]) -> None:
        self._spikes = deque((int(s), k) for s, k in state["spikes"])
        self._local = deque((int(s), dict(e)) for s, e in state["local"])
        self._disagree = deque((int(s), dict(e)) for s, e in state.get("disagree", ()))


def _disagreeing(f: Finding, label: str, ev: dict[str, Any]) -> Finding:
    """The spike said with what too few ranks to vote are known to show: that they disagree. Their
    own losses disagreeing is a bad batch on one of them; anything else a rank-local fault."""
    n = int(ev["world"])
    which = "two ranks cannot say which" if n == 2 else f"{n} ranks are too few to say which"
    at = "" if ev["step"] == f.step else f" at step {ev['step']}"
    said = f"the {n} ranks disagree ({disagreement_text(ev['features'])}{at})"
    if any(x["metric"] == "loss" for x in ev["features"]):
        why, attribution = f"{said}: one rank's own loss is off (a bad batch?), but {which}", "optimisation_data"
    else:
        why, attribution = f"{said}: a rank-local fault is likely but {which}", "ranks_disagree"
    evidence = {**f.evidence, "attribution": attribution, "disagreement": ev}
    return replace(f, message=f"{label}: {why}", evidence=evidence)


def _local(f: Finding) -> dict[str, Any]:
    where = {"coords": dict(f.coords[0])} if f.coords else {}  # only when the records carry them
    return {
        **where,
        "rank": f.ranks[0],
        "host": f.hosts[0] if f.hosts else "",
        "metric": f.metric,
        "layer": f.layer,
        **({"layer_name": f.layer_name} if f.layer_name else {}),
        "score": float(f.score),
        "kind": f.kind,
        "step": f.step,
        "message": f.message,
    }


def _where(ev: dict[str, Any]) -> str:
    s = f"rank {ev['rank']}"
    if ev["host"]:
        s += f" (host {ev['host']})"
    if ev.get("coords"):
        s += f" at {format_coords(ev['coords'])}"
    name, metric = ev.get("layer_name"), ev["metric"]
    if ev["layer"] is not None and metric.startswith(("attn", "q_", "k_")):
        s += f", {index_text(ev['layer'], name, noun_of(metric))} attention ({metric})"
    else:  # a product, a block, a scalar: said as every message says it
        s += f", {where(metric, ev['layer'], name)}"
    return s
