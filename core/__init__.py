"""The shared leaf: concepts every layer of sdcwatch uses, defined once, each imported from its module.

- :mod:`~sdcwatch.core.errors`: the exception tree (also re-exported by :mod:`sdcwatch`);
- :mod:`~sdcwatch.core.validate`: the validators (each names the dotted key of a bad value);
- :mod:`~sdcwatch.core.jsonsafe`: one JSON codec for NaN/Inf and numpy arrays;
- :mod:`~sdcwatch.core.vocabulary`: topic names and metric-name lists;
- :mod:`~sdcwatch.core.kinds`: :class:`~sdcwatch.core.kinds.IncidentKind` and its sets;
- every message, declared once with its codec: :mod:`~sdcwatch.core.messages`; the wire record
  and its codecs :mod:`~sdcwatch.core.record_type`, :mod:`~sdcwatch.core.record`,
  :mod:`~sdcwatch.core.record_json`, :mod:`~sdcwatch.core.record_layout`, :mod:`~sdcwatch.core.columnar`;
  the layer names and checkpoint notes a rank sends :mod:`~sdcwatch.core.rank_notes`; what a record
  may claim :mod:`~sdcwatch.core.limits`; job keys :mod:`~sdcwatch.core.signing`; parallel
  coordinates :mod:`~sdcwatch.core.mesh`;
- the guard's wire :mod:`~sdcwatch.core.control`; findings, incidents and views
  :mod:`~sdcwatch.core.incident`, rendered in words by :mod:`~sdcwatch.core.model_place`; a metric
  family on ``/metrics`` (the exporter's or a detector's own) :mod:`~sdcwatch.core.metric_spec`;
- Kafka clients :mod:`~sdcwatch.core.kafka`; lazy package attributes :mod:`~sdcwatch.core.lazy`.

This package imports nothing of the project (and nothing heavier than numpy), so the in-rank
telemetry, the detectors, the service, the exporters and the CLI may all import it.
"""
