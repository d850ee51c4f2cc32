"""/metrics shows each run's newest clean checkpoint and its recent checkpoints by slot (no step label)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sdcwatch.core.rank_notes import CheckpointMark
from sdcwatch.core.incident import PipelineView, ServiceView
from sdcwatch.exporters import SdcwatchCollector, catalogue


def test_checkpoint_series_name_the_newest_clean_step_and_carry_no_step_label():
    view = ServiceView(runs=[], pipeline=PipelineView(), incidents=[], incidents_total={}, findings_total={})
    view.checkpoints = [  # as the pipeline hands them: newest first per run
        CheckpointMark("r", 80, "c-80", "after-fault"),
        CheckpointMark("r", 60, "c-60", "suspect"),
        CheckpointMark("r", 40, "c-40", "clean"),
    ]
    registry = CollectorRegistry()
    registry.register(SdcwatchCollector(lambda: view))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert [s.value for s in families["sdcwatch_checkpoint_newest_clean_step"].samples] == [40.0]
    slots = {(s.labels["slot"], s.labels["mark"]): s.value for s in families["sdcwatch_checkpoint_step"].samples}
    assert slots == {("0", "after-fault"): 80.0, ("1", "suspect"): 60.0, ("2", "clean"): 40.0}
    names = {spec.name for spec in catalogue()}
    assert {"sdcwatch_checkpoint_newest_clean_step", "sdcwatch_checkpoint_step"} <= names
    for fam in families.values():
        for sample in fam.samples:
            assert "step" not in sample.labels
