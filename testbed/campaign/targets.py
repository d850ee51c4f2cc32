"""The issue's detection targets, checked on a campaign's trials and summary for one detector
(:func:`check_targets`): each target with the measured value, the goal and whether it was met."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from sdcwatch.testbed.campaign.summary import rate
from sdcwatch.testbed.campaign.fault_classes import BENIGN_CLASSES, FLIP_CLASSES, HARDWARE_CLASSES

__all__ = ["check_targets"]


def check_targets(trials: Sequence[dict], summary: dict[str, Any], detector: str = "sdcwatch") -> list[dict[str, Any]]:
    """The issue's targets for ``detector``: each with the measured value, the goal and whether it was met."""
    return [
        _nonfinite_localised(trials, detector),
        _impactful_flips_detected(trials, detector),
        _detectable_flips_localised(trials, detector),
        _impactful_hardware_detected(trials, detector),
        _unhealthy_node_localised(trials, detector),
        _benign_spikes_not_blamed(trials, detector),
        _no_false_alarms(trials, detector),
        _better_than_every_baseline(summary, detector),
    ]


def _target(name: str, num: int, den: int, goal: float) -> dict[str, Any]:
    """A target met when ``num / den`` reaches ``goal`` (undecided when ``den`` is 0)."""
    value = rate(num, den)
    return {
        "target": name,
        "value": value,
        "count": f"{num}/{den}",
        "goal": goal,
        "met": None if value is None else value >= goal,
    }


def _of(trials: Sequence[dict], classes: Iterable[str]) -> list[dict]:
    classes = set(classes)
    return [t for t in trials if t["class"] in classes]


def _at_step_and_localised(trial: dict, detector: str) -> bool:
    verdict = trial["detectors"][detector]
    return verdict["delay"] == 0 and verdict["localized_rank"] == trial["culprit_rank"]


def _impactful(trials: Sequence[dict]) -> list[dict]:
    return [t for t in trials if t["impact"]["class"] != "negligible"]


def _nonfinite_localised(trials: Sequence[dict], detector: str) -> dict[str, Any]:
    nf = _of(trials, (c for c in HARDWARE_CLASSES if c.startswith(("nan_", "inf_", "near_inf_", "nonfinite_"))))
    return _target(
        "non-finite and near-INF (residual stream included) detected at their step and localised",
        sum(1 for t in nf if _at_step_and_localised(t, detector)),
        len(nf),
        1.0,
    )


def _impactful_flips_detected(trials: Sequence[dict], detector: str) -> dict[str, Any]:
    bf = _impactful(_of(trials, FLIP_CLASSES))
    return _target(
        "bit flips with a non-negligible impact detected",
        sum(t["detectors"][detector]["detected"] for t in bf),
        len(bf),
        0.99,
    )


def _detectable_flips_localised(trials: Sequence[dict], detector: str) -> dict[str, Any]:
    dt = [t for t in _of(trials, FLIP_CLASSES) if (t.get("visibility") or {}).get("detectable")]
    return _target(
        "detectable flips (above the checksum bound) detected at their step and localised",
        sum(1 for t in dt if _at_step_and_localised(t, detector)),
        len(dt),
        0.99,
    )


def _impactful_hardware_detected(trials: Sequence[dict], detector: str) -> dict[str, Any]:
    imp = [t for t in _impactful(trials) if t["class"] in HARDWARE_CLASSES]
    return _target(
        "impactful hardware faults detected (every class)",
        sum(t["detectors"][detector]["detected"] for t in imp),
        len(imp),
        0.99,
    )


def _unhealthy_node_localised(trials: Sequence[dict], detector: str) -> dict[str, Any]:
    un = _of(trials, ("unhealthy_node",))
    return _target(
        "unhealthy node localised within the window",
        sum(t["detectors"][detector]["localized_rank"] == t["culprit_rank"] for t in un),
        len(un),
        0.90,
    )


def _benign_spikes_not_blamed(trials: Sequence[dict], detector: str) -> dict[str, Any]:
    bn = [t for t in _of(trials, BENIGN_CLASSES) if t["impact"]["class"] in ("spike", "nonfinite")]
    return _target(
        "benign spikes detected and not blamed on a rank",
        sum(1 for t in bn if t["detectors"][detector]["detected"] and t["detectors"][detector]["attribution"] != "sdc"),
        len(bn),
        0.95,
    )


def _no_false_alarms(trials: Sequence[dict], detector: str) -> dict[str, Any]:
    clean = sum(t["clean_steps"] for t in trials)
    alarms = sum(t["detectors"][detector]["false_alarms"] for t in trials)
    return {
        "target": "zero false alarms over >= 10,000 clean steps",
        "value": alarms,
        "count": f"{alarms} in {clean}",
        "goal": 0,
        "met": alarms == 0 and clean >= 10_000,
    }


def _better_than_every_baseline(summary: dict[str, Any], detector: str) -> dict[str, Any]:
    """Every class where a baseline's recall, localisation or attribution beats ``detector``'s, or
    where it raised fewer false alarms: the target is met when there is none."""
    worse = []
    for cls, row in summary.items():
        if cls == "all" or detector not in row:
            continue
        me = row[detector]
        for other, s in row.items():
            if other == detector:
                continue
            for key in ("recall", "localisation", "attribution"):
                if s[key] is not None and (me[key] is None or s[key] > me[key]):
                    worse.append(
                        f"{cls}: {other} {key} {s[key]:.0%} > {me[key] if me[key] is None else format(me[key], '.0%')}"
                    )
            if s["false_alarms"] < me["false_alarms"]:
                worse.append(f"{cls}: {other} fewer false alarms ({s['false_alarms']} < {me['false_alarms']})")
    return {
        "target": "better than every baseline on every class",
        "value": len(worse),
        "count": "; ".join(worse),
        "goal": 0,
        "met": not worse,
    }
