"""Writes one log line per incident change, in logfmt (default) or JSON, to a standard logger at
the incident's level (INFO for resolutions): the sink that always works, no network, no queue.
"""

from __future__ import annotations

import json
import logging
import math
import re

from sdcwatch.core.incident import IncidentEvent, Severity
from sdcwatch.core.validate import check_choice

from .collector import incident_coords_label, incident_rank_label

__all__ = ["LogSink", "format_logfmt", "format_json"]

_BARE = re.compile(r"^[A-Za-z0-9_.,:/+\-]+$")
_LEVELS = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.CRITICAL: logging.ERROR}


def _logfmt_value(value: object) -> str:
    text = str(value)
    if text and _BARE.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _fields(event: IncidentEvent) -> list[tuple[str, object]]:
    """The line's fields, in order; one whose value is None is left out."""
    inc = event.incident
    score = float(inc.score)
    fields = [
        ("incident", event.change),
        ("id", inc.id),
        ("run", inc.run),
        ("kind", inc.kind),
        ("severity", inc.severity.value),
        ("steps", f"{inc.first_step}-{inc.last_step}"),
        ("rank", incident_rank_label(inc.ranks, limit=32) if inc.ranks else None),
        ("host", ",".join(dict.fromkeys(inc.hosts)) if inc.hosts else None),
        ("coords", incident_coords_label(inc.coords, limit=32) if inc.coords else None),
        ("layer", inc.layer),
        ("layer_name", inc.layer_name or None),
        ("metric", inc.metric or None),
        ("score", f"{score:.4g}" if math.isfinite(score) else str(score)),
        ("detector", inc.detector or None),
        ("resolved_step", inc.resolved_step),
        ("message", inc.message),
    ]
    return [(key, value) for key, value in fields if value is not None]


def format_logfmt(event: IncidentEvent) -> str:
    """``incident=opened id=... run=... kind=... severity=... steps=a-b rank=5 ... message="..."``."""
    return " ".join(f"{key}={_logfmt_value(value)}" for key, value in _fields(event))


def format_json(event: IncidentEvent) -> str:
    """One JSON object: ``{"change": ..., "incident": Incident.to_dict()}`` on a single line."""
    return json.dumps({"change": event.change, "incident": event.incident.to_dict()}, sort_keys=True, default=str)


class LogSink:
    """An :class:`IncidentSink` that logs each incident change on one line."""

    def __init__(self, logger: logging.Logger | str = "sdcwatch.incidents", *, format: str = "logfmt") -> None:
        self.format = check_choice("log_sink.format", format, ("logfmt", "json"))
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self._formatter = format_logfmt if format == "logfmt" else format_json

    def publish(self, event: IncidentEvent) -> None:
        """Log ``event``; never raises."""
        try:
            level = (
                logging.INFO if event.change == "resolved" else _LEVELS.get(event.incident.severity, logging.WARNING)
            )
            self.logger.log(level, "%s", self._formatter(event))
        except Exception:  # a logging failure must not reach the detection loop
            logging.getLogger(__name__).exception("log sink: could not log an incident event")

    def close(self) -> None:
        """Nothing to release; present for the :class:`IncidentSink` protocol."""
