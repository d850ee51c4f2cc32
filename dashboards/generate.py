"""Builds the sdcwatch Grafana dashboard (dashboards/sdcwatch.json) with grafana-foundation-sdk.

The committed JSON is what users import; this file is its source. Regenerate after a change:

    python dashboards/generate.py            # rewrites dashboards/sdcwatch.json
    python dashboards/generate.py --check    # exit 1 if the committed JSON is out of date

Pinned SDK: grafana-foundation-sdk==0.0.21 (cog-generated builders for current Grafana; dashboard
schemaVersion 42, i.e. Grafana 12, in the classic JSON model). Every query reads metrics from the
sdcwatch exporter catalogue; a test evaluates each one against a real Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

# The SDK steers towards the v2 (Kubernetes-style) dashboard schema, which Grafana 12 serves only
# behind feature flags, and warns about the classic model when its modules load; the classic JSON
# model is what every Grafana 11 and 12 imports, so it is the one we build.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Prefer using dashboardv2", DeprecationWarning)
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.builders import heatmap, stat, table, timeseries
    from grafana_foundation_sdk.builders.common import ScaleDistributionConfig, VizLegendOptions
    from grafana_foundation_sdk.builders.prometheus import Dataquery as PromQuery
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import (
        DataSourceRef,
        LegendDisplayMode,
        LegendPlacement,
        ScaleDistribution,
    )
    from grafana_foundation_sdk.models.dashboard import (
        DataTransformerConfig,
        GridPos,
        VariableRefresh,
        VariableSort,
    )
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

__all__ = ["DASHBOARD_UID", "OUTPUT", "build_dashboard", "build_model", "render", "main"]

DASHBOARD_UID = "sdcwatch-overview"
OUTPUT = Path(__file__).resolve().parent / "sdcwatch.json"

#: Panels and annotations query Prometheus through the ``$datasource`` variable.
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
#: Every query selects the runs picked in the ``$run`` variable.
RUN = 'run=~"$run"'
#: Cross-rank statistics are per model piece (``piece="pp=1,tp=0"``) under tensor or pipeline
#: parallelism; panels show the pieces picked in ``$piece`` (All: every piece, and the series of a
#: plain data-parallel run, which have no piece label).
PIECE = 'piece=~"$piece"'


def _q(expr: str, legend: str = "", *, ref: str = "A", instant: bool = False, table_format: bool = False) -> PromQuery:
    query = PromQuery().expr(expr).ref_id(ref).datasource(DS)
    if legend:
        query = query.legend_format(legend)
    if instant:
        query = query.instant()  # sets instant=true, range=false
    if table_format:
        query = query.format(PromQueryFormat.TABLE)
    return query


def _legend() -> VizLegendOptions:
    return VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)


def _ts(title: str, description: str, pos: GridPos, *queries: PromQuery, unit: str = "") -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .grid_pos(pos)
        .legend(_legend())
        .line_width(1)
        .fill_opacity(0)
    )
    if unit:
        panel = panel.unit(unit)
    for query in queries:
        panel = panel.with_target(query)
    return panel


def _stat(title: str, description: str, pos: GridPos, query: PromQuery, unit: str = "") -> stat.Panel:
    panel = stat.Panel().title(title).description(description).datasource(DS).grid_pos(pos).with_target(query)
    return panel.unit(unit) if unit else panel


def _variables() -> list:
    datasource = (
        dash.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .description("Prometheus that scrapes the sdcwatch service.")
    )
    run = (
        dash.QueryVariable("run")
        .label("Run")
        .datasource(DS)
        .query("label_values(sdcwatch_training_last_step, run)")
        .definition("label_values(sdcwatch_training_last_step, run)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .description("Training run(s), from the run label of the exporter's series.")
    )
    piece = (
        dash.QueryVariable("piece")
        .label("Model piece")
        .datasource(DS)
        .query(f"label_values(sdcwatch_rank_metric{{{RUN}}}, piece)")
        .definition(f"label_values(sdcwatch_rank_metric{{{RUN}}}, piece)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .description(
            "Model piece(s) under tensor or pipeline parallelism (pp stage, tp rank...: the ranks the "
            "detectors compare); a plain data-parallel run has one piece and no values here."
        )
    )
    return [datasource, run, piece]


def _annotation() -> dash.AnnotationQuery:
    # A region per incident, spanning the time its info series exists (open to resolution).
    return (
        dash.AnnotationQuery()
        .name("sdcwatch incidents")
        .datasource(DS)
        .enable(True)
        .icon_color("red")
        .expr(f'sdcwatch_incident_info{{{RUN}, state="open"}}')
        .title_format("{{kind}} ({{severity}}) rank {{rank}} {{host}}")
        .text_format("incident {{id}}: {{metric}} index {{layer}} {{layer_name}}, detector {{detector}}")
        .tag_keys("kind,severity,rank,host")
        .step("15s")
        .use_value_for_time(False)
    )


#: Metrics of the every-step non-finite scan and of the matrix checksums: the incidents they open
#: are listed in the scan row (a NaN is left out of the cross-rank statistics, an incident is not).
SCAN_METRICS = "stream_max|gemm_out|attn_logit_max|attn_logit_min|gemm_fwd|gemm_bwd|gemm_weight|gemm_in"


def _symlog(panel: timeseries.Panel) -> timeseries.Panel:
    """A log axis that keeps 0 and negative values (a product's largest row sum may be either)."""
    return panel.scale_distribution(
        ScaleDistributionConfig().type(ScaleDistribution.SYMLOG).log(10).linear_threshold(1)
    )


def _training_row(y: int) -> tuple[list, int]:
    """Loss, gradient norm, last step, open incidents, spike scores, incidents opened."""
    items: list = [dash.Row("Training").grid_pos(GridPos(h=1, w=24, x=0, y=y))]
    y += 1
    items += [
        _ts(
            "Global loss",
            "Latest global loss (mean over ranks) per completed step. Red regions: open incidents.",
            GridPos(h=8, w=9, x=0, y=y),
            _q(f"sdcwatch_training_loss{{{RUN}}}", "{{run}}"),
        ),
        _ts(
            "Global gradient norm",
            "Global gradient norm per completed step.",
            GridPos(h=8, w=9, x=9, y=y),
            _q(f"sdcwatch_training_grad_norm{{{RUN}}}", "{{run}}"),
        ),
        _stat(
            "Last step",
            "Last training step the service completed.",
            GridPos(h=4, w=6, x=18, y=y),
            _q(f"max by (run) (sdcwatch_training_last_step{{{RUN}}})", "{{run}}"),
        ),
        _stat(
            "Open incidents",
            "Incidents currently open, all kinds (0 when none ever opened).",
            GridPos(h=4, w=6, x=18, y=y + 4),
            _q(f"sum(sdcwatch_incidents_open{{{RUN}}}) or on() vector(0)", "open"),
        ),
    ]
    y += 8
    items += [
        _ts(
            "Spike scores",
            "Robust, trend-aware spike score of the global loss and gradient norm; "
            "the spike detector alarms above its threshold.",
            GridPos(h=8, w=12, x=0, y=y),
            _q(f"sdcwatch_detector_spike_score{{{RUN}}}", "{{run}} {{metric}}"),
        ),
        _ts(
            "Incidents opened",
            "Incidents opened per interval, by kind and severity.",
            GridPos(h=8, w=12, x=12, y=y),
            _q(
                "sum by (kind, severity) (increase(sdcwatch_incidents_total[$__rate_interval]))",
                "{{kind}} {{severity}}",
            ),
        ),
    ]
    return items, y + 8


def _ranks_row(y: int) -> tuple[list, int]:
    """Rank-outlier evidence and the across-rank spread of the scalars."""
    items: list = [dash.Row("Ranks").grid_pos(GridPos(h=1, w=24, x=0, y=y))]
    y += 1
    items += [
        heatmap.Panel()
        .title("Rank-outlier score (top-K ranks)")
        .description(
            "Accumulated rank-outlier evidence of the top-K ranks and of every rank in an open "
            "incident; a persistently bright row is a rank that deviates from its peers."
        )
        .datasource(DS)
        .grid_pos(GridPos(h=9, w=12, x=0, y=y))
        .calculate(False)
        .with_target(_q(f"sdcwatch_rank_outlier_score{{{RUN}}}", "rank {{rank}} {{host}}")),
        _ts(
            "Per-rank spread of scalars",
            "Across-rank min, quartiles and max of the local "
            "gradient norm and loss: a single rank far outside the band is suspect. Under tensor or "
            "pipeline parallelism one band per model piece (its ranks hold the same piece).",
            GridPos(h=9, w=12, x=12, y=y),
            _q(
                f'sdcwatch_rank_metric{{{RUN}, {PIECE}, metric=~"grad_norm_local|loss"}}',
                "{{piece}} {{metric}} {{stat}}",
            ),
        ),
    ]
    return items, y + 9


def _scan_row(y: int) -> tuple[list, int]:
    """The every-step non-finite scan (residual stream, product outputs), the matrix checksums, and
    the incidents they opened: where NaN, Inf and near-INF values and wrong products are caught."""
    items: list = [dash.Row("Every-step scan and checksums").grid_pos(GridPos(h=1, w=24, x=0, y=y))]
    y += 1
    layer = "{{piece}} {{metric}} {{layer}} {{layer_name}}"
    items += [
        _symlog(
            _ts(
                "Residual stream per block (max over ranks)",
                "stream_max: the largest |value| of each block's output, every step, largest over the ranks "
                "(values that are not finite are left out of the statistic: the incidents below name them). "
                "A near-INF value (|x| >= 1e10) stands out; a block is named by its module when the ranks "
                "sent their names.",
                GridPos(h=8, w=6, x=0, y=y),
                _q(f'sdcwatch_layer_metric{{{RUN}, {PIECE}, metric="stream_max", stat="max"}}', layer),
            )
        ),
        _symlog(
            _ts(
                "Product outputs (max over ranks)",
                "gemm_out: each checked matrix product's largest output row sum, every step, largest over "
                "the ranks; the index is the product (product 11), named by its module when known.",
                GridPos(h=8, w=6, x=6, y=y),
                _q(f'sdcwatch_layer_metric{{{RUN}, {PIECE}, metric="gemm_out", stat="max"}}', layer),
            )
        ),
        _symlog(
            _ts(
                "Checksums: residual over its rounding bound (max over ranks)",
                "gemm_fwd (forward product), gemm_bwd (weight gradient), gemm_weight (weights in memory): "
                "each product's largest checksum residual divided by its rounding bound, on checked steps "
                "(every 16th by default). Above 1 the product is wrong: the checksum detector raises it.",
                GridPos(h=8, w=6, x=12, y=y),
                _q(
                    f'sdcwatch_layer_metric{{{RUN}, {PIECE}, metric=~"gemm_fwd|gemm_bwd|gemm_weight", stat="max"}}',
                    layer,
                ),
            )
        ),
        _ts(
            "Non-finite values (worst rank)",
            "The largest count over the ranks of NaN and Inf values in the loss, the gradients and the "
            "probed activations at the last step.",
            GridPos(h=8, w=6, x=18, y=y),
            _q(f'sdcwatch_rank_metric{{{RUN}, {PIECE}, metric="nonfinite", stat="max"}}', "{{piece}} {{run}}"),
        ),
    ]
    y += 8
    info = f'sdcwatch_incident_info{{{RUN}, metric=~"{SCAN_METRICS}"}}'
    labels = "kind, state, rank, host, metric, layer, layer_name"
    items.append(
        table.Panel()
        .title("Caught by the scan and checksums")
        .description(
            "Open and recently resolved incidents on a scanned or checked metric: the rank, the metric "
            "(stream_max, gemm_out, the attention logits, gemm_fwd...), its index and module, the first step."
        )
        .datasource(DS)
        .grid_pos(GridPos(h=6, w=24, x=0, y=y))
        .no_value("nothing caught")
        .with_target(
            _q(
                f"sdcwatch_incident_first_step{{{RUN}}} * on (run, id) group_left ({labels}) {info}",
                instant=True,
                table_format=True,
            )
        )
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={"excludeByName": {"Time": True}, "renameByName": {"Value": "first step"}},
            )
        )
    )
    return items, y + 6


