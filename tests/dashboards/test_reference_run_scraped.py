"""A real reference run with an injected fault, watched the way a user watches it: the detector
service's exporter scraped by a real Prometheus that evaluates the dashboard and the alert rules."""

from __future__ import annotations

import threading

import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")


def test_dashboard_and_rules_on_a_faulted_reference_run(start_prometheus):
    from sdcwatch.exporters import MetricsServer
    from memory_source import MemorySource
    from sdcwatch.service.loop import DetectorService
    from sdcwatch.service.pipeline import DetectionPipeline
    from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport
    from sdcwatch.telemetry.guard.config import GuardConfig
    from sdcwatch.testbed.faultspec import FaultSpec
    from sdcwatch.testbed.model import GPTConfig
    from sdcwatch.testbed.simulated import SimulatedRun, shared_corpus

    torch.set_num_threads(1)
    bus = MemoryBus()
    service = DetectorService(MemorySource(bus), DetectionPipeline(), poll_timeout=0.05)
    stop = threading.Event()
    thread = threading.Thread(target=service.run_forever, args=(stop,), daemon=True)
    exporter = MetricsServer(service.view, port=0).start()
    prometheus = start_prometheus(
        f"127.0.0.1:{exporter.port}", rule_files=[support.DASHBOARDS / "rules" / "sdcwatch.rules.yml"]
    )
    thread.start()
    try:
        fault = FaultSpec.from_dict(
            {"kind": "near_inf", "rank": 2, "step": 40, "target": "blocks.1.attn.scores", "seed": 0}
        )
        # a NaN in the same rank's gradient at the same step: the guard reruns the step (its panel has data)
        nan = FaultSpec.from_dict(
            {"kind": "nan", "rank": 2, "step": 40, "target": "blocks.0.mlp.fc", "where": "grad", "seed": 0}
        )
        run = SimulatedRun(
            world=4,
            seed=1,
            model=GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4),
            batch_size=2,
            corpus=shared_corpus(1 << 18),
            faults=[fault, nan],
            guard=GuardConfig(mode="act"),
            # scraped as a live run: no end-of-run markers, so its incident stays open
            emitter_factory=lambda rank: Emitter(MemoryTransport(bus), run="r1", rank=rank, world=4, end_marker=False),
        )
        run.train(60)
        assert [(a.step, a.action, a.verdict) for a in run.guard.actions] == [(40, "rerun", "transient")]
        run.close()
        for em in run.emitters:
            em.close()
        support.wait_for(
            lambda: support.prom_query(prometheus.base_url, 'sdcwatch_incident_info{kind="nonfinite"}'),
            timeout=30,
            what="the non-finite incident in Prometheus",
        )
        support.wait_for(
            lambda: support.prom_query(
                prometheus.base_url, "count_over_time(sdcwatch_pipeline_records_total[1m]) >= 4"
            ),
            timeout=30,
            what="four scrapes",
        )
        # on a loaded machine the incident can open only as training ends: increase() needs two samples
        support.wait_for(
            lambda: support.prom_query(prometheus.base_url, "count_over_time(sdcwatch_incidents_total[1m]) >= 2"),
            timeout=30,
            what="two scrapes of the incident counter",
        )
        (info,) = support.prom_query(prometheus.base_url, 'sdcwatch_incident_info{kind="nonfinite"}')
        assert info["metric"]["rank"] == "2" and info["metric"]["run"] == "r1"
        for where, expr in support.dashboard_expressions():
            result = support.prom_query(prometheus.base_url, support.substitute(expr))
            assert result, f"{where}: {expr!r} returned no data on a real run"
        for alert, expr in support.rule_expressions():
            support.prom_query(prometheus.base_url, expr)  # raises on an evaluation error
        _the_scan_row_shows_the_fault(prometheus.base_url)
    finally:
        stop.set()
        thread.join(10)
        exporter.close()


def _panel(title: str) -> str:
    (expr,) = [e for where, e in support.dashboard_expressions() if where.startswith(f"panel {title!r}")]
    return support.substitute(expr)


def _the_scan_row_shows_the_fault(base: str) -> None:
    """The scan row on the faulted run: the incident that caught the near-INF logit, with its rank
    and index; the every-step series of each metric only at the indices it has (2 blocks of
    residual stream, the checked products), none of them NaN. Before, every layer metric was padded
    to the products' count with NaN series (blocks 2-10 of a 2-block model)."""
    caught = support.prom_query(base, _panel("Caught by the scan and checksums"))
    where = [(s["metric"]["kind"], s["metric"]["metric"], s["metric"]["layer"], s["metric"]["rank"]) for s in caught]
    assert where == [("nonfinite", "attn_logit_max", "1", "2")]
    stream = support.prom_query(base, _panel("Residual stream per block (max over ranks)"))
    assert sorted(s["metric"]["layer"] for s in stream) == ["0", "1"]  # n_layer=2
    products = support.prom_query(base, _panel("Product outputs (max over ranks)"))
    assert len(products) > 2 and {s["metric"]["layer"] for s in products} == {str(i) for i in range(len(products))}
    checks = support.prom_query(base, _panel("Checksums: residual over its rounding bound (max over ranks)"))
    assert {s["metric"]["metric"] for s in checks} == {"gemm_fwd", "gemm_bwd", "gemm_weight"}
    assert len(checks) == 3 * len(products)
    entropy = support.prom_query(base, 'sdcwatch_layer_metric{run="r1", metric="attn_entropy", stat="max"}')
    assert sorted(s["metric"]["layer"] for s in entropy) == ["0", "1"]
    assert support.prom_query(base, "sdcwatch_layer_metric != sdcwatch_layer_metric") == []  # no NaN series
