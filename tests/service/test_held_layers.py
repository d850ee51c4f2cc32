"""A layer metric the probes measure on sampled steps only (the attention statistics, every 16th
step by default) stays on the exporter's view between its steps: a scrape at any step shows its
last measurement, in one process and in a split service; for HOLD_STEPS steps at most."""

from __future__ import annotations

import numpy as np
from detector_synth import SyntheticRun
from sdcwatch.service.run_state import HOLD_STEPS, HeldLayers
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.summary import decode_summary, encode_summary

SAMPLED = "q_norm_mean"
EVERY = 16


def records(synth: SyntheticRun, s: int, every: int = EVERY) -> list:
    """The synthetic run's records of step ``s``, the sampled metric only on every ``every``-th step."""
    recs = synth.records(s)
    if s % every == 0:
        return recs
    return [
        type(r)(
            **{**{k: getattr(r, k) for k in r.__slots__}, "layers": {k: v for k, v in r.layers.items() if k != SAMPLED}}
        )
        for r in recs
    ]


def measured_at(step: int, world: int = 4) -> np.ndarray:
    """The sampled metric's statistics as a view built at its own step shows them."""
    pipe, synth = DetectionPipeline(), SyntheticRun(world=world)
    for s in range(step + 1):
        pipe.process(records(synth, s))
    (run,) = pipe.view().runs
    assert run.last_step == step
    return run.layer_stats[SAMPLED]


def test_a_scrape_between_sampled_steps_shows_the_last_measurement():
    pipe, synth = DetectionPipeline(), SyntheticRun(world=4)
    scraped = {}
    for s in range(40):
        pipe.process(records(synth, s))
        if s in (5, 21, 37):  # no scrape ever lands on a sampled step
            (run,) = pipe.view().runs
            assert run.last_step == s
            scraped[s] = run.layer_stats.get(SAMPLED)
    for s, at in ((5, 0), (21, 16), (37, 32)):
        assert scraped[s] is not None, s
        np.testing.assert_array_equal(scraped[s], measured_at(at))
    assert not np.array_equal(scraped[21], scraped[5])  # each scrape shows the latest measurement


def test_a_metric_not_measured_for_hold_steps_leaves_the_view():
    pipe, synth = DetectionPipeline(), SyntheticRun(world=4)
    for s in range(HOLD_STEPS + 3):
        pipe.process(records(synth, s, every=1 << 20))  # measured at step 0 only
    (run,) = pipe.view().runs
    assert SAMPLED not in run.layer_stats
    assert "q_norm_max" in run.layer_stats  # the every-step metrics are this step's


def test_a_split_service_shows_the_last_measurement_between_summaries():
    spatial, temporal = DetectionPipeline(stage="spatial"), DetectionPipeline(stage="temporal")
    synth = SyntheticRun(world=4)
    for s in range(40):
        spatial.process(records(synth, s))
        temporal.process_summaries([decode_summary(encode_summary(x)) for x in spatial.outbox])
        spatial.outbox.clear()
    temporal.flush()
    (run,) = temporal.view().runs
    assert run.last_step == 39  # statistics travel on every 10th summary: step 30's lack it
    np.testing.assert_array_equal(run.layer_stats[SAMPLED], measured_at(32))


def test_only_the_steps_that_carry_a_sampled_or_new_metric_are_measured():
    held = HeldLayers()
    every_step, sampled = {"gemm_out", "stream_max"}, {"attn_entropy"}
    taken = [held.measures_sampled(every_step | (sampled if s % 4 == 0 else set())) for s in range(12)]
    assert taken == [True, False, False, False, True, False, False, False, True, False, False, False]