def _layers_row(y: int) -> tuple[list, int]:
    """The sampled attention statistics per layer."""
    items: list = [dash.Row("Layers").grid_pos(GridPos(h=1, w=24, x=0, y=y))]
    y += 1
    items += [
        _ts(
            "Attention entropy per layer (median over ranks)",
            "Median over ranks of each layer's attention entropy; collapse towards 0 is an attention-entropy "
            "collapse. Under pipeline parallelism a stage numbers its own layers: a series per piece and layer.",
            GridPos(h=8, w=8, x=0, y=y),
            _q(
                f'sdcwatch_layer_metric{{{RUN}, {PIECE}, metric="attn_entropy", stat="median"}}',
                "{{piece}} layer {{layer}} {{layer_name}}",
            ),
        ),
        _ts(
            "q/k norms per layer (max over ranks)",
            "Largest query and key norms of each layer over all ranks: runaway growth "
            "precedes attention-logit blow-ups.",
            GridPos(h=8, w=8, x=8, y=y),
            _q(
                f'sdcwatch_layer_metric{{{RUN}, {PIECE}, metric=~"q_norm_max|k_norm_max", stat="max"}}',
                "{{piece}} {{metric}} layer {{layer}} {{layer_name}}",
            ),
        ),
        _ts(
            "Largest attention logit per layer (max over ranks)",
            "Near-INF logits (|x| > 1e10) in attention drive training to a non-trainable state.",
            GridPos(h=8, w=8, x=16, y=y),
            _q(
                f'sdcwatch_layer_metric{{{RUN}, {PIECE}, metric="attn_logit_max", stat="max"}}',
                "{{piece}} layer {{layer}} {{layer_name}}",
            ),
        ),
    ]
    return items, y + 8


