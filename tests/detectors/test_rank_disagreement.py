"""Too few ranks to vote: a spike whose two (or three) ranks plainly disagree says so, never
"ranks consistent", and blames no rank; ranks that move together stay consistent."""

from __future__ import annotations

import math

import numpy as np
import pytest
from detector_synth import SCALARS as STEP_SCALARS
from detector_synth import SyntheticRun
from sdcwatch.detectors.rank_outlier import RankOutlierDetector
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.summary import decode_summary, encode_summary

GRAD, LOCAL, GLOBAL, COSINE = (
    70,
    *(STEP_SCALARS.index(n) for n in ("grad_norm_local", "grad_norm_global", "grad_cosine")),
)
LOSS = STEP_SCALARS.index("loss")


class GradientFault(SyntheticRun):
    """Rank 1's gradient x1000 at step 70 (its local norm and cosine far from rank 0's), the update
    it poisons raising every rank's loss at step 71; or, with ``kind``, a bad batch on rank 1 or a
    job-wide blow-up (every rank alike)."""

    kind = "gradient"

    def frame(self, step):
        f = super().frame(step)
        S = f.scalars
        if self.kind == "gradient" and step == GRAD:
            S[1, LOCAL] *= 1000.0
            S[:, GLOBAL] = math.sqrt(float((S[:, LOCAL] ** 2).sum())) / self.world
            S[:, COSINE] = [0.019, 1.0, 0.03][: self.world]
        elif self.kind == "gradient" and step == GRAD + 1:
            S[:, LOSS] *= 2.5
        elif self.kind == "bad_batch" and step == GRAD:
            S[1, LOSS] *= 3.0
            S[1, LOCAL] *= 6.0
        elif self.kind == "job_wide" and step in (GRAD, GRAD + 1):
            S[:, LOSS] *= 2.2 * (1 + 0.05 * np.arange(self.world))  # every rank's loss up, alike
            S[:, LOCAL : GLOBAL + 1] *= 20.0
        return f


def run(kind="gradient", world=2, steps=120):
    synth = GradientFault(world=world, seed=1)
    synth.kind = kind
    pipe = DetectionPipeline()
    for s in range(steps):
        pipe.process(synth.records(s))
    pipe.flush()
    return sorted(pipe.incidents(), key=lambda i: i.first_step)


def test_a_gradient_fault_on_one_of_two_ranks_says_the_ranks_disagree_not_consistent():
    grad, loss = run()
    assert (grad.kind, grad.first_step, loss.kind, loss.first_step) == ("grad_spike", GRAD, "loss_spike", GRAD + 1)
    for inc in (grad, loss):
        assert "consistent" not in inc.message, inc.message
        assert "the 2 ranks disagree (grad_norm_local 1.06 vs 1.03e+03; grad_cosine 0.019 vs 1" in inc.message
        assert inc.message.endswith("a rank-local fault is likely but two ranks cannot say which")
        assert inc.ranks == () and inc.evidence["attribution"] == "ranks_disagree"
        said = inc.evidence["disagreement"]
        assert (said["world"], said["step"]) == (2, GRAD)
        first = said["features"][0]
        assert first["metric"] == "grad_norm_local" and first["layer"] is None
        assert first["values"][1] / first["values"][0] > 500  # rank 1 x1000, with its own noise
    assert "at step 70)" in loss.message  # the loss spike says when the ranks disagreed


def test_three_ranks_too_few_to_vote_say_so():
    grad, _ = run(world=3)
    assert "the 3 ranks disagree (grad_norm_local" in grad.message
    assert grad.message.endswith("a rank-local fault is likely but 3 ranks are too few to say which")


def test_a_bad_batch_on_one_of_two_ranks_is_their_own_losses_disagreeing():
    (spike,) = run("bad_batch")
    assert spike.first_step == GRAD and "consistent" not in spike.message
    assert "loss" in [f["metric"] for f in spike.evidence["disagreement"]["features"]]
    assert "one rank's own loss is off (a bad batch?), but two ranks cannot say which" in spike.message
    assert spike.evidence["attribution"] == "optimisation_data" and spike.ranks == ()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_move_together_stay_consistent_and_a_clean_run_raises_nothing(world):
    spikes = run("job_wide", world=world)
    assert spikes and all(i.message.endswith("ranks consistent, optimisation/data instability") for i in spikes)
    assert run("clean", world=world, steps=400) == []


def test_the_split_stages_and_a_restart_say_what_one_process_says():
    """The few ranks' values travel in the step summary (spatial -> bytes -> temporal); the typical
    gaps are in the detector's saved state."""
    synth = GradientFault(world=2, seed=1)
    spatial, temporal = DetectionPipeline(stage="spatial"), DetectionPipeline(stage="temporal")
    for s in range(120):
        spatial.process(synth.records(s))
        temporal.process_summaries([decode_summary(encode_summary(x)) for x in spatial.take_summaries()])
        if s == 60:  # restart the temporal stage from its state
            state = temporal.snapshot()
            temporal = DetectionPipeline(stage="temporal")
            temporal.restore(state)
    spatial.flush()
    temporal.process_summaries([decode_summary(encode_summary(x)) for x in spatial.take_summaries()])
    temporal.flush()
    split = sorted((i.kind, i.first_step, i.message) for i in temporal.incidents())
    assert split == sorted((i.kind, i.first_step, i.message) for i in run())


def test_the_disagreement_is_an_info_finding_naming_no_rank():
    synth = GradientFault(world=2, seed=1)
    det = RankOutlierDetector()
    found = [f for s in range(GRAD + 1) for f in det.update(synth.frame(s))]
    (f,) = found
    assert (f.kind, f.severity.value, f.step, f.ranks, f.metric) == (
        "ranks_disagree",
        "info",
        GRAD,
        (),
        "grad_norm_local",
    )
    assert f.message.startswith("the 2 ranks disagree at step 70: grad_norm_local 1.06 vs 1.03e+03")
