"""Builds the sdcwatch Grafana dashboard (dashboards/sdcwatch.json, Grafana 12's classic JSON model,
with grafana-foundation-sdk==0.0.21) and the metrics table of dashboards/README.md, both with every
registered detector's metrics. ``python dashboards/generate.py`` rewrites them (``--check``: exit 1
if either is out of date).
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

from sdcwatch.detectors.registry import detector_metrics
from sdcwatch.exporters.catalog import catalogue

__all__ = ["DASHBOARD_UID", "OUTPUT", "README", "build_dashboard", "build_model", "render", "render_readme", "main"]

DASHBOARD_UID = "sdcwatch-overview"
OUTPUT = Path(__file__).resolve().parent / "sdcwatch.json"
README = OUTPUT.with_name("README.md")
TABLE_MARKS = ("<!-- metrics table: made by dashboards/generate.py -->", "<!-- end of the metrics table -->")

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run=~"$run"'  # the runs picked in $run
PIECE = 'piece=~"$piece"'  # the model pieces picked in $piece (All also matches a series without one)


def _q(expr: str, legend: str = "") -> PromQuery:
    """A query on ``$datasource`` (its ref id set by the panel that takes it)."""
    query = PromQuery().expr(expr).datasource(DS)
    return query.legend_format(legend) if legend else query


def _stat_q(family: str, metric: str, stat: str, legend: str) -> PromQuery:
    """The cross-rank statistic ``stat`` of ``sdcwatch_<family>_metric`` for the metrics ``metric``
    matches (``="x"`` or ``=~"x|y"``)."""
    return _q(f'sdcwatch_{family}_metric{{{RUN}, {PIECE}, metric{metric}, stat="{stat}"}}', legend)


def _incident_q(what: str, labels: str, info: str) -> str:
    """``sdcwatch_incident_<what>`` of the incidents ``info`` selects, with their ``labels``."""
    return f"sdcwatch_incident_{what}{{{RUN}}} * on (run, id) group_left ({labels}) {info}"


def _with(panel, title: str, description: str, *queries: PromQuery):
    """``panel`` titled, described, on ``$datasource``, with ``queries`` (refs A, B, ... in order)."""
    panel = panel.title(title).description(description).datasource(DS)
    for ref, query in zip("ABCDEFGH", queries):
        panel = panel.with_target(query.ref_id(ref))
    return panel


def _ts(title: str, description: str, *queries: PromQuery, unit: str = "", symlog: bool = False) -> timeseries.Panel:
    """A time series panel; ``symlog``: a log axis that keeps 0 and negative values."""
    legend = VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
    panel = _with(timeseries.Panel().legend(legend).line_width(1).fill_opacity(0), title, description, *queries)
    if symlog:
        panel = panel.scale_distribution(
            ScaleDistributionConfig().type(ScaleDistribution.SYMLOG).log(10).linear_threshold(1)
        )
    return panel.unit(unit) if unit else panel


def _table(title: str, description: str, *exprs: str, rename: dict[str, str]) -> table.Panel:
    """An instant table of ``exprs`` (merged when several), without the time column."""
    queries = [_q(expr).instant().format(PromQueryFormat.TABLE) for expr in exprs]  # instant: not a range
    panel = _with(table.Panel(), title, description, *queries)
    if len(queries) > 1:
        panel = panel.with_transformation(DataTransformerConfig(id_val="merge", options={}))
    options = {"excludeByName": {"Time": True}, "renameByName": rename}
    return panel.with_transformation(DataTransformerConfig(id_val="organize", options=options))


def _row(title: str, y: int, *lines: tuple[int, list]) -> tuple[list, int]:
    """A row from ``y``: each line ``(height, panels)`` fills the width in equal shares (a list in
    ``panels`` stacks its panels in one share)."""
    items: list = [dash.Row(title).grid_pos(GridPos(h=1, w=24, x=0, y=y))]
    y += 1
    for height, panels in lines:
        width = 24 // len(panels)
        for i, panel in enumerate(panels):
            stacked = panel if isinstance(panel, list) else [panel]
            for j, one in enumerate(stacked):
                h = height // len(stacked)
                items.append(one.grid_pos(GridPos(h=h, w=width, x=i * width, y=y + j * h)))
        y += height
    return items, y


def _variable(name: str, label: str, query: str, description: str) -> dash.QueryVariable:
    """A multi-value query variable with All (``.*``), refreshed with the time range."""
    return (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(query)
        .definition(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .description(description)
    )


def _variables() -> list:
    """$datasource, $run and $piece."""
    datasource = (
        dash.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .description("Prometheus that scrapes the sdcwatch service.")
    )
    run = _variable(
        "run",
        "Run",
        "label_values(sdcwatch_training_last_step, run)",
        "Training run(s), from the run label of the exporter's series.",
    )
    piece = _variable(
        "piece",
        "Model piece",
        f"label_values(sdcwatch_rank_metric{{{RUN}}}, piece)",
        "Model piece(s) under tensor or pipeline parallelism (pp stage, tp rank...: the ranks the "
        "detectors compare); a plain data-parallel run has one piece and no values here.",
    )
    return [datasource, run, piece]


def _annotation() -> dash.AnnotationQuery:
    """A region per incident, spanning the time its info series exists (open to resolution)."""
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


#: Metrics of the every-step scan and the checksums, whose incidents the scan row lists.
SCAN_METRICS = "stream_max|gemm_out|attn_logit_max|attn_logit_min|gemm_fwd|gemm_bwd|gemm_weight|gemm_in"


def _training_row(y: int) -> tuple[list, int]:
    """Loss, gradient norm, last step, open incidents, incidents opened, the spread across ranks."""
    loss = _ts(
        "Global loss",
        "Latest global loss (mean over ranks) per completed step. Red regions: open incidents.",
        _q(f"sdcwatch_training_loss{{{RUN}}}", "{{run}}"),
    )
    grad_norm = _ts(
        "Global gradient norm",
        "Global gradient norm per completed step.",
        _q(f"sdcwatch_training_grad_norm{{{RUN}}}", "{{run}}"),
    )
    last = _with(
        stat.Panel(),
        "Last step",
        "Last training step the service completed.",
        _q(f"max by (run) (sdcwatch_training_last_step{{{RUN}}})", "{{run}}"),
    )
    open_now = _with(
        stat.Panel(),
        "Open incidents",
        "Incidents currently open, all kinds (0 when none ever opened).",
        _q(f"sum(sdcwatch_incidents_open{{{RUN}}}) or on() vector(0)", "open"),
    )
    opened = _ts(
        "Incidents opened",
        "Incidents opened per interval, by kind and severity.",
        _q("sum by (kind, severity) (increase(sdcwatch_incidents_total[$__rate_interval]))", "{{kind}} {{severity}}"),
    )
    spread = _ts(
        "Per-rank spread of scalars",
        "Across-rank min, quartiles and max of the local gradient norm and loss: a single rank far outside "
        "the band is suspect. Under tensor or pipeline parallelism one band per model piece (its ranks hold "
        "the same piece).",
        _q(f'sdcwatch_rank_metric{{{RUN}, {PIECE}, metric=~"grad_norm_local|loss"}}', "{{piece}} {{metric}} {{stat}}"),
    )
    return _row("Training", y, (8, [loss, grad_norm, [last, open_now]]), (8, [opened, spread]))


def _detector_panel(spec):
    """The panel of a detector's metric: a heatmap of a per-rank one, else a series per label value."""
    query = f"{spec.name}{{{RUN}}}"
    if spec.kind == "counter":
        query = f"increase({query}[$__rate_interval])"
    if spec.per_rank:
        return _with(heatmap.Panel().calculate(False), spec.panel, spec.help, _q(query, "rank {{rank}} {{host}}"))
    return _ts(spec.panel, spec.help, _q(query, " ".join(f"{{{{{label}}}}}" for label in spec.labels)))


