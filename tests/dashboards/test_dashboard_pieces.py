"""The dashboard on a tensor x pipeline x data parallel run, evaluated by a real Prometheus that
scrapes the real exporter: the $piece variable lists the model pieces, and every per-piece panel
shows the picked pieces' own statistics."""

from __future__ import annotations

import numpy as np
import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py

pytestmark = pytest.mark.integration


def _with(expr: str, piece: str) -> str:
    for var, value in (("${run}", "r3d"), ("$run", "r3d"), ("${piece}", piece), ("$piece", piece)):
        expr = expr.replace(var, value)
    return support.substitute(expr)


def test_piece_variable_and_panels_on_a_3d_run(start_prometheus):
    from sdcwatch.exporters import MetricsServer

    view, _ = support.pipeline_view_3d()
    exporter = MetricsServer(lambda: view, port=0).start()
    try:
        prometheus = start_prometheus(f"127.0.0.1:{exporter.port}")
        base = prometheus.base_url
        support.wait_for(
            lambda: support.prom_query(base, 'sdcwatch_layer_metric{run="r3d"}'), timeout=40, what="a scrape"
        )
        ((_, series, label),) = [v for v in support.variable_queries() if v[0] == "piece"]
        found = {s["metric"].get(label) for s in support.prom_query(base, _with(series, ".*"))}
        assert found == set(support.PIECES_3D)

        per_piece = [(w, e) for w, e in support.dashboard_expressions() if "$piece" in e]
        assert len(per_piece) >= 4  # the scalar spread and the three per-layer panels
        for where, expr in per_piece:
            every = support.prom_query(base, _with(expr, ".*"))
            assert {s["metric"]["piece"] for s in every} == set(support.PIECES_3D), where
            one = support.prom_query(base, _with(expr, "pp=1,tp=0"))
            assert one and {s["metric"]["piece"] for s in one} == {"pp=1,tp=0"}, where
            both = support.prom_query(base, _with(expr, "pp=0,tp=0|pp=1,tp=1"))
            assert {s["metric"]["piece"] for s in both} == {"pp=0,tp=0", "pp=1,tp=1"}, where

        # stage 0 holds layers 0-1, stage 1 layers 0-2; no stage-1 value in a stage-0 quantile
        def entropy(piece: str, stat: str) -> dict[str, float]:
            expr = f'sdcwatch_layer_metric{{run="r3d", piece="{piece}", metric="attn_entropy", stat="{stat}"}}'
            return {s["metric"]["layer"]: float(s["value"][1]) for s in support.prom_query(base, expr)}

        assert sorted(entropy("pp=0,tp=0", "max")) == ["0", "1"]
        assert sorted(entropy("pp=1,tp=0", "max")) == ["0", "1", "2"]
        run = view.runs[0]
        stats = run.layer_stats["attn_entropy"]
        for p, piece in enumerate(run.pieces):
            got = entropy(piece, "median")
            np.testing.assert_allclose([got[str(i)] for i in range(len(got))], stats[p, : len(got), 2], rtol=1e-12)
        assert max(entropy("pp=0,tp=1", "max").values()) < min(entropy("pp=1,tp=0", "min").values())
    finally:
        exporter.close()