def _incidents_row(y: int) -> tuple[list, int]:
    """The open incidents and the guard's actions."""
    items: list = [dash.Row("Incidents").grid_pos(GridPos(h=1, w=24, x=0, y=y))]
    y += 1
    info = f'sdcwatch_incident_info{{{RUN}, state="open"}}'
    labels = "kind, severity, rank, host, layer, layer_name, metric, detector"
    items.append(
        table.Panel()
        .title("Open incidents")
        .description(
            "One row per open incident: where (rank, host, layer, metric), since which step, and the detector's score."
        )
        .datasource(DS)
        .grid_pos(GridPos(h=8, w=16, x=0, y=y))
        .with_target(
            _q(
                f"sdcwatch_incident_first_step{{{RUN}}} * on (run, id) group_left ({labels}) {info}",
                ref="A",
                instant=True,
                table_format=True,
            )
        )
        .with_target(
            _q(
                f"sdcwatch_incident_score{{{RUN}}} * on (run, id) group_left () {info}",
                ref="B",
                instant=True,
                table_format=True,
            )
        )
        .with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": {"Value #A": "first step", "Value #B": "score"},
                },
            )
        )
    )
    # no guard action yet is a line at 0 named "no actions", not Grafana's "No data"
    none = 'label_replace(vector(0), "action", "no actions", "", "")'
    items.append(
        _ts(
            "Guard actions",
            "Steps at which the training job's guard skipped an update, reran a "
            "step, rolled back or evicted a rank, per interval (each is also an incident "
            "guard_<action>); a line at 0 named no actions while it has not acted.",
            GridPos(h=8, w=8, x=16, y=y),
            _q(
                f"sum by (action) (increase(sdcwatch_guard_actions_total[$__rate_interval])) or on() {none}",
                "{{action}}",
            ),
        ).no_value("no actions")
    )
    return items, y + 8


