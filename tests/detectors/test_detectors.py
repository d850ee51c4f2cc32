"""Each detector on synthetic series whose answer is known."""

from __future__ import annotations

import math

import numpy as np
import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.errors import ConfigError
from sdcwatch.detectors import (
    MissingRankDetector,
    NonFiniteDetector,
    RankOutlierDetector,
    ReplicaDivergenceDetector,
    SeriesSettings,
    Severity,
    SpikeDetector,
    StepFrame,
    StragglerDetector,
)
from sdcwatch.detectors.replica import majority
from sdcwatch.core.spike_baseline import RobustBaseline


def feed(det, synth, steps, change=None):
    """The findings of ``det`` over ``synth``'s ``steps``; ``change(step, frame)`` alters a frame first."""
    found = []
    for s in steps:
        frame = synth.frame(s)
        if change is not None:
            change(s, frame)
        found += det.update(frame)
    return found


def series_frames(values, name="loss"):
    return [StepFrame.single("s", i, (name,), np.array([v])) for i, v in enumerate(values)]


# -- non-finite ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e10, 3e10, -2e11])
def test_nonfinite_names_rank_metric_and_layer_at_the_step(value):
    synth = SyntheticRun(seed=4)
    frame = synth.frame(12)
    frame.layers[5, frame.layer_names.index("k_norm_mean"), 2] = value
    (f,) = NonFiniteDetector().update(frame)
    assert (f.kind, f.severity, f.step, f.ranks, f.metric, f.layer) == (
        "nonfinite",
        Severity.CRITICAL,
        12,
        (5,),
        "k_norm_mean",
        2,
    )
    assert f.hosts == ("node1",)


def test_nonfinite_counts_the_ranks_own_counter_and_ignores_large_finite_bookkeeping():
    frame = SyntheticRun(seed=4).frame(3)
    frame.scalars[:, frame.scalar_names.index("emitter_dropped")] = 5e10
    assert NonFiniteDetector().update(frame) == []
    frame.scalars[2, frame.scalar_names.index("nonfinite")] = 7
    (f,) = NonFiniteDetector().update(frame)
    assert f.ranks == (2,) and f.metric == "nonfinite"


def test_nonfinite_blames_the_rank_with_its_own_bad_values_not_the_all_reduced_ones():
    # rank 3 computed a NaN; the all-reduce spread it into every rank's global values
    frame = SyntheticRun(seed=4).frame(7)
    for name in ("grad_norm_global", "grad_cosine"):
        frame.scalars[:, frame.scalar_names.index(name)] = math.nan
    frame.scalars[3, frame.scalar_names.index("grad_norm_local")] = math.nan
    frame.scalars[:, frame.scalar_names.index("nonfinite")] = 2  # the probes also saw the global gradient
    (f,) = NonFiniteDetector().update(frame)
    assert f.ranks == (3,) and f.metric == "grad_norm_local"
    assert f.evidence["ranks_with_bad_all_reduced_values"] == list(range(8))
    assert "rank 3" in f.message and "7 other rank(s) followed" in f.message


def test_a_nonfinite_streak_keeps_naming_the_rank_it_began_on():
    synth = SyntheticRun(seed=4)
    det = NonFiniteDetector()
    first = synth.frame(7)
    first.scalars[3, first.scalar_names.index("loss")] = math.nan
    (f,) = det.update(first)
    assert f.ranks == (3,)
    # next step the NaN went through the all-reduce into every replica: all ranks are NaN now
    nxt = synth.frame(8)
    nxt.scalars[:, nxt.scalar_names.index("loss")] = math.nan
    (g,) = det.update(nxt)
    assert g.ranks == (3,) and "since step 7" in g.message
    assert det.update(synth.frame(9)) == []  # the streak ends
    later = synth.frame(10)
    later.scalars[1, later.scalar_names.index("loss")] = math.inf
    (h,) = det.update(later)
    assert h.ranks == (1,)  # a new streak names its own rank


def test_nonfinite_only_in_all_reduced_values_is_not_blamed_on_a_rank():
    frame = SyntheticRun(seed=4).frame(7)
    frame.scalars[:, frame.scalar_names.index("grad_norm_global")] = math.inf
    (f,) = NonFiniteDetector().update(frame)
    assert f.ranks == () and "not localised" in f.message


def test_nonfinite_just_below_the_limit_is_fine():
    frame = SyntheticRun(seed=4).frame(3)
    frame.layers[0, 0, 0] = 9.9e9
    assert NonFiniteDetector().update(frame) == []


# -- spikes --------------------------------------------------------------------------------------


def test_robust_baseline_follows_a_falling_loss_without_alarm():
    rng = np.random.default_rng(0)
    t = np.arange(3000)
    loss = (3 + 8 * np.exp(-t / 400)) * (1 + 0.02 * rng.standard_normal(t.size))
    det = SpikeDetector()
    assert [f for fr in series_frames(loss) for f in det.update(fr)] == []


def test_loss_spike_reports_onset_peak_and_recovery():
    rng = np.random.default_rng(1)
    loss = 3.0 * (1 + 0.01 * rng.standard_normal(400))
    loss[300:303] = [4.5, 6.0, 4.2]
    det = SpikeDetector()
    found = [f for fr in series_frames(loss) for f in det.update(fr)]
    phases = [(f.step, f.evidence["phase"]) for f in found]
    assert phases[0] == (300, "onset") and phases[-1][1] == "recovery"
    assert all(f.kind == "loss_spike" for f in found)
    assert found[-1].evidence["peak_step"] == 301
    assert found[0].evidence["baseline"] == pytest.approx(3.0, rel=0.03)


def test_gradient_spike_with_calm_loss_is_a_grad_spike_warning_not_a_loss_spike():
    rng = np.random.default_rng(2)
    n = 300
    loss = 3.0 * (1 + 0.01 * rng.standard_normal(n))
    gn = 0.3 * (1 + 0.1 * rng.standard_normal(n))
    gn[250] = 3.0
    det = SpikeDetector()
    frames = [StepFrame.single("s", i, ("loss", "grad_norm_global"), np.array([loss[i], gn[i]])) for i in range(n)]
    found = [f for fr in frames for f in det.update(fr)]
    assert found and {f.kind for f in found} == {"grad_spike"}
    assert found[0].step == 250 and found[0].severity is Severity.WARNING


def test_one_ranks_loss_spike_is_seen_through_the_highest_rank_and_names_it_as_evidence():
    synth = SyntheticRun(seed=3)

    def one_rank_spikes(s, fr):
        if s == 150:
            fr.scalars[4, fr.scalar_names.index("loss")] *= 2.5  # the mean moves ~1.2x: not a spike

    found = feed(SpikeDetector(), synth, range(200), one_rank_spikes)
    assert found and found[0].step == 150 and found[0].kind == "loss_spike"
    assert found[0].metric == "loss_max" and found[0].evidence["max_rank"] == 4 and found[0].ranks == ()


def test_noise_that_reaches_a_high_z_but_a_small_ratio_is_not_a_spike():
    loss = np.full(300, 3.0)
    loss[200] = 3.3  # z is huge on a flat series, but +10% is not a spike
    det = SpikeDetector()
    assert [f for fr in series_frames(loss) for f in det.update(fr)] == []


def test_spike_settings_are_checked():
    with pytest.raises(ConfigError, match="spike.min_ratio"):
        SeriesSettings(min_ratio=0.9)
    with pytest.raises(ConfigError, match="spike.z_off"):
        SeriesSettings(z_on=3, z_off=4)
    with pytest.raises(ConfigError, match="spike.window"):
        RobustBaseline(window=0)


# -- rank outlier -----------------------------------------------------------------------------------


def test_single_noisy_step_names_no_rank():
    synth = SyntheticRun(seed=6)
    det = RankOutlierDetector()
    feed(det, synth, range(20))
    frame = synth.frame(20)
    frame.layers[2, 1, 0] *= 2.0  # a ~100-sigma excursion for one step
    found = det.update(frame) + feed(det, synth, range(21, 40))
    assert [f.kind for f in found] == ["rank_deviation"]  # info for attribution, not an outlier
    assert found[0].severity is Severity.INFO and found[0].ranks == (2,)


