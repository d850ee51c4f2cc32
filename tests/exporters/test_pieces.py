"""Cross-rank statistics per model piece: a 3D run's quantiles are those of each piece's own ranks,
a plain data-parallel run's series are unchanged, and the pieces and layers shown are bounded."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess

import numpy as np
import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sdcwatch.core.mesh import Layout, peer_key, piece_label
from sdcwatch.exporters import SdcwatchCollector
from sdcwatch.exporters.catalog import STATS
from sdcwatch.service.pipeline import DetectionPipeline

QUANTILES = [0.0, 0.25, 0.5, 0.75, 1.0]


def render(view, **options) -> str:
    registry = CollectorRegistry()
    registry.register(SdcwatchCollector(lambda: view, clock=lambda: 1001.0, **options))
    return generate_latest(registry).decode()


def samples(text: str, family: str) -> list:
    return [s for f in text_string_to_metric_families(text) if f.name == family for s in f.samples]


def test_3d_run_statistics_are_those_of_each_piece_and_never_mix_stages():
    view, sent = support.pipeline_view_3d()
    run = view.runs[0]
    assert run.pieces == support.PIECES_3D and run.piece_layers == (2, 2, 3, 3)
    text = render(view, layer_stats=STATS)
    last = sent[run.last_step]
    lay = Layout.parse(support.LAYOUT_3D)
    members = {p: [r for r in last if piece_label(lay.coords(r.rank)) == p] for p in support.PIECES_3D}
    assert all(len(m) == 4 for m in members.values())  # the 4 data-parallel replicas of each piece

    scalars = samples(text, "sdcwatch_rank_metric")
    assert scalars and all(s.labels.get("piece") in support.PIECES_3D for s in scalars)  # no mixed series
    for piece, recs in members.items():
        for metric in ("grad_norm_local", "loss"):
            values = [r.scalars[metric] for r in recs if metric in r.scalars]
            got = {
                s.labels["stat"]: s.value
                for s in scalars
                if s.labels["piece"] == piece and s.labels["metric"] == metric
            }
            if not values:  # stage 0 has no loss: no series, not a NaN nor stage 1's
                assert got == {}, (piece, metric, got)
                continue
            expected = dict(zip(STATS, np.quantile(values, QUANTILES)))
            assert got.keys() == expected.keys()
            np.testing.assert_allclose([got[k] for k in STATS], [expected[k] for k in STATS], rtol=1e-12)

    layers = samples(text, "sdcwatch_layer_metric")
    for piece, recs in members.items():
        mine = [s for s in layers if s.labels["piece"] == piece and s.labels["metric"] == "attn_entropy"]
        n_layers = 2 if piece.startswith("pp=0") else 3  # a stage's own layers, numbered from 0
        assert {int(s.labels["layer"]) for s in mine} == set(range(n_layers))
        for layer in range(n_layers):
            values = [r.layers["attn_entropy"][layer] for r in recs]
            got = {s.labels["stat"]: s.value for s in mine if s.labels["layer"] == str(layer)}
            np.testing.assert_allclose([got[k] for k in STATS], np.quantile(values, QUANTILES), rtol=1e-12)
    # each metric's values of stage 0 sit a decade below stage 1's: every statistic of stage 0 below
    # every statistic of stage 1 (a single stage-1 value in a stage-0 max would break it)
    for metric in ("grad_norm_local", "attn_entropy", "q_norm_max", "k_norm_max", "attn_logit_max"):
        of = {
            pp: [x.value for x in scalars + layers if x.labels["metric"] == metric and x.labels["piece"].startswith(pp)]
            for pp in ("pp=0", "pp=1")
        }
        assert of["pp=0"] and of["pp=1"] and max(of["pp=0"]) < min(of["pp=1"]), metric
    assert 'sdcwatch_exporter_omitted{what="pieces"} 0.0' in text
    assert 'sdcwatch_exporter_omitted{what="layers"} 0.0' in text


def test_plain_data_parallel_keeps_one_piece_and_its_series_unchanged():
    """Coordinates naming only data-parallel dims are one piece: no piece label, the same series
    (names, labels, values) as records without coordinates."""
    with_dp, sent = support.pipeline_view_3d(layout="dp=8", run="dp")
    assert sent[0][3].coords == {"dp_replicate": 3}
    pipeline = DetectionPipeline()  # the same values sent without coordinates
    for step in sorted(sent):
        pipeline.process([dataclasses.replace(r, coords={}) for r in sent[step]])
    pipeline.flush()
    plain = pipeline.view()
    assert with_dp.runs[0].pieces == plain.runs[0].pieces == ("",)

    def stats_lines(view):
        return [
            line
            for line in render(view).splitlines()
            if line.startswith(("sdcwatch_rank_metric{", "sdcwatch_layer_metric{"))
        ]

    lines = stats_lines(with_dp)
    assert lines and lines == stats_lines(plain)
    assert not any("piece=" in line for line in lines)


def _big_view(max_spread_piece: int, incident_rank: int):
    """A pp=16, tp=8 run (128 pieces) with every piece's statistics narrow but one."""
    lay = Layout.parse("tp=8,pp=16,dp=4")
    pieces = tuple(dict.fromkeys(piece_label(lay.coords(r)) for r in range(lay.world)))
    assert len(pieces) == 128
    view = support.small_view()
    run = view.runs[0]
    scalars = np.tile(np.array([1.0, 1.9, 2.0, 2.1, 3.0]), (128, 1))
    scalars[max_spread_piece, 4] = 90.0
    run.pieces = pieces
    run.piece_layers = (5,) * 128
    run.scalar_stats = {"grad_norm_local": scalars}
    run.layer_stats = {"attn_entropy": np.tile(np.array([1.0, 1.9, 2.0, 2.1, 3.0]), (128, 5, 1))}
    coords = lay.coords(incident_rank)
    view.incidents = [
        dataclasses.replace(support.sdc_incident(), id="inc-3d", ranks=(incident_rank,), layer=4, coords=(coords,))
    ]
    return view, pieces, piece_label(coords)