def _pipeline_row(y: int) -> tuple[list, int]:
    """The ingest pipeline's health."""
    items: list = [dash.Row("Pipeline").grid_pos(GridPos(h=1, w=24, x=0, y=y))]
    y += 1
    items += [
        _ts(
            "Records per second",
            "Telemetry records consumed per second by the service.",
            GridPos(h=8, w=8, x=0, y=y),
            _q("sdcwatch_pipeline_records_per_second", "records/s"),
            unit="short",
        ),
        _ts(
            "Consumer lag",
            "Records between the service's position and the end of the telemetry topic.",
            GridPos(h=8, w=8, x=8, y=y),
            _q("sdcwatch_pipeline_consumer_lag_records", "lag"),
        ),
        _ts(
            "Age of the last step",
            "Seconds since the service completed the last step: grows when training or the pipeline stalls.",
            GridPos(h=8, w=8, x=16, y=y),
            _q(f"sdcwatch_pipeline_last_step_age_seconds{{{RUN}}}", "{{run}}"),
            unit="s",
        ),
    ]
    y += 8
    items += [
        _ts(
            "Late and missing ranks",
            "Ranks that missed the alignment deadline at the last step, and ranks not heard from for long.",
            GridPos(h=8, w=8, x=0, y=y),
            _q(f"sdcwatch_pipeline_late_ranks{{{RUN}}}", "late {{run}}", ref="A"),
            _q(f"sdcwatch_pipeline_missing_ranks{{{RUN}}}", "missing {{run}}", ref="B"),
        ),
        _ts(
            "Dead letters and duplicates",
            "Malformed records sent to the dead-letter topic "
            "and duplicates discarded, per second; with the service split in stages, step "
            "summaries that came too late for the temporal stage.",
            GridPos(h=8, w=8, x=8, y=y),
            _q("rate(sdcwatch_pipeline_dead_letters_total[$__rate_interval])", "dead letters", ref="A"),
            _q("rate(sdcwatch_pipeline_duplicates_total[$__rate_interval])", "duplicates", ref="B"),
            _q("rate(sdcwatch_pipeline_summaries_late_total[$__rate_interval])", "late summaries", ref="C"),
        ),
        _ts(
            "Records dropped by emitters",
            "Records the in-rank emitters dropped (buffer full or bus unreachable), per second.",
            GridPos(h=8, w=8, x=16, y=y),
            _q(f"rate(sdcwatch_emitter_dropped_records_total{{{RUN}}}[$__rate_interval])", "{{run}}"),
        ),
    ]
    return items, y + 8


