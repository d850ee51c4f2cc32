"""The step-end reduction of the every-step scan: each call's largest |row sum|, whatever the lengths."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.telemetry.probes.gemm_state import call_peaks, stack_rows  # noqa: E402

torch.set_num_threads(1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize(
    "sizes",
    [
        (128,),  # one call
        (128, 128, 128),  # one length: every call one row
        (128, 512, 128, 256),  # a shared factor (the tokens): rows of it, then a scatter per call
        (100, 7, 128),  # none worth reducing by: zero-padded
    ],
)
def test_each_calls_peak_is_its_largest_magnitude_with_nan_and_inf_kept(sizes):
    g = torch.Generator().manual_seed(len(sizes))
    vectors = [torch.randn(n, generator=g) for n in sizes]
    got = call_peaks(vectors)
    assert _same(got, stack_rows([v.clone() for v in vectors]).abs_().amax(-1))
    assert got.tolist() == pytest.approx([float(v.abs().max()) for v in vectors])
    vectors[-1][3] = float("nan")
    vectors[0][-1] = -float("inf")
    kept = [v.clone() for v in vectors]
    got = call_peaks(vectors)
    assert all(torch.equal(v, k) for v, k in zip(vectors, kept) if not v.isnan().any())  # left as they were
    assert math.isnan(float(got[-1])) and (len(sizes) == 1 or float(got[0]) == math.inf)
    assert _same(got, stack_rows([v.clone() for v in vectors]).abs_().amax(-1))
