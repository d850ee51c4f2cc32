"""Layer series of /metrics: each metric's only at the indices it has (no NaN padding to the longest
metric), with the name of each index beside it when the ranks sent their names."""

from __future__ import annotations

import math

import numpy as np
import sdcwatch_exporter_test_support as support  # registered by conftest.py
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sdcwatch.core.incident import PipelineView, RunView, ServiceView
from sdcwatch.core.rank_notes import LayerNames
from sdcwatch.core.record_type import Record
from sdcwatch.exporters import SdcwatchCollector
from sdcwatch.service.pipeline import DetectionPipeline

WORLD = 4
#: A 2-block model: 2 attention layers, 2 blocks of residual stream, 6 checked products.
NAMES = {
    "layers": ("model.layers.0.self_attn", "model.layers.1.self_attn"),
    "blocks": ("model.layers.0", "model.layers.1"),
    "products": tuple(f"model.layers.{b}.{p}" for b in (0, 1) for p in ("self_attn.q_proj", "mlp.up", "mlp.down")),
}


def render(view, **options) -> str:
    registry = CollectorRegistry()
    registry.register(SdcwatchCollector(lambda: view, clock=lambda: 1001.0, **options))
    return generate_latest(registry).decode()


def layer_samples(text: str) -> list:
    return [s for f in text_string_to_metric_families(text) if f.name == "sdcwatch_layer_metric" for s in f.samples]


def records(step: int, *, run: str = "r1") -> list[Record]:
    """One step of every rank: each metric as long as what it measures (2, 2 and 6 indices)."""
    rng = np.random.default_rng([3, step])
    out = []
    for rank in range(WORLD):
        noise = 1 + 0.01 * rng.standard_normal(6)
        out.append(
            Record.make(
                run=run,
                step=step,
                rank=rank,
                world=WORLD,
                host=f"node{rank // 2}",
                time=float(step),
                scalars={"loss": 3.0 + 0.01 * noise[0], "grad_norm_local": 1.0 * noise[1]},
                layers={
                    "attn_entropy": (2.0 * noise[:2]).tolist(),
                    "stream_max": (40.0 * noise[:2]).tolist(),
                    "gemm_out": (10.0 * np.arange(1, 7) * noise).tolist(),
                },
            )
        )
    return out


def pipeline_view(steps: int = 12, *, names: bool = False, run: str = "r1"):
    pipeline = DetectionPipeline()
    for step in range(steps):
        sent = list(records(step, run=run))
        if names and step == 0:  # each rank's names come ahead of its first record, as the emitter sends them
            sent = [LayerNames.build(run, r, WORLD, 0, NAMES) for r in range(WORLD)] + sent
        pipeline.process(sent)
    pipeline.flush()
    return pipeline.view()


def test_a_metric_has_series_only_at_the_indices_it_has():
    """Before: every layer metric padded with NaN to the longest (attention and stream_max to the 6
    products here; 243 of 462 series NaN in a clean 2-layer simulated run)."""
    view = pipeline_view()
    run = view.runs[0]
    assert {k: v.shape[0] for k, v in run.layer_stats.items()} == {"attn_entropy": 6, "stream_max": 6, "gemm_out": 6}
    found = layer_samples(render(view))
    assert found and not [s for s in found if math.isnan(s.value)]
    indices = {m: sorted({int(s.labels["layer"]) for s in found if s.labels["metric"] == m}) for m in run.layer_stats}
    assert indices == {"attn_entropy": [0, 1], "stream_max": [0, 1], "gemm_out": [0, 1, 2, 3, 4, 5]}
    assert len(found) == (2 + 2 + 6) * 3  # min, median, max
    # no names sent: the index alone
    assert all("layer_name" not in s.labels for s in found)


def test_the_layer_bound_is_not_spent_on_padding():
    """Past metrics.max_layers the widest spread is shown: padding (a NaN statistic ranked first)
    used to take every place."""
    view = pipeline_view()
    stats = view.runs[0].layer_stats["gemm_out"]
    stats[4] = [1.0, 40.0, 50.0, 60.0, 900.0]  # product 4: the ranks disagree
    text = render(view, max_layers=1)
    assert {s.labels["layer"] for s in layer_samples(text)} == {"4"}
    assert 'sdcwatch_exporter_omitted{what="layers"} 5.0' in text  # 6 indices some metric has, 1 shown


def test_every_index_is_named_beside_its_number():
    view = pipeline_view()
    run = view.runs[0]
    run.layer_names = (NAMES,)  # what the service hands on of the names its ranks sent
    found = layer_samples(render(view))
    named = {(s.labels["metric"], s.labels["layer"], s.labels["layer_name"]) for s in found}
    assert ("attn_entropy", "1", "model.layers.1.self_attn") in named
    assert ("stream_max", "0", "model.layers.0") in named
    assert ("gemm_out", "5", "model.layers.1.mlp.down") in named
    assert len(named) == 2 + 2 + 6 and len(found) == 3 * len(named)  # one name per index: no series more