def test_persistent_small_shift_names_the_rank_metric_and_layer_with_confidence():
    synth = SyntheticRun(seed=6, world=32, faults=[Fault("rank_shift", 30, rank=17, layer=3)])
    det = RankOutlierDetector()
    found = [f for f in feed(det, synth, range(80)) if f.kind == "rank_outlier"]
    assert found and {f.ranks for f in found} == {(17,)}
    first = found[0]
    assert 30 < first.step <= 50
    assert first.metric in ("q_norm_mean", "q_norm_max") and first.layer == 3
    assert 0.5 <= first.evidence["confidence"] <= 1.0
    assert det.rank_scores.argmax() == 17 and det.rank_scores[17] >= 1.0


def test_a_shift_shared_by_all_ranks_names_nobody():

    def every_rank_shifts(s, fr):
        if s > 20:
            fr.layers *= 1.5

    assert feed(RankOutlierDetector(), SyntheticRun(seed=6), range(60), every_rank_shifts) == []


# -- replica --------------------------------------------------------------------------------------


def test_majority_vote():
    v = np.array([5, 5, 9, 5], np.uint64)
    value, odd = majority(v)
    assert value == 5 and list(np.flatnonzero(odd)) == [2]
    value, odd = majority(np.array([1, 2, 1, 2], np.uint64))
    assert value is None


def test_replica_divergence_names_the_odd_rank_at_once():
    synth = SyntheticRun(seed=8, faults=[Fault("replica", 10, rank=6)])
    (f,) = ReplicaDivergenceDetector().update(synth.frame(10))
    assert (f.kind, f.severity, f.ranks, f.metric) == ("replica_divergence", Severity.CRITICAL, (6,), "param_fp")


def test_global_grad_norm_disagreement_by_one_ulp_is_caught():
    frame = SyntheticRun(seed=8).frame(4)
    col = frame.scalar_names.index("grad_norm_global")
    frame.scalars[1, col] = np.nextafter(frame.scalars[1, col], np.inf)
    (f,) = ReplicaDivergenceDetector().update(frame)
    assert f.ranks == (1,) and f.metric == "grad_norm_global"


def test_split_replicas_blame_no_rank():
    frame = SyntheticRun(seed=8, world=4).frame(4)
    frame.fingerprints[:2, 0] ^= np.uint64(1)
    (f,) = ReplicaDivergenceDetector().update(frame)
    assert f.ranks == () and "no majority" in f.message


# -- straggler and missing ---------------------------------------------------------------------------


def test_one_slow_step_is_no_straggler_but_a_persistently_slow_rank_is():
    synth = SyntheticRun(seed=9)
    det = StragglerDetector()
    feed(det, synth, range(20))
    fr = synth.frame(20)
    fr.scalars[4, fr.scalar_names.index("step_time")] *= 100
    assert det.update(fr) == []
    slow = SyntheticRun(seed=9, faults=[Fault("straggler", 21, rank=4)])
    found = feed(det, slow, range(21, 60))
    assert found and {f.ranks for f in found} == {(4,)} and found[0].evidence["ratio_now"] > 2
    assert found[0].evidence["ratio_typical"] >= 1.5
    assert found[0].step - 21 <= StragglerDetector().window  # named once most of its window is slow


def test_a_rank_slower_now_and_then_is_no_straggler():
    # rank 0 slow on every third step (a periodic side task): its typical step is normal
    synth = SyntheticRun(seed=9)
    det = StragglerDetector()
    for s in range(200):
        fr = synth.frame(s)
        if s % 3 == 0:
            fr.scalars[0, fr.scalar_names.index("step_time")] *= 10
        assert det.update(fr) == []


def test_missing_rank_after_consecutive_absent_steps():
    synth = SyntheticRun(seed=9, faults=[Fault("missing", 10, rank=2, length=20)])
    det = MissingRankDetector(after=5)
    found = feed(det, synth, range(40))
    assert [f.step for f in found] == list(range(14, 30))
    assert all(f.ranks == (2,) for f in found)
