"""What a campaign's trials add up to: per fault class and detector, recall, localisation, delay,
attribution and false alarms (:func:`summarise`), and that summary with the targets as a markdown
table (:func:`summary_table`)."""

from __future__ import annotations

from statistics import median
from typing import Any, Sequence

from sdcwatch.testbed.campaign.fault_classes import BENIGN_CLASSES, FLIP_CLASSES

__all__ = ["rate", "summarise", "summary_table"]


def rate(num: int, den: int) -> float | None:
    """``num / den``, None when there is nothing to count (``den`` 0)."""
    return None if den == 0 else num / den


def summarise(trials: Sequence[dict], detectors: Sequence[str]) -> dict[str, Any]:
    """Per fault class (and ``all``) and detector.

    - ``recall``: detected / trials whose impact is not negligible (``recall_all``: over every trial);
    - ``recall_detectable``: of the trials whose change exceeded the checksum bound of the tensor it
      hit (``visibility.detectable``, :func:`~sdcwatch.testbed.campaign.impact.fault_visibility`), detected at the
      fault's step and localised to its rank, whatever the impact;
    - ``at_fault_step``: of those, detected at the fault's first step (delay 0);
    - ``false_alarms_per_1k_clean_steps``: alarms on the clean twins per 1,000 twin steps;
    - ``localisation``: hardware classes with one faulty rank: named exactly that rank within the
      window / impactful trials (``localisation_all``: over every trial of the class);
    - ``median_delay``: steps from the fault's first step to the first detection (detected impactful);
    - ``attribution``: detected impactful trials whose attribution is the class's (``sdc`` for hardware,
      ``optimisation_data`` for benign) / detected impactful trials;
    - ``blamed_rank``: benign classes: detected trials that blamed a rank (attribution ``sdc``).
    """
    groups: dict[str, list[dict]] = {}
    for t in trials:
        groups.setdefault(t["class"], []).append(t)
    for t in trials:  # flips by what they did to the value: masked shrinking flips are the hard half
        direction = (t.get("visibility") or {}).get("direction")
        if t["class"] in FLIP_CLASSES and direction:
            groups.setdefault(f"flips_{direction}", []).append(t)
    groups["all"] = list(trials)
    out: dict[str, Any] = {}
    for cls, ts in groups.items():
        row: dict[str, Any] = {}
        impactful = [t for t in ts if t["impact"]["class"] != "negligible"]
        detectable = [t for t in ts if (t.get("visibility") or {}).get("detectable")]
        with_rank = [t for t in ts if t["culprit_rank"] is not None]
        with_rank_imp = [t for t in with_rank if t["impact"]["class"] != "negligible"]
        for d in detectors:
            v = lambda t: t["detectors"][d]  # noqa: E731
            det_imp = [t for t in impactful if v(t)["detected"]]
            delays = [v(t)["delay"] for t in det_imp]
            expected = lambda t: "optimisation_data" if t["class"] in BENIGN_CLASSES else "sdc"  # noqa: E731
            benign_det = [t for t in ts if t["class"] in BENIGN_CLASSES and v(t)["detected"]]
            clean_steps = sum(t["clean_steps"] for t in ts)
            row[d] = {
                "trials": len(ts),
                "impactful": len(impactful),
                "recall": rate(len(det_imp), len(impactful)),
                "recall_all": rate(sum(v(t)["detected"] for t in ts), len(ts)),
                "detectable": len(detectable),
                "recall_detectable": rate(
                    sum(
                        v(t)["detected"] and v(t)["delay"] == 0 and v(t)["localized_rank"] == t["culprit_rank"]
                        for t in detectable
                    ),
                    len(detectable),
                ),
                "at_fault_step": rate(sum(1 for x in delays if x == 0), len(impactful)),
                "false_alarms": sum(v(t)["false_alarms"] for t in ts),
                "clean_steps": clean_steps,
                "false_alarms_per_1k_clean_steps": rate(1000 * sum(v(t)["false_alarms"] for t in ts), clean_steps),
                "localisation": rate(
                    sum(v(t)["localized_rank"] == t["culprit_rank"] for t in with_rank_imp), len(with_rank_imp)
                ),
                "localisation_all": rate(
                    sum(v(t)["localized_rank"] == t["culprit_rank"] for t in with_rank), len(with_rank)
                ),
                "median_delay": median(delays) if delays else None,
                "attribution": rate(sum(v(t)["attribution"] == expected(t) for t in det_imp), len(det_imp)),
                "blamed_rank": rate(sum(v(t)["attribution"] == "sdc" for t in benign_det), len(benign_det)),
            }
        out[cls] = row
    return out


def summary_table(result: dict[str, Any]) -> str:
    """The summary as a markdown table (one row per fault class and detector)."""

    def f(x: Any, pct: bool = True) -> str:
        if x is None:
            return "–"
        return f"{100 * x:.0f}%" if pct else (f"{x:.1f}" if isinstance(x, float) else str(x))

    lines = [
        "| class | detector | trials (impactful, detectable) | recall | recall, detectable at step | at fault step "
        "| false alarms /1k clean steps | localisation | median delay | attribution | blamed a rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cls, row in result["summary"].items():
        for d, s in row.items():
            lines.append(
                f"| {cls} | {d} | {s['trials']} ({s['impactful']}, {s.get('detectable', 0)}) | {f(s['recall'])} | "
                f"{f(s.get('recall_detectable'))} | {f(s['at_fault_step'])} | "
                f"{f(s['false_alarms_per_1k_clean_steps'], False)} | {f(s['localisation'])} | "
                f"{f(s['median_delay'], False)} | {f(s['attribution'])} | {f(s['blamed_rank'])} |"
            )
    targets = result.get("targets") or []
    if targets:
        lines += ["", "| target (sdcwatch) | measured | met |", "|---|---|---|"]
        for t in targets:
            met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {t['count'] or t['value']} | {met} |")
    return "\n".join(lines)
