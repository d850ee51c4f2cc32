"""A prometheus-client custom collector that turns the detector service's :class:`ServiceView` into
metric families at scrape time, with bounded cardinality: per-rank series for the top-K ranks and
those of open incidents only, statistics within ``max_pieces`` and ``max_layers``
(:mod:`~sdcwatch.exporters.statistics_series`); ``sdcwatch_exporter_omitted`` counts the rest."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import Incident, PipelineView, RunView, ServiceView
from sdcwatch.core.kinds import guard_action_of
from sdcwatch.core.mesh import format_coords
from sdcwatch.core.metric_spec import MetricSpec
from sdcwatch.core.rank_notes import CheckpointMark
from sdcwatch.core.validate import check_choice, check_int, check_number

from .catalog import STATS, catalogue, metric
from .metrics_settings import (
    DEFAULT_LAYER_STATS,
    DEFAULT_MAX_HOSTS,
    DEFAULT_MAX_LAYERS,
    DEFAULT_MAX_PIECES,
    DEFAULT_TOP_K,
    check_cardinality,
)
from .statistics_series import (
    add_layer_stats,
    add_stats,
    bounded_label,
    by_piece,
    exported_layers,
    exported_pieces,
    index_names,
    layer_extents,
)

__all__ = [
    "SdcwatchCollector",
    "MAX_RANKS_PER_INCIDENT",
    "MAX_INCIDENTS_LISTED",
    "incident_rank_label",
    "incident_coords_label",
]

log = logging.getLogger(__name__)

#: Most ranks of one incident exported individually: an SDC names one rank or a few; an incident
#: naming every rank (an optimisation instability) is not rank-local and must not blow up
#: cardinality, so only its first ranks get series.
MAX_RANKS_PER_INCIDENT = 8
#: Most incidents described by ``sdcwatch_incident_*`` series (open ones first, then newest).
MAX_INCIDENTS_LISTED = 50
#: How a family gets one sample: ``add(metric name, label values, value)``.
_AddSample = Callable[[str, Sequence[str], float], None]


def _capped(texts: Sequence[str], limit: int, sep: str = ",") -> str:
    """``texts`` joined by ``sep``, those past ``limit`` counted: ``1,2,...(+30)``."""
    more = f"{sep}...(+{len(texts) - limit})" if len(texts) > limit else ""
    return sep.join(texts[:limit]) + more


def incident_rank_label(ranks: Sequence[int], limit: int = 8) -> str:
    """The ``rank`` label of an incident: ``"5"``, ``"5,9"``, or ``"1,2,...(+30)"`` past ``limit``."""
    return _capped([str(int(r)) for r in ranks], limit)


def incident_coords_label(coords: Sequence[dict[str, int]], limit: int = 8) -> str:
    """The coordinates of an incident's ranks (``pp=0,dp_replicate=2,tp=1``), ``;``-separated; empty
    when the records carry none."""
    texts = [format_coords(c) for c in coords]
    return _capped(texts, limit, ";") if any(texts) else ""


class SdcwatchCollector(Collector):
    """Exposes detector, incident and pipeline state; register it in a ``CollectorRegistry``.

    ``view_fn`` is called once per scrape and must return quickly; if it raises, the scrape shows
    only ``sdcwatch_exporter_view_errors_total``. ``clock`` gives wall time for the age metrics.
    """

    def __init__(
        self,
        view_fn: Callable[[], ServiceView],
        *,
        top_k: int = DEFAULT_TOP_K,
        layer_stats: Sequence[str] = DEFAULT_LAYER_STATS,
        scalar_stats: Sequence[str] = STATS,
        layer_metrics: Sequence[str] | None = None,
        max_layers: int = DEFAULT_MAX_LAYERS,
        max_pieces: int = DEFAULT_MAX_PIECES,
        max_hosts: int = DEFAULT_MAX_HOSTS,
        cache_seconds: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not callable(view_fn):
            raise ConfigError("exporter.view_fn", f"must be callable, got {type(view_fn).__name__}")
        check_cardinality(top_k=top_k, max_layers=max_layers, max_pieces=max_pieces)
        check_number("exporter.cache_seconds", cache_seconds, 0)
        self.max_hosts = check_int("metrics.max_hosts", max_hosts, lo=0)
        for key, stats in (("exporter.layer_stats", layer_stats), ("exporter.scalar_stats", scalar_stats)):
            if isinstance(stats, str):
                raise ConfigError(key, f"must be a list of statistics, got {stats!r}")
            for name in stats:
                check_choice(key, name, STATS)
        self.view_fn = view_fn
        self.top_k = top_k
        self.layer_stats = tuple(layer_stats)
        self.scalar_stats = tuple(scalar_stats)
        self.layer_metrics = None if layer_metrics is None else frozenset(layer_metrics)
        self.max_layers = max_layers
        self.max_pieces = max_pieces
        self._capped_runs: set[str] = set()  # runs whose pieces past max_pieces were logged
        self.cache_seconds = float(cache_seconds)
        self.clock = clock
        self._view_errors = 0
        self._cache: tuple[float, list[Metric]] | None = None
        self._cache_lock = threading.Lock()  # concurrent scrapes wait for one render, then share it

    def describe(self) -> Iterable[Metric]:
        """Empty families of the service's own metrics, so the registry can detect name clashes up
        front (the detectors' come with the runs)."""
        return [self._family(spec) for spec in catalogue()]

    def collect(self) -> Iterator[Metric]:
        if not self.cache_seconds:
            return self._collect()
        with self._cache_lock:
            now = time.monotonic()
            if self._cache is None or now - self._cache[0] >= self.cache_seconds:
                self._cache = (now, list(self._collect()))
            return iter(self._cache[1])

    def _collect(self) -> Iterator[Metric]:
        try:
            view = self.view_fn()
            families = self._families(view, self.clock())
        except Exception:  # a broken view must not take the scrape (or the service) down
            self._view_errors += 1
            log.exception("sdcwatch exporter: reading the service view failed")
            families = {}
        errors = self._family(metric("sdcwatch_exporter_view_errors_total"))
        errors.add_metric([], self._view_errors)
        families["sdcwatch_exporter_view_errors_total"] = errors
        yield from (family for family in families.values() if family.samples)

    @staticmethod
    def _family(spec: MetricSpec) -> Metric:
        if spec.kind == "counter":
            return CounterMetricFamily(spec.family, spec.help, labels=spec.labels)
        if spec.kind == "info":
            return InfoMetricFamily(spec.family, spec.help, labels=())
        return GaugeMetricFamily(spec.family, spec.help, labels=spec.labels)

    def _families(self, view: ServiceView, now: float) -> dict[str, Metric]:
        """Every family filled from one view, in catalogue order (the detectors' as the runs declare them)."""
        owned: dict[str, MetricSpec] = {}
        for run in view.runs:
            for spec in run.detector_metrics:
                owned.setdefault(spec.name, spec)
        fam = {spec.name: self._family(spec) for spec in catalogue(list(owned.values()))}

        def add(name: str, labels: Sequence[str], value: float) -> None:
            fam[name].add_metric([str(v) for v in labels], float(value))

        open_incidents: dict[str, list[Incident]] = {}
        for inc in view.incidents:
            if inc.open:
                open_incidents.setdefault(inc.run, []).append(inc)
        omitted = [self._add_run(fam, add, run, open_incidents.get(run.run, []), now) for run in view.runs]
        self._add_incidents(fam, view, open_incidents)
        _add_findings(add, view)
        _add_checkpoints(add, view.checkpoints)
        _add_pipeline(add, view.pipeline, now)
        add("sdcwatch_exporter_omitted", ["runs"], max(0, view.pipeline.runs_total - len(view.runs)))
        add("sdcwatch_exporter_omitted", ["layers"], sum(layers for layers, _ in omitted))
        add("sdcwatch_exporter_omitted", ["pieces"], sum(pieces for _, pieces in omitted))
        add("sdcwatch_exporter_omitted", ["hosts"], _add_hosts(add, view.hosts, self.max_hosts))
        return fam

    def _add_run(
        self,
        fam: dict[str, Metric],
        add: _AddSample,
        run: RunView,
        incidents: list[Incident],
        now: float,
    ) -> tuple[int, int]:
        """One run's series; returns the (piece, layer) pairs and pieces left out."""
        r = run.run
        add("sdcwatch_training_last_step", [r], run.last_step)
        add("sdcwatch_training_steps_total", [r], run.steps_total)
        add("sdcwatch_training_world_size", [r], run.world)
        add("sdcwatch_training_run_finished", [r], 1 if run.finished else 0)
        for spec in run.detector_metrics:
            value = run.detector_values[spec.name]
            if spec.per_rank:
                for rank in self._exported_ranks(value, incidents):
                    add(spec.name, [r, rank, run.hosts[rank] if rank < len(run.hosts) else ""], value[rank])
            elif isinstance(value, Mapping):
                for key, number in sorted(value.items()):
                    add(spec.name, [r, key], number)
            else:
                add(spec.name, [r], value)
        n = len(run.pieces)
        scalars = {k: by_piece(v, n, False) for k, v in run.scalar_stats.items()}
        layer_stats = {
            k: by_piece(v, n, True)
            for k, v in run.layer_stats.items()
            if self.layer_metrics is None or k in self.layer_metrics
        }
        extents = layer_extents(run, layer_stats)  # the indices each metric has: no NaN padding
        limit = MAX_RANKS_PER_INCIDENT
        pieces = exported_pieces(run, scalars, layer_stats, extents, incidents, self.max_pieces, limit)
        self._note_capped_pieces(run, len(pieces))
        add_stats(fam["sdcwatch_rank_metric"], run, scalars, self.scalar_stats, pieces)
        pairs, n_pairs = exported_layers(run, layer_stats, extents, pieces, incidents, self.max_layers, limit)
        names = index_names(run)
        add_layer_stats(fam["sdcwatch_layer_metric"], run, layer_stats, self.layer_stats, pairs, extents, names)
        add("sdcwatch_pipeline_late_ranks", [r], run.late_ranks)
        add("sdcwatch_emitter_dropped_records_total", [r], run.emitter_dropped)
        if run.last_step_wall > 0:
            add("sdcwatch_pipeline_last_step_age_seconds", [r], max(0.0, now - run.last_step_wall))
        return n_pairs - len(pairs), n - len(pieces) + run.pieces_omitted

    def _note_capped_pieces(self, run: RunView, shown: int) -> None:
        """Log, once a run, that a run has more model pieces than get statistics series."""
        total = len(run.pieces) + run.pieces_omitted
        if shown < total and run.run not in self._capped_runs:
            if len(self._capped_runs) >= 1000:  # logged once a run; the memory of it bounded
                self._capped_runs.clear()
            self._capped_runs.add(run.run)
            log.warning(
                "sdcwatch exporter: run %s has %d model pieces, statistics series for %d (metrics.max_pieces)",
                run.run,
                total,
                shown,
            )

    def _exported_ranks(self, values: np.ndarray, incidents: list[Incident]) -> list[int]:
        """Top-K ranks by a per-rank metric's ``values`` (ties to the lower rank) plus open-incident
        ranks, sorted."""
        scores = np.asarray(values, dtype=np.float64).reshape(-1)
        n, k = scores.shape[0], self.top_k
        chosen = set(range(n)) if k >= n else set()
        if 0 < k < n:
            # NaN evidence means something is badly wrong with that rank: rank it first. The k-th
            # largest value, then every rank above it plus the lowest ranks at it
            key = np.where(np.isnan(scores), np.inf, scores)
            kth = np.partition(key, n - k)[n - k]
            above = np.flatnonzero(key > kth)
            chosen = {*above.tolist(), *np.flatnonzero(key == kth)[: k - above.size].tolist()}
        for inc in incidents:
            chosen.update(int(r) for r in inc.ranks[:MAX_RANKS_PER_INCIDENT] if 0 <= int(r) < n)
        return sorted(chosen)

    @staticmethod
    def _add_incidents(fam: dict[str, Metric], view: ServiceView, open_incidents: dict[str, list[Incident]]) -> None:
        # Open counts: one series per (run, kind, severity) ever counted, zero when none is open,
        # so alert rules and panels see a 0 instead of "no data".
        open_counts = Counter({(run.run, kind, sev): 0 for run in view.runs for kind, sev in view.incidents_total})
        for run_id, incidents in open_incidents.items():
            open_counts.update((run_id, inc.kind, inc.severity.value) for inc in incidents)
        for key, count in sorted(open_counts.items()):
            fam["sdcwatch_incidents_open"].add_metric(list(key), count)
        for (kind, severity), count in sorted(view.incidents_total.items()):
            fam["sdcwatch_incidents_total"].add_metric([kind, str(severity)], count)

        listed = sorted(view.incidents, key=lambda i: (not i.open, -i.last_step, i.id))[:MAX_INCIDENTS_LISTED]
        for inc in sorted(listed, key=lambda i: (i.run, i.id)):
            fam["sdcwatch_incident_info"].add_metric(
                [],
                {
                    "run": inc.run,
                    "id": inc.id,
                    "kind": inc.kind,
                    "severity": inc.severity.value,
                    "state": "open" if inc.open else "resolved",
                    "rank": incident_rank_label(inc.ranks),
                    "host": _capped(list(dict.fromkeys(h for h in inc.hosts if h)), 8),
                    "layer": "" if inc.layer is None else str(inc.layer),
                    "layer_name": bounded_label(inc.layer_name or ""),
                    "metric": inc.metric,
                    "detector": inc.detector,
                },
            )
            ident = [inc.run, inc.id]
            fam["sdcwatch_incident_first_step"].add_metric(ident, inc.first_step)
            fam["sdcwatch_incident_last_step"].add_metric(ident, inc.last_step)
            fam["sdcwatch_incident_score"].add_metric(ident, float(inc.score))


def _add_findings(add: _AddSample, view: ServiceView) -> None:
    """Findings by detector and kind, and the guard actions they stand for."""
    for (detector, kind), count in sorted(view.findings_total.items()):
        add("sdcwatch_detector_findings_total", [detector, kind], count)
        action = guard_action_of(kind)
        if action is not None:
            add("sdcwatch_guard_actions_total", [action], count)


def _add_hosts(add: _AddSample, verdicts: Sequence, limit: int) -> int:
    """A series per suspect or quarantined host (``verdicts`` worst first), at most ``limit``; the
    counts of hosts tracked and flagged. Returns the flagged hosts left without a series."""
    flagged = [v for v in verdicts if v.verdict in ("suspect", "quarantine")]
    for v in flagged[:limit]:
        add("sdcwatch_host_verdict", [v.host, v.verdict], 1)
    add("sdcwatch_hosts_tracked", [], len(verdicts))
    add("sdcwatch_hosts_suspect", [], len(flagged))
    return max(0, len(flagged) - limit)


def _add_checkpoints(add: _AddSample, marks: Sequence[CheckpointMark]) -> None:
    """The runs' recent checkpoints (newest first per run, the service bounds
    them) by slot, and each run's newest clean one."""
    slots: dict[str, int] = {}
    newest_clean: dict[str, int] = {}
    for m in marks:
        slot = slots[m.run] = slots.get(m.run, -1) + 1
        add("sdcwatch_checkpoint_step", [m.run, str(slot), m.mark], m.step)
        if m.mark == "clean" and m.step > newest_clean.get(m.run, -1):
            newest_clean[m.run] = m.step
    for run, step in newest_clean.items():
        add("sdcwatch_checkpoint_newest_clean_step", [run], step)


def _add_pipeline(add: _AddSample, p: PipelineView, now: float) -> None:
    """The pipeline's health: input, lag, dead letters, partitions, offset gaps, runs, alignment, stages."""
    add("sdcwatch_pipeline_records_total", [], p.records_total)
    add("sdcwatch_pipeline_records_per_second", [], p.records_per_second)
    add("sdcwatch_pipeline_consumer_lag_records", [], p.consumer_lag)
    add("sdcwatch_pipeline_dead_letters_total", [], p.dead_letters_total)
    for reason, count in sorted(p.dead_letter_reasons.items()):
        add("sdcwatch_pipeline_dead_letters_by_reason_total", [reason], count)
    for (key, reason), count in sorted(p.auth_runs_refused.items()):
        add("sdcwatch_auth_runs_refused_total", [key, reason], count)
    for key, count in sorted(p.auth_redelivered.items()):
        add("sdcwatch_auth_redelivered_total", [key], count)
    add("sdcwatch_pipeline_late_records_total", [], p.late_records_total)
    if p.consumer_partitions >= 0:
        add("sdcwatch_pipeline_consumer_partitions", [], p.consumer_partitions)
        add("sdcwatch_pipeline_consumer_rebalances_total", [], p.consumer_rebalances_total)
    add("sdcwatch_pipeline_messages_waiting_for_schema", [], p.waiting_for_schema)
    for outcome, count in sorted(p.offset_gaps.items()):
        add("sdcwatch_pipeline_offset_gaps_total", [outcome], count)
    add("sdcwatch_state_write_errors_total", [], p.state_write_errors_total)
    for reason, count in sorted(p.state_topic_refused.items()):
        add("sdcwatch_state_topic_refused_total", [reason], count)
    add("sdcwatch_pipeline_runs", [], p.runs_total)
    add("sdcwatch_pipeline_runs_forgotten_total", [], p.runs_forgotten_total)
    add("sdcwatch_pipeline_duplicates_total", [], p.duplicates_total)
    add("sdcwatch_pipeline_world_changes_total", [], p.world_changes_total)
    add("sdcwatch_pipeline_incomplete_steps_total", [], p.incomplete_steps_total)
    add("sdcwatch_pipeline_summaries_total", [], p.summaries_total)
    add("sdcwatch_pipeline_summaries_late_total", [], p.summaries_late_total)
    for reason, count in sorted(p.runs_evicted_total.items()):
        add("sdcwatch_pipeline_runs_evicted_total", [reason], count)
    if p.last_record_wall > 0:
        add("sdcwatch_pipeline_last_record_age_seconds", [], max(0.0, now - p.last_record_wall))
