"""Per-piece cross-rank statistics: numpy's quantiles within each peer group, carried by the step
summary to a temporal stage, bounded in the number of pieces."""

from __future__ import annotations

import numpy as np
import pytest
from mesh_synth import MeshRun
from sdcwatch.core.mesh import piece_label
from sdcwatch.detectors import piece_stats as ps
from sdcwatch.detectors.frame import frame_stats
from sdcwatch.service.summary import StepSummary, decode_summary, encode_summary

QUANTILES = list(ps.QUANTILES)


@pytest.mark.parametrize("seed", range(5))
def test_grouped_quantiles_match_numpy_with_missing_values(seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((6, 9)) * 10.0 ** rng.integers(-3, 4, size=(6, 1))
    X[rng.random(X.shape) < 0.3] = np.nan
    X[0] = np.nan  # a row without a value
    got = ps.grouped_quantiles(X)
    assert np.isnan(got[0]).all()
    for i in range(1, X.shape[0]):
        row = X[i][np.isfinite(X[i])]
        np.testing.assert_allclose(got[i], np.quantile(row, QUANTILES), rtol=1e-13, atol=0)


def test_frame_stats_per_piece_are_the_quantiles_of_each_peer_group():
    mesh = MeshRun(tp=2, pp=2, dp=4, n_layers=3)
    frame = mesh.frame(5)
    stats = frame_stats(frame)
    pieces = stats["pieces"]
    labels = [piece_label(mesh.coords(r)) for r in range(mesh.world)]
    assert (
        pieces["names"] == sorted(set(labels), key=labels.index) == ["pp=0,tp=0", "pp=0,tp=1", "pp=1,tp=0", "pp=1,tp=1"]
    )
    assert pieces["omitted"] == 0 and list(pieces["n_layers"]) == [3, 3, 3, 3]
    for p, name in enumerate(pieces["names"]):
        ranks = [r for r in range(mesh.world) if labels[r] == name]
        for j, metric in enumerate(frame.scalar_names):
            col = frame.scalars[ranks, j]
            col = col[np.isfinite(col)]
            if col.size:
                np.testing.assert_allclose(pieces["scalars"][metric][p], np.quantile(col, QUANTILES), rtol=1e-13)
            else:  # the loss of a stage that has none
                assert np.isnan(pieces["scalars"][metric][p]).all()
        for m, metric in enumerate(frame.layer_names):
            want = np.quantile(frame.layers[ranks, m, :], QUANTILES, axis=0).T
            np.testing.assert_allclose(pieces["layers"][metric][p], want, rtol=1e-13)
    # the run-wide statistics stay as they were, for a temporal stage of an older version
    np.testing.assert_allclose(
        stats["scalars"]["grad_norm_local"], np.quantile(frame.scalar("grad_norm_local"), QUANTILES), rtol=1e-13
    )


def test_one_piece_has_no_per_piece_statistics():
    assert "pieces" not in frame_stats(MeshRun(tp=1, pp=1, dp=8).frame(3))


def test_the_step_summary_carries_the_pieces_to_the_temporal_stage():
    frame = MeshRun(tp=2, pp=2, dp=4).frame(2)
    sent = StepSummary(run="mesh", step=2, world=frame.world, n_present=frame.world, stats=frame_stats(frame))
    got = decode_summary(encode_summary(sent)).stats["pieces"]
    want = sent.stats["pieces"]
    assert got["names"] == want["names"] and got["omitted"] == 0
    np.testing.assert_array_equal(got["n_layers"], want["n_layers"])
    for kind in ("scalars", "layers"):
        assert got[kind].keys() == want[kind].keys()
        for name in want[kind]:
            np.testing.assert_array_equal(got[kind][name], want[kind][name])


def test_pieces_past_the_bound_are_counted_not_computed(monkeypatch):
    monkeypatch.setattr(ps, "MAX_PIECES", 3)
    pieces = frame_stats(MeshRun(tp=2, pp=2, dp=4).frame(1))["pieces"]
    assert pieces["names"] == ["pp=0,tp=0", "pp=0,tp=1", "pp=1,tp=0"] and pieces["omitted"] == 1
    assert all(v.shape == (3, 5) for v in pieces["scalars"].values())