def _detectors_row(y: int) -> tuple[list, int]:
    """A panel for each metric a registered detector declares with a panel title, two abreast."""
    panels = [_detector_panel(spec) for spec in detector_metrics() if spec.panel]
    lines = [(9, panels[i : i + 2]) for i in range(0, len(panels), 2)]
    return _row("Detectors", y, *lines)


def _scan_row(y: int) -> tuple[list, int]:
    """The every-step non-finite scan, the matrix checksums, and the incidents they opened."""
    layer = "{{piece}} {{metric}} {{layer}} {{layer_name}}"
    info = f'sdcwatch_incident_info{{{RUN}, metric=~"{SCAN_METRICS}"}}'
    labels = "kind, state, rank, host, metric, layer, layer_name"
    panels = [
        _ts(
            "Residual stream per block (max over ranks)",
            "stream_max: the largest |value| of each block's output, every step, largest over the ranks "
            "(values that are not finite are left out of the statistic: the incidents below name them). "
            "A near-INF value (|x| >= 1e10) stands out; a block is named by its module when the ranks "
            "sent their names.",
            _stat_q("layer", '="stream_max"', "max", layer),
            symlog=True,
        ),
        _ts(
            "Product outputs (max over ranks)",
            "gemm_out: each checked matrix product's largest output row sum, every step, largest over "
            "the ranks; the index is the product (product 11), named by its module when known.",
            _stat_q("layer", '="gemm_out"', "max", layer),
            symlog=True,
        ),
        _ts(
            "Checksums: residual over its rounding bound (max over ranks)",
            "gemm_fwd (forward product), gemm_bwd (weight gradient), gemm_weight (weights in memory): "
            "each product's largest checksum residual divided by its rounding bound, on checked steps "
            "(every 16th by default). Above 1 the product is wrong: the checksum detector raises it.",
            _stat_q("layer", '=~"gemm_fwd|gemm_bwd|gemm_weight"', "max", layer),
            symlog=True,
        ),
        _ts(
            "Non-finite values (worst rank)",
            "The largest count over the ranks of NaN and Inf values in the loss, the gradients and the "
            "probed activations at the last step.",
            _stat_q("rank", '="nonfinite"', "max", "{{piece}} {{run}}"),
        ),
    ]
    caught = _table(
        "Caught by the scan and checksums",
        "Open and recently resolved incidents on a scanned or checked metric: the rank, the metric "
        "(stream_max, gemm_out, the attention logits, gemm_fwd...), its index and module, the first step.",
        _incident_q("first_step", labels, info),
        rename={"Value": "first step"},
    ).no_value("nothing caught")
    return _row("Every-step scan and checksums", y, (8, panels), (6, [caught]))


