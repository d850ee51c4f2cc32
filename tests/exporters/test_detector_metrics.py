"""A detector owns its numbers: a new detector with a new metric is one file. Registered, its metric
is in the catalogue, on ``/metrics`` of a running pipeline, in the dashboard and its README, with
no other file changed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.metric_spec import MetricSpec
from sdcwatch.core.record_type import Record
from sdcwatch.dashboards import generate
from sdcwatch.detectors import registry
from sdcwatch.detectors.base import Detector
from sdcwatch.exporters import SdcwatchCollector, catalogue, metric
from sdcwatch.service.pipeline import DetectionPipeline

PARITY = "sdcwatch_detector_step_parity"


@pytest.fixture
def step_parity(monkeypatch):
    """A detector defined here, registered for this test only (the registry is given back after)."""
    registry.detector_classes()  # the package's own detectors first
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))

    @registry.register(order=95, default=True)
    class StepParity(Detector):
        name = "step_parity"
        fault = "none"
        metrics = (
            MetricSpec(PARITY, "gauge", ("run",), "Parity of the last step.", read=lambda d: d.parity, panel="Parity"),
            MetricSpec(
                "sdcwatch_detector_step_ranks",
                "gauge",
                ("run", "rank", "host"),
                "Rank numbers.",
                read=lambda d: d.ranks,
            ),
        )

        def __init__(self, config: Any = None, /, **settings: Any) -> None:
            super().__init__(config, **settings)
            self.parity = -1
            self.ranks = np.zeros(0)

        def update(self, frame) -> list:
            self.parity = frame.step % 2
            self.ranks = np.arange(frame.world, dtype=float)
            return []

    return StepParity


def _scrape(pipeline: DetectionPipeline) -> str:
    reg = CollectorRegistry()
    reg.register(SdcwatchCollector(pipeline.view, top_k=2))
    return generate_latest(reg).decode()


def test_a_registered_detectors_metric_is_catalogued_exported_and_drawn(step_parity):
    assert metric(PARITY, registry.detector_metrics()).help == "Parity of the last step."
    names = [spec.name for spec in catalogue(registry.detector_metrics())]
    assert names.index("sdcwatch_pipeline_missing_ranks") < names.index(PARITY)  # in pipeline order

    pipeline = DetectionPipeline()  # the default detectors: the registered one among them
    for step in range(5):
        pipeline.process([Record.make(run="t", step=step, rank=r, world=4, scalars={"loss": 1.0}) for r in range(4)])
    pipeline.flush()
    text = _scrape(pipeline)
    assert "# HELP sdcwatch_detector_step_parity Parity of the last step." in text
    assert 'sdcwatch_detector_step_parity{run="t"} 0.0' in text  # step 4
    ranks = [line for line in text.splitlines() if line.startswith("sdcwatch_detector_step_ranks{")]
    assert [line.split('rank="')[1].split('"')[0] for line in ranks] == ["2", "3"]  # top-K of a per-rank metric

    model = generate.build_model()
    (panel,) = [p for p in model.panels if p.title == "Parity"]
    assert panel.targets[0].expr == 'sdcwatch_detector_step_parity{run=~"$run"}'
    readme = generate.render_readme(generate.README.read_text())
    assert "| `sdcwatch_detector_step_parity` | gauge | run | Parity of the last step. |" in readme


def test_without_the_detector_its_metric_is_gone(step_parity):
    pipeline = DetectionPipeline(detectors=lambda: registry.default_detectors()[:-1])
    pipeline.process([Record.make(run="t", step=0, rank=r, world=4, scalars={"loss": 1.0}) for r in range(4)])
    pipeline.flush()
    assert PARITY not in _scrape(pipeline)


def test_a_detectors_metric_is_per_run():
    with pytest.raises(ConfigError, match="per run"):
        MetricSpec("sdcwatch_detector_x", "gauge", ("piece",), "X.", read=lambda d: 0.0)