def test_named_indices_keep_their_series_when_every_rank_is_non_finite_there():
    """A metric's names say which indices it has: the last attention layer non-finite on every rank
    keeps its (NaN) series, while without names it is the padding it cannot be told from."""
    view = pipeline_view()
    run = view.runs[0]
    run.layer_stats["attn_entropy"][1] = np.nan
    assert {s.labels["layer"] for s in layer_samples(render(view)) if s.labels["metric"] == "attn_entropy"} == {"0"}
    run.layer_names = (NAMES,)
    kept = [s for s in layer_samples(render(view)) if s.labels["metric"] == "attn_entropy"]
    assert {s.labels["layer"] for s in kept} == {"0", "1"}
    assert all(math.isnan(s.value) for s in kept if s.labels["layer"] == "1")


def test_a_long_name_is_bounded_and_a_missing_one_left_out():
    view = pipeline_view()
    long = "model." + "very_deep." * 30 + "q_proj"
    products = ("", long, *NAMES["products"][2:])
    view.runs[0].layer_names = ({**NAMES, "products": products},)
    found = {
        s.labels["layer"]: s.labels.get("layer_name")
        for s in layer_samples(render(view))
        if s.labels["metric"] == "gemm_out"
    }
    assert found["0"] is None  # a rank that could not name a product: no label
    assert len(found["1"]) == 128 and found["1"].endswith("...")
    assert found["2"] == "model.layers.0.mlp.down"


EXPECTED_NAMED = """\
sdcwatch_layer_metric{layer="0",layer_name="model.layers.0.self_attn",metric="attn_entropy",run="r1",stat="max"} 1.0
sdcwatch_layer_metric{layer="1",layer_name="model.layers.1.self_attn",metric="attn_entropy",run="r1",stat="max"} 2.0
sdcwatch_layer_metric{layer="0",layer_name="model.layers.0.self_attn.q_proj",metric="gemm_out",run="r1",stat="max"} 10.0
sdcwatch_layer_metric{layer="1",layer_name="model.layers.0.mlp.up",metric="gemm_out",run="r1",stat="max"} 20.0
sdcwatch_layer_metric{layer="2",layer_name="model.layers.0.mlp.down",metric="gemm_out",run="r1",stat="max"} 30.0
"""


def test_exposition_of_named_indices_is_exact():
    """Two attention layers beside three products: no padding line, a name on each line."""
    stats = {
        "attn_entropy": np.array([[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [np.nan] * 5], dtype=float),
        "gemm_out": np.array([[0, 0, 0, 0, 10], [0, 0, 0, 0, 20], [0, 0, 0, 0, 30]], dtype=float),
    }
    run = RunView(
        run="r1",
        world=2,
        last_step=5,
        last_step_wall=1000.0,
        **support.detector_numbers(loss=1.0, grad_norm=1.0, spike_scores={}, rank_scores=np.zeros(2)),
        hosts=["h0", "h1"],
        scalar_stats={},
        layer_stats=stats,
    )
    run.layer_names = ({"layers": NAMES["layers"], "products": NAMES["products"][:3]},)
    view = ServiceView(runs=[run], pipeline=PipelineView(), incidents=[], incidents_total={}, findings_total={})
    lines = [
        line for line in render(view, layer_stats=("max",)).splitlines() if line.startswith("sdcwatch_layer_metric{")
    ]
    assert "\n".join(lines) + "\n" == EXPECTED_NAMED


def test_names_sent_by_the_ranks_reach_the_labels_through_the_service():
    """Names messages and records through the real detection pipeline: the view carries the names."""
    view = pipeline_view(names=True)
    assert view.runs[0].layer_names == (NAMES,)
    found = {(s.labels["metric"], s.labels["layer"]): s.labels.get("layer_name") for s in layer_samples(render(view))}
    assert found[("gemm_out", "3")] == "model.layers.1.self_attn.q_proj"
    assert found[("stream_max", "1")] == "model.layers.1"
    assert found[("attn_entropy", "0")] == "model.layers.0.self_attn"


def test_each_pipeline_stage_names_its_own_indices():
    """Under pipeline parallelism a stage numbers its own layers from 0: stage 1's layer 0 is
    another module than stage 0's, named from its own ranks' list."""
    import sdcwatch_exporter_test_support as support  # registered by conftest.py
    from sdcwatch.core.mesh import Layout

    lay = Layout.parse(support.LAYOUT_3D)
    pipeline = DetectionPipeline()
    for step in range(12):
        sent = support.records_3d(step)
        if step == 0:
            stage = {r: lay.coords(r).get("pp", 0) for r in range(lay.world)}
            first = {0: 0, 1: 2}  # stage 0 holds layers 0-1 of the model, stage 1 layers 2-4
            sent = [
                LayerNames.build(
                    "r3d",
                    r,
                    lay.world,
                    0,
                    {"layers": tuple(f"model.layers.{first[stage[r]] + i}" for i in range(2 + stage[r]))},
                )
                for r in range(lay.world)
            ] + sent
        pipeline.process(sent)
    pipeline.flush()
    view = pipeline.view()
    found = {
        (s.labels["piece"], s.labels["layer"], s.labels.get("layer_name"))
        for s in layer_samples(render(view))
        if s.labels["metric"] == "attn_entropy"
    }
    assert ("pp=0,tp=1", "0", "model.layers.0") in found and ("pp=1,tp=1", "0", "model.layers.2") in found
    assert ("pp=1,tp=0", "2", "model.layers.4") in found
    assert len(found) == 2 * 2 + 2 * 3  # stage 0: 2 layers on each of its 2 tensor-parallel pieces; stage 1: 3