def _layers_row(y: int) -> tuple[list, int]:
    """The sampled attention statistics per layer."""
    layer = "{{piece}} layer {{layer}} {{layer_name}}"
    panels = [
        _ts(
            "Attention entropy per layer (median over ranks)",
            "Median over ranks of each layer's attention entropy; collapse towards 0 is an attention-entropy "
            "collapse. Under pipeline parallelism a stage numbers its own layers: a series per piece and layer.",
            _stat_q("layer", '="attn_entropy"', "median", layer),
        ),
        _ts(
            "q/k norms per layer (max over ranks)",
            "Largest query and key norms of each layer over all ranks: runaway growth "
            "precedes attention-logit blow-ups.",
            _stat_q("layer", '=~"q_norm_max|k_norm_max"', "max", "{{piece}} {{metric}} layer {{layer}} {{layer_name}}"),
        ),
        _ts(
            "Largest attention logit per layer (max over ranks)",
            "Near-INF logits (|x| > 1e10) in attention drive training to a non-trainable state.",
            _stat_q("layer", '="attn_logit_max"', "max", layer),
        ),
    ]
    return _row("Layers", y, (8, panels))


def _incidents_row(y: int) -> tuple[list, int]:
    """The open incidents and the guard's actions."""
    info = f'sdcwatch_incident_info{{{RUN}, state="open"}}'
    labels = "kind, severity, rank, host, layer, layer_name, metric, detector"
    incidents = _table(
        "Open incidents",
        "One row per open incident: where (rank, host, layer, metric), since which step, and the detector's score.",
        _incident_q("first_step", labels, info),
        _incident_q("score", "", info),
        rename={"Value #A": "first step", "Value #B": "score"},
    )
    # no guard action yet is a line at 0 named "no actions", not Grafana's "No data"
    none = 'label_replace(vector(0), "action", "no actions", "", "")'
    guard = _ts(
        "Guard actions",
        "Steps at which the training job's guard skipped an update, reran a "
        "step, rolled back or evicted a rank, per interval (each is also an incident "
        "guard_<action>); a line at 0 named no actions while it has not acted.",
        _q(
            f"sum by (action) (increase(sdcwatch_guard_actions_total[$__rate_interval])) or on() {none}",
            "{{action}}",
        ),
    ).no_value("no actions")
    return _row("Incidents", y, (8, [incidents, guard]))


def _fleet_row(y: int) -> tuple[list, int]:
    """The hosts the service judges across runs (not filtered by $run: a verdict spans runs)."""
    tracked = _with(
        stat.Panel(),
        "Hosts tracked",
        "Hosts whose evidence across runs the service keeps.",
        _q("max(sdcwatch_hosts_tracked)", "tracked"),
    )
    flagged_now = _with(
        stat.Panel(),
        "Hosts suspect or quarantined",
        "Hosts the service judges suspect or quarantine from the evidence of several runs.",
        _q("max(sdcwatch_hosts_suspect)", "flagged"),
    )
    # no flagged host is a row "none", not Grafana's "No data"
    none = 'label_replace(vector(0), "verdict", "none", "", "")'
    flagged = _table(
        "Suspect and quarantined hosts",
        "One row per flagged host (at most metrics.max_hosts, worst first) and its verdict; a row none while "
        "no host is flagged. 'sdcwatch hosts' lists the evidence (runs, kinds, since when); 'sdcwatch hosts "
        "drain-commands' prints the scheduler lines; 'sdcwatch hosts clear HOST --reason ...' records a "
        "repair (docs/hosts.md).",
        f"max by (host, verdict) (sdcwatch_host_verdict) or on() {none}",
        rename={"Value": "flagged"},
    )
    over_time = _ts(
        "Flagged hosts over time",
        "Hosts suspect or quarantined (0 while none is).",
        _q("max(sdcwatch_hosts_suspect)", "suspect or quarantine"),
    )
    return _row("Fleet: hosts across runs", y, (8, [[tracked, flagged_now], flagged, over_time]))