def test_pieces_past_the_cap_keep_the_incident_piece_and_the_widest_spread(caplog):
    view, pieces, incident_piece = _big_view(max_spread_piece=77, incident_rank=4 * 8 * 12 + 5)
    with caplog.at_level(logging.WARNING, logger="sdcwatch.exporters.collector"):
        text = render(view, top_k=2)
    shown = {s.labels["piece"] for s in samples(text, "sdcwatch_rank_metric")}
    assert len(shown) == 32  # the default cap
    assert incident_piece == "pp=12,tp=5" and incident_piece in shown
    assert pieces[77] in shown
    assert 'sdcwatch_exporter_omitted{what="pieces"} 96.0' in text
    assert "128 model pieces, statistics series for 32 (metrics.max_pieces)" in caplog.text
    # (piece, layer) pairs of the shown pieces: 32 x 5 = 160, bounded by max_layers (128)
    pairs = {(s.labels["piece"], s.labels["layer"]) for s in samples(text, "sdcwatch_layer_metric")}
    assert len(pairs) == 128 and (incident_piece, "4") in pairs
    assert {p for p, _ in pairs} <= shown
    assert 'sdcwatch_exporter_omitted{what="layers"} 32.0' in text
    assert len(re.findall(r"^sdcwatch_(rank|layer)_metric\{", text, re.M)) == 32 * 5 + 128 * 3
    everything = render(view, top_k=2, max_pieces=128, max_layers=640)
    assert 'sdcwatch_exporter_omitted{what="pieces"} 0.0' in everything
    assert len({s.labels["piece"] for s in samples(everything, "sdcwatch_rank_metric")}) == 128


def test_piece_label_is_the_peer_key_written_out():
    c = {"pp": 1, "dp_replicate": 3, "dp_shard": 1, "cp": 0, "tp": 0}
    assert piece_label(c) == "pp=1,cp=0,tp=0"
    assert piece_label(c) == ",".join(f"{d}={v}" for d, v in peer_key(c))
    assert piece_label({"dp_replicate": 2, "dp_shard": 0}) == piece_label({}) == ""


def test_cardinality_of_a_128_piece_run_stays_under_5000():
    """tp=8, pp=16, dp=128 at 16,384 ranks, 5 layers a stage: bounded by max_pieces and max_layers."""
    lay = Layout.parse("tp=8,pp=16,dp=128")
    view = support.large_view(lay.world)
    run = view.runs[0]
    rng = np.random.default_rng(0)
    run.pieces = tuple(dict.fromkeys(piece_label(lay.coords(r)) for r in range(lay.world)))
    run.piece_layers = (5,) * 128
    run.scalar_stats = {k: np.sort(rng.normal(size=(128, 5)), axis=1) for k in run.scalar_stats}
    run.layer_stats = {k: np.sort(rng.normal(size=(128, 5, 5)), axis=1) for k in run.layer_stats}
    lines = [line for line in render(view, top_k=16).splitlines() if line and not line.startswith("#")]
    assert len(lines) < 5000, len(lines)
    assert sum(line.startswith("sdcwatch_rank_metric{") for line in lines) == 32 * len(run.scalar_stats) * 5
    assert sum(line.startswith("sdcwatch_layer_metric{") for line in lines) == 128 * len(run.layer_stats) * 3


def test_a_scalar_a_piece_does_not_report_and_layers_it_does_not_hold_do_not_pick_it():
    """Stage 0 has no loss (all NaN) and fewer layers (NaN padding): neither is spread; the piece
    whose ranks disagree is shown."""
    view, pieces, _ = _big_view(max_spread_piece=90, incident_rank=0)
    view.incidents = []
    run = view.runs[0]
    loss = np.tile(np.array([2.9, 2.95, 3.0, 3.05, 3.1]), (128, 1))
    loss[:64] = np.nan  # the first stages report no loss
    run.scalar_stats["loss"] = loss
    run.piece_layers = tuple(3 if p < 64 else 5 for p in range(128))
    run.layer_stats["attn_entropy"][:64, 3:] = np.nan
    shown = {s.labels["piece"] for s in samples(render(view, top_k=2, max_pieces=1), "sdcwatch_rank_metric")}
    assert shown == {pieces[90]}
    for p in (10, 100):
        run.layer_stats["attn_entropy"][p, 1, 4] = np.nan  # a NaN among a layer's values is evidence
    view.runs[0].scalar_stats["grad_norm_local"][90, 4] = 3.0
    shown = {s.labels["piece"] for s in samples(render(view, top_k=2, max_pieces=2), "sdcwatch_rank_metric")}
    assert shown == {pieces[10], pieces[100]}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_pieces_beside_a_plain_run():
    """A 3D run's series (with piece) and a data-parallel run's (without) in one family."""
    view, _ = support.pipeline_view_3d()
    plain, _ = support.pipeline_view_3d(layout="dp=8", run="dp")
    view.runs += plain.runs
    text = render(view)
    assert 'piece="pp=1,tp=0"' in text and 'sdcwatch_rank_metric{metric="grad_norm_local",run="dp",stat="max"}' in text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr
