"""The checksum detector on frames: a ratio over the rounding bound names rank, check, layer and
step; one rank far above the others is a warning; clean ratios never raise anything."""

from __future__ import annotations

import numpy as np
from sdcwatch.core.record_type import Record
from sdcwatch.detectors.checksum import ChecksumDetector
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.nonfinite import NonFiniteDetector
from sdcwatch.service.pipeline import DetectionPipeline

WORLD = 8


def records(step: int, fwd: np.ndarray, *, gemm_in: np.ndarray | None = None, stream: np.ndarray | None = None) -> list:
    out = []
    for r in range(WORLD):
        layers = {
            "gemm_fwd": fwd[r].tolist(),
            "gemm_bwd": [1e-4] * fwd.shape[1],
            "gemm_weight": [0.0] * fwd.shape[1],
            "gemm_in": (gemm_in[r] if gemm_in is not None else np.full(fwd.shape[1], 4.0)).tolist(),
            "stream_max": (stream[r] if stream is not None else np.array([2.0, 3.0])).tolist(),
        }
        out.append(
            Record(
                "run", step, r, WORLD, f"node{r // 4}", 0.0, r % 4, {"loss": 2.0, "grad_norm_local": 1.0}, {}, layers
            )
        )
    return out


def clean(step: int, layers: int = 9) -> np.ndarray:
    return 1e-4 * np.exp(np.random.default_rng(step).standard_normal((WORLD, layers)))


def frame(step: int, fwd: np.ndarray, **kw) -> StepFrame:
    return StepFrame.from_records("run", step, WORLD, records(step, fwd, **kw))


def test_a_ratio_over_the_bound_names_rank_check_layer_and_step():
    det = ChecksumDetector()
    for s in range(50):
        assert det.update(frame(s, clean(s))) == []
    fwd = clean(50)
    fwd[5, 6] = 32.8
    (f,) = det.update(frame(50, fwd))
    assert (f.kind, f.severity.value, f.step, f.ranks, f.metric, f.layer) == (
        "checksum_mismatch",
        "critical",
        50,
        (5,),
        "gemm_fwd",
        6,
    )
    assert (
        "rank 5 (host node1)" in f.message
        and "gemm_fwd (product 6) is off by 32.8 x" in f.message
        and "32.8" in f.message
    )
    assert det.update(frame(51, clean(51))) == []


def test_one_rank_a_million_times_above_the_others_is_a_warning_under_the_bound():
    det = ChecksumDetector()
    fwd = np.full((WORLD, 9), 1e-8)
    fwd[2, 3] = 0.5  # under the bound, 5e7 x the others' P90
    (f,) = det.update(frame(0, fwd))
    assert (f.kind, f.severity.value, f.ranks, f.layer) == ("checksum_outlier", "warning", (2,), 3)
    fwd[2, 3] = 5e-3  # 5e5 x: not enough
    assert det.update(frame(1, fwd)) == []


def test_the_pipeline_opens_one_incident_per_rank_and_the_nonfinite_detector_names_the_product_that_made_it():
    pipe = DetectionPipeline()
    events = []
    for s in range(30):
        fwd = clean(s)
        gin = np.full((WORLD, 9), 4.0)
        if s == 20:
            fwd[3, 2:] = np.nan  # a NaN made by product 2; every later product got it as input
            gin[3, 3:] = np.nan
        events += pipe.process(records(s, fwd, gemm_in=gin))
    events += pipe.flush()
    opened = [e.incident for e in events if e.change == "opened"]
    assert [(i.kind, i.ranks, i.first_step) for i in opened] == [("nonfinite", (3,), 20)]
    assert opened[0].metric == "gemm_fwd" and opened[0].layer == 2


def test_large_finite_ratios_are_the_checksum_detectors_not_near_inf_values():
    fwd = clean(0)
    fwd[1, 0] = 1e12
    fr = frame(0, fwd)
    assert NonFiniteDetector().update(fr) == []
    assert [f.kind for f in ChecksumDetector().update(fr)] == ["checksum_mismatch"]
    stream = np.tile([2.0, 3.0], (WORLD, 1))
    stream[4, 1] = 2e10  # an extreme value in the residual stream is near-INF
    (f,) = NonFiniteDetector().update(frame(1, clean(1), stream=stream))
    assert (f.ranks, f.metric, f.layer) == ((4,), "stream_max", 1)


def test_the_origin_is_named_when_many_ranks_and_products_went_bad():
    # a NaN made by product 5 of rank 6: every later product of rank 6 has it in input and output,
    # and the all-reduced values of every rank are NaN too: far more hits than a finding lists
    fwd, gin = clean(0, 11), np.full((WORLD, 11), 4.0)
    fwd[6, 5:] = np.nan
    gin[6, 6:] = np.nan
    recs = records(0, fwd, gemm_in=gin)
    for r in recs:
        r.scalars["grad_norm_global"] = float("nan")
        r.layers["gemm_bwd"] = [float("nan")] * 11 if r.rank == 6 else r.layers["gemm_bwd"]
    (f,) = NonFiniteDetector().update(StepFrame.from_records("run", 0, WORLD, recs))
    assert (f.ranks, f.metric, f.layer) == ((6,), "gemm_fwd", 5)
