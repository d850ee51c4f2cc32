"""The campaign's detectors on a branch's frames: sdcwatch's default pipeline and the baselines run
as alarm sources (:func:`make_detectors`), and one detector's verdict on one trial
(:func:`score_trial`), its faulted run's alarms against its clean twin's."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.kinds import RANK_BLAME_KINDS
from sdcwatch.testbed.campaign.trials import Trial

__all__ = ["Alarm", "SdcwatchRunner", "BaselineRunner", "make_detectors", "alarms_of", "score_trial"]

_TIMING_KINDS = frozenset({"straggler", "missing_rank"})


@dataclass
class Alarm:
    """One alarm of one detector: what an operator would have been told, and when.

    For sdcwatch, an incident opened (or escalated) by the default detection pipeline with severity
    warning or critical, timing incidents (straggler, missing rank) left out: the virtual ranks of
    one process have no meaningful step times. For a baseline, any finding.
    """

    step: int
    kind: str
    ranks: tuple[int, ...]
    attribution: str | None
    message: str


class SdcwatchRunner:
    """sdcwatch's default pipeline on frames: incidents opened or escalated are the alarms."""

    name = "sdcwatch"

    def __init__(self) -> None:
        from sdcwatch.service.pipeline import DetectionPipeline

        self.pipeline = DetectionPipeline()

    def fork(self) -> "SdcwatchRunner":
        from sdcwatch.service.pipeline import DetectionPipeline

        other = object.__new__(SdcwatchRunner)
        other.pipeline = DetectionPipeline(self.pipeline.settings)
        other.pipeline.restore(copy.deepcopy(self.pipeline.snapshot()))
        return other

    def feed(self, frame: Any) -> list[Alarm]:
        out = []
        for ev in self.pipeline.process_frame(frame):
            inc = ev.incident
            if ev.change == "resolved" or inc.kind in _TIMING_KINDS or inc.severity.value == "info":
                continue
            step = inc.first_step if ev.change == "opened" else inc.last_step
            out.append(
                Alarm(
                    step,
                    inc.kind,
                    tuple(inc.ranks),
                    _attribution(inc.kind, inc.ranks, inc.evidence, frame.world),
                    inc.message,
                )
            )
        return out


class BaselineRunner:
    """A baseline detector on frames: every finding is an alarm."""

    def __init__(self, name: str, detector: Any) -> None:
        self.name, self.detector = name, detector

    def fork(self) -> "BaselineRunner":
        return BaselineRunner(self.name, copy.deepcopy(self.detector))

    def feed(self, frame: Any) -> list[Alarm]:
        return [
            Alarm(f.step, f.kind, tuple(f.ranks), _attribution(f.kind, f.ranks, f.evidence, frame.world), f.message)
            for f in self.detector.update(frame)
            if f.severity.value != "info"
        ]


def _attribution(kind: str, ranks: Sequence[int], evidence: dict, world: int) -> str | None:
    said = evidence.get("attribution") if isinstance(evidence, dict) else None
    if said == "sdc" or kind in RANK_BLAME_KINDS:
        return "sdc"
    if said == "optimisation_data":
        return "optimisation_data"
    if 0 < len(ranks) < world:  # a rule that fires on some ranks only blames them
        return "sdc"
    return None


def make_detectors(names: Iterable[str] | None = None) -> list[Any]:
    """sdcwatch plus the baselines (all, or those named)."""
    from sdcwatch.testbed.campaign.baselines import baseline_classes

    baselines = baseline_classes()
    wanted = list(names) if names is not None else ["sdcwatch", *baselines]
    out = []
    for n in wanted:
        if n == "sdcwatch":
            out.append(SdcwatchRunner())
        elif n in baselines:
            out.append(BaselineRunner(n, baselines[n]()))
        else:
            raise ConfigError("campaign.detectors", f"unknown detector {n!r} (known: sdcwatch, {', '.join(baselines)})")
    return out


def alarms_of(runner: Any, frames: Sequence[Any]) -> list[Alarm]:
    """Every alarm ``runner`` raises on ``frames``, fed in order (the runner keeps what it learnt)."""
    return [a for frame in frames for a in runner.feed(frame)]


def score_trial(
    trial: Trial, fault_step: int, faulted: list[Alarm], twin: list[Alarm], window: int, world: int
) -> dict[str, Any]:
    """One detector's verdict on one trial.

    A faulted-run alarm counts as a detection when it comes at or after the fault's first step and
    the clean twin does not raise the same alarm (same kind, same step). ``detected``,
    ``first_detection_step``, ``delay`` (steps after the fault's first step), ``localized_rank``
    (the rank named by the earliest alarm that names exactly one rank, within ``window`` steps of
    the fault), ``attribution`` (``sdc`` when an alarm blames a rank, ``optimisation_data`` when one
    says the ranks are consistent, else ``None``) and ``false_alarms`` (alarms on the clean twin).
    The summary per fault class and detector is defined in
    :func:`~sdcwatch.testbed.campaign.summary.summarise` and in ``bench/README.md``.
    """
    twin_keys = {(a.kind, a.step) for a in twin}
    hits = sorted(
        (a for a in faulted if a.step >= fault_step and (a.kind, a.step) not in twin_keys), key=lambda a: a.step
    )
    first = hits[0] if hits else None
    named = next((a.ranks[0] for a in hits if len(a.ranks) == 1 and a.step < fault_step + window), None)
    attributions = {a.attribution for a in hits}
    attribution = (
        "sdc" if "sdc" in attributions else ("optimisation_data" if "optimisation_data" in attributions else None)
    )
    return {
        "detected": first is not None,
        "first_detection_step": first.step if first else None,
        "delay": first.step - fault_step if first else None,
        "localized_rank": named,
        "attribution": attribution,
        "named_ranks": list(first.ranks) if first else [],
        "alarm_kinds": sorted({a.kind for a in hits}),
        "message": first.message if first else None,
        "false_alarms": len(twin),
        "false_alarm_kinds": sorted({a.kind for a in twin}),
    }