def build_dashboard() -> dash.Dashboard:
    """The dashboard builder: rows for training, ranks, the every-step scan and checksums, layers,
    incidents and the pipeline."""
    d = (
        dash.Dashboard("sdcwatch: silent data corruption and loss spikes")
        .uid(DASHBOARD_UID)
        .description(
            "Training health as seen by the sdcwatch detector service: global loss and gradient "
            "norm with incident annotations, spike scores, rank outliers, the every-step non-finite "
            "scan and the matrix checksums, per-layer attention statistics, open incidents and "
            "ingest pipeline health."
        )
        .tags(["sdcwatch", "training", "sdc"])
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .variables(_variables())
        .annotation(_annotation())
    )
    y = 0
    for row in (_training_row, _ranks_row, _scan_row, _layers_row, _incidents_row, _pipeline_row):
        items, y = row(y)
        for item in items:
            d = d.with_row(item) if isinstance(item, dash.Row) else d.with_panel(item)
    return d


def build_model():
    """The built dashboard model, panels numbered 1..n in layout order (stable ids for links)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Prefer using dashboardv2", DeprecationWarning)
        model = build_dashboard().build()
    for number, panel in enumerate(model.panels or [], start=1):
        panel.id_val = number
    return model


def render() -> str:
    """The dashboard JSON exactly as committed (sorted keys, two-space indent, final newline)."""
    model = build_model()
    return JSONEncoder(sort_keys=True, indent=2).encode(model) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where to write (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the file is out of date")
    args = parser.parse_args(argv)
    text = render()
    json.loads(text)  # the encoder's output must be plain JSON
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python dashboards/generate.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