def _pipeline_row(y: int) -> tuple[list, int]:
    """The ingest pipeline's health."""
    first = [
        _ts(
            "Records per second",
            "Telemetry records consumed per second by the service.",
            _q("sdcwatch_pipeline_records_per_second", "records/s"),
            unit="short",
        ),
        _ts(
            "Consumer lag",
            "Records between the service's position and the end of the telemetry topic.",
            _q("sdcwatch_pipeline_consumer_lag_records", "lag"),
        ),
        _ts(
            "Age of the last step",
            "Seconds since the service completed the last step: grows when training or the pipeline stalls.",
            _q(f"sdcwatch_pipeline_last_step_age_seconds{{{RUN}}}", "{{run}}"),
            unit="s",
        ),
    ]
    second = [
        _ts(
            "Late and missing ranks",
            "Ranks that missed the alignment deadline at the last step, and ranks not heard from for long.",
            _q(f"sdcwatch_pipeline_late_ranks{{{RUN}}}", "late {{run}}"),
            _q(f"sdcwatch_pipeline_missing_ranks{{{RUN}}}", "missing {{run}}"),
        ),
        _ts(
            "Dead letters and duplicates",
            "Malformed records sent to the dead-letter topic "
            "and duplicates discarded, per second; with the service split in stages, step "
            "summaries that came too late for the temporal stage.",
            _q("rate(sdcwatch_pipeline_dead_letters_total[$__rate_interval])", "dead letters"),
            _q("rate(sdcwatch_pipeline_duplicates_total[$__rate_interval])", "duplicates"),
            _q("rate(sdcwatch_pipeline_summaries_late_total[$__rate_interval])", "late summaries"),
        ),
        _ts(
            "Records dropped by emitters",
            "Records the in-rank emitters dropped (buffer full or bus unreachable), per second.",
            _q(f"rate(sdcwatch_emitter_dropped_records_total{{{RUN}}}[$__rate_interval])", "{{run}}"),
        ),
    ]
    return _row("Pipeline", y, (8, first), (8, second))


def build_dashboard() -> dash.Dashboard:
    """The dashboard builder, row by row."""
    d = (
        dash.Dashboard("sdcwatch: silent data corruption and loss spikes")
        .uid(DASHBOARD_UID)
        .description(
            "Training health as seen by the sdcwatch detector service: global loss and gradient "
            "norm with incident annotations, spike scores, rank outliers, the every-step non-finite "
            "scan and the matrix checksums, per-layer attention statistics, open incidents, the "
            "hosts suspect across runs and ingest pipeline health."
        )
        .tags(["sdcwatch", "training", "sdc"])
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .variables(_variables())
        .annotation(_annotation())
    )
    y = 0
    for row in (_training_row, _detectors_row, _scan_row, _layers_row, _incidents_row, _fleet_row, _pipeline_row):
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


def render_readme(readme: str) -> str:
    """``readme`` with its metrics table (between :data:`TABLE_MARKS`) made from the whole catalogue."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in catalogue(detector_metrics()):
        kind = "info (gauge 1)" if spec.kind == "info" else spec.kind
        rows.append(f"| `{spec.name}` | {kind} | {', '.join(spec.labels)} | {spec.help.replace('|', '/')} |")
    head, rest = readme.split(TABLE_MARKS[0], 1)
    return head + TABLE_MARKS[0] + "\n" + "\n".join(rows) + "\n" + TABLE_MARKS[1] + rest.split(TABLE_MARKS[1], 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where to write (default: %(default)s)")
    parser.add_argument("--readme", type=Path, default=README, help="its metrics table (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    text = render()
    json.loads(text)  # the encoder's output must be plain JSON
    readme = args.readme.read_text()
    wanted = {args.output: text, args.readme: render_readme(readme)}
    stale = [path for path, content in wanted.items() if (path.read_text() if path.exists() else "") != content]
    if args.check:
        for path in stale:
            print(f"{path} is out of date: run python dashboards/generate.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
