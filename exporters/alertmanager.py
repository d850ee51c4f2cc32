"""Pushes incidents to Alertmanager's v2 API (``POST /api/v2/alerts``), one alert per incident. Open
alerts are re-sent every ``refresh_interval`` with an ``endsAt`` a few intervals ahead, as Prometheus
does (they resolve by themselves if sdcwatch dies); a resolved one is sent once with its end.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import Incident, IncidentEvent
from sdcwatch.core.model_place import noun_of
from sdcwatch.core.validate import check_number

from .collector import incident_coords_label, incident_rank_label
from .delivery import BackgroundSink, Backoff, DeliveryError, PostFn, encode_json, post_json

__all__ = ["AlertmanagerSink", "alert_for", "alertname_for"]

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
#: Open alerts are valid for this many refresh intervals (Prometheus uses 4 resend delays).
VALIDITY_INTERVALS = 4
#: Longest evidence annotation, in characters (Alertmanager keeps annotations in memory).
EVIDENCE_LIMIT = 4000


def alertname_for(kind: str) -> str:
    """``sdc_suspected`` -> ``SdcwatchSdcSuspected``: one alert name per incident kind."""
    return "Sdcwatch" + "".join(part[:1].upper() + part[1:] for part in kind.split("_") if part)


def _rfc3339(wall: float) -> str:
    return datetime.fromtimestamp(wall, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _describe(inc: Incident) -> str:
    score = float(inc.score)
    at = f"{noun_of(inc.metric)} {inc.layer}" if inc.layer is not None else None  # a product or a block is not a layer
    parts = [
        f"{inc.kind.replace('_', ' ')} on run {inc.run}",
        f"steps {inc.first_step}-{inc.last_step}",
        f"peak at step {inc.peak_step}" if inc.peak_step is not None else None,
        "rank " + incident_rank_label(inc.ranks, limit=32) if inc.ranks else None,
        "host " + ",".join(dict.fromkeys(inc.hosts)) if inc.hosts else None,
        "coords " + incident_coords_label(inc.coords, limit=32) if inc.coords else None,
        at + f" ({inc.layer_name})" if at and inc.layer_name else at,
        f"metric {inc.metric}" if inc.metric else None,
        f"score {score:.3g}" if math.isfinite(score) else f"score {score}",
        f"detector {inc.detector}" if inc.detector else None,
        f"resolved at step {inc.resolved_step}" if inc.resolved_step is not None else None,
    ]
    return "; ".join(p for p in parts if p is not None)


def alert_for(inc: Incident, *, now: float, valid_for: float, extra_labels: Mapping[str, str] = ()) -> dict[str, Any]:
    """The Alertmanager v2 alert of ``inc`` at wall time ``now``: open, it ends at ``now + valid_for``;
    resolved, at its resolution. Labels with an empty value are left out (absent to Alertmanager)."""
    labels = {
        **dict(extra_labels),
        "alertname": alertname_for(inc.kind),
        "run": inc.run,
        "severity": inc.severity.value,
        "kind": inc.kind,
        "incident": inc.id,
        "rank": incident_rank_label(inc.ranks),
        "host": ",".join(dict.fromkeys(h for h in inc.hosts if h)),
        "coords": incident_coords_label(inc.coords),
        "layer": "" if inc.layer is None else str(inc.layer),
        "metric": inc.metric,
        "source": "sdcwatch",
    }
    evidence = json.dumps(inc.to_dict()["evidence"], sort_keys=True, default=str)
    if len(evidence) > EVIDENCE_LIMIT:
        evidence = evidence[: EVIDENCE_LIMIT - 15] + "...(truncated)"
    starts = inc.opened_at if inc.opened_at > 0 else now
    ends = now + valid_for if inc.open else (inc.resolved_at if inc.resolved_at is not None else now)
    return {
        "labels": {k: str(v) for k, v in labels.items() if v != ""},
        "annotations": {
            "summary": inc.message or _describe(inc),
            "description": _describe(inc),
            "evidence": evidence,
        },
        "startsAt": _rfc3339(starts),
        "endsAt": _rfc3339(max(ends, starts)),
    }


class AlertmanagerSink(BackgroundSink):
    """An :class:`IncidentSink` that keeps Alertmanager's view of sdcwatch incidents current; ``url``
    is its base URL (``http://alertmanager:9093``), ``clock`` the wall clock for ``startsAt``/``endsAt``."""

    def __init__(
        self,
        url: str,
        *,
        refresh_interval: float = 60.0,
        timeout: float = 5.0,
        backoff: Backoff | None = None,
        extra_labels: Mapping[str, str] | None = None,
        post: PostFn = post_json,
        clock: Callable[[], float] = time.time,
        max_queue: int = 10_000,
    ) -> None:
        super().__init__("alertmanager", url, timeout=timeout, backoff=backoff, post=post, max_queue=max_queue)
        check_number("alertmanager.refresh_interval", refresh_interval, 0, lo_open=True)
        for name in extra_labels or {}:
            if not _LABEL_NAME.match(name):
                raise ConfigError("alertmanager.extra_labels", f"{name!r} is not a valid label name")
        base = url.rstrip("/")
        self.endpoint = base if base.endswith("/api/v2/alerts") else base + "/api/v2/alerts"
        self.refresh_interval = float(refresh_interval)
        self.extra_labels = dict(extra_labels or {})
        self._clock = clock
        self._open: dict[str, Incident] = {}  # incident id -> latest state, re-sent on refresh
        self._pending: dict[str, Incident] = {}  # incident id -> state not yet accepted
        # incident id -> labels Alertmanager last accepted: when an incident changes kind, severity
        # or ranks its alert's identity changes, and the old alert must be ended, not left to expire
        self._accepted: dict[str, dict[str, str]] = {}
        self._next_refresh = time.monotonic() + self.refresh_interval
        self._start()

    def _handle(self, events: list[IncidentEvent]) -> None:
        for event in events:
            inc = event.incident
            if event.change == "resolved" or not inc.open:
                self._open.pop(inc.id, None)
            else:
                self._open[inc.id] = inc
            self._pending[inc.id] = inc
        if self._retry_at is None:
            self._send()

    def _due(self) -> float | None:
        return self._next_refresh if self._retry_at is None else min(self._retry_at, self._next_refresh)

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_refresh:
            self._next_refresh = now + self.refresh_interval
            for inc_id, inc in self._open.items():
                self._pending.setdefault(inc_id, inc)
        if self._retry_at is None or now >= self._retry_at:
            self._send()

    def _final(self) -> None:
        if self._pending:
            self._send()

    def _send(self) -> None:
        if not self._pending:
            self._retry_at = None
            return
        now = self._clock()
        valid_for = VALIDITY_INTERVALS * self.refresh_interval
        batch = dict(self._pending)
        alerts = []
        labels: dict[str, dict[str, str]] = {}  # incident id -> its alert's labels
        for inc_id, inc in batch.items():
            alert = alert_for(inc, now=now, valid_for=valid_for, extra_labels=self.extra_labels)
            labels[inc_id] = alert["labels"]
            previous = self._accepted.get(inc_id)
            if previous is not None and previous != alert["labels"]:
                alerts.append({**alert, "labels": previous, "endsAt": _rfc3339(max(now, inc.opened_at))})
            alerts.append(alert)
        try:
            self._post(self.endpoint, encode_json(alerts), self.timeout)
        except (DeliveryError, ValueError, OSError) as exc:
            self._retry_later("alertmanager: %d alert(s) not delivered (%s)", len(alerts), exc)
            return
        self._backoff.succeeded()
        self._retry_at = None
        self.sent += len(alerts)
        for inc_id, inc in batch.items():
            if inc.open:
                self._accepted[inc_id] = labels[inc_id]
            else:
                self._accepted.pop(inc_id, None)
        self._pending.clear()
