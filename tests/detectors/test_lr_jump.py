"""Learning-rate jumps: a one-step x10 learning rate is a warning that blames no rank; warm-up
ramps, cosine decay and learning-rate cuts are not."""

from __future__ import annotations

import math

from sdcwatch.core.record_type import Record
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.lr_jump import LearningRateJump
from sdcwatch.service.pipeline import DetectionPipeline


def schedule(step: int, peak: float = 3e-3, warmup: int = 100, total: int = 2000) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def records(step: int, lr: float, world: int = 4) -> list[Record]:
    return [Record("run", step, r, world, f"h{r}", 0.0, r, {"loss": 2.0, "lr": lr}) for r in range(world)]


def test_warmup_cosine_and_cuts_raise_nothing():
    det = LearningRateJump()
    pipe = DetectionPipeline()
    events = []
    for s in range(2000):
        lr = schedule(s) * (0.1 if s >= 1500 else 1.0)  # a x0.1 cut is a decision, not an accident
        events += pipe.process(records(s, lr))
        assert det.update(StepFrame.from_records("run", s, 4, records(s, lr))) == []
    assert [e for e in events + pipe.flush() if e.incident.kind == "lr_jump"] == []


def test_a_one_step_x10_learning_rate_is_a_warning_on_no_rank():
    pipe = DetectionPipeline()
    events = []
    for s in range(300):
        lr = schedule(s) * (10.0 if s == 250 else 1.0)
        events += pipe.process(records(s, lr))
    events += pipe.flush()
    opened = [e.incident for e in events if e.change == "opened"]
    assert [(i.kind, i.first_step, i.ranks, i.severity.value) for i in opened] == [("lr_jump", 250, (), "warning")]
    assert "x9.98" in opened[0].message and "no rank blamed" in opened[0].message
