"""Queued, retried delivery of incident events to an HTTP receiver, off the detection thread: the
queue, worker thread and retry state the HTTP sinks share (:class:`BackgroundSink`), the retry
schedule (:class:`Backoff`) and the default transport (:func:`post_json`, standard library only).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable
from typing import Any

from sdcwatch.core.errors import ConfigError, DeliveryError
from sdcwatch.core.incident import IncidentEvent
from sdcwatch.core.validate import check_int, check_number, redact_url, url_problem

__all__ = ["BackgroundSink", "Backoff", "PostFn", "post_json", "encode_json", "check_url"]

log = logging.getLogger(__name__)

#: ``post(url, body, timeout)`` -> HTTP status; raises :class:`DeliveryError` on failure.
PostFn = Callable[[str, bytes, float], int]


def _credentials(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without user info, and the Basic authorization header it carried (if any)."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, {}
    host = parts.netloc.rpartition("@")[2]
    user = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=host)), {"Authorization": f"Basic {token}"}


def post_json(url: str, body: bytes, timeout: float) -> int:
    """POST ``body`` (already JSON) to ``url``; the status on 2xx, :class:`DeliveryError` otherwise.
    Credentials in the URL are sent as HTTP Basic authorization; errors show the URL without them."""
    shown = redact_url(url)
    try:
        target, auth = _credentials(url)
    except ValueError as exc:
        raise DeliveryError(f"{shown}: {exc}") from None
    request = urllib.request.Request(
        target, data=body, method="POST", headers={"Content-Type": "application/json", **auth}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        detail = exc.read(512).decode("utf-8", "replace").strip()
        raise DeliveryError(f"{shown}: HTTP {exc.code} {detail}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DeliveryError(f"{shown}: {exc}") from exc


def check_url(key: str, url: Any) -> None:
    """Raise ConfigError(``key``) unless ``url`` is an http(s) URL with a host (never showing its password)."""
    problem = url_problem(url) if isinstance(url, str) else f"must be an http(s) URL, got {type(url).__name__}"
    if problem:
        raise ConfigError(key, problem)


def encode_json(payload: Any) -> bytes:
    """Strict JSON (no NaN/Infinity tokens: receivers such as Alertmanager reject them)."""
    return json.dumps(payload, allow_nan=False, separators=(",", ":"), default=str).encode("utf-8")


class Backoff:
    """Exponential retry delays: ``initial``, x``factor`` each failure, capped at ``maximum``."""

    def __init__(self, initial: float = 0.5, maximum: float = 30.0, factor: float = 2.0) -> None:
        check_number("sink.backoff_initial", initial, 0, lo_open=True)
        check_number("sink.backoff_max", maximum, initial)
        check_number("sink.backoff_factor", factor, 1)
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self._failures = 0

    def failed(self) -> float:
        """Record a failure; the delay to wait before the next attempt."""
        delay = min(self.maximum, self.initial * self.factor**self._failures)
        self._failures += 1
        return delay

    def succeeded(self) -> None:
        self._failures = 0


class BackgroundSink:
    """Base of the sinks that POST to ``url`` from their own thread (``label`` names their settings).
    Subclasses implement :meth:`_handle`, :meth:`_due` (when to :meth:`_tick` next), keep what awaits
    delivery in ``_pending`` and :meth:`_start` once set up; past ``max_queue`` the oldest event is ``dropped``.
    """

    def __init__(
        self,
        label: str,
        url: str,
        *,
        timeout: float,
        backoff: Backoff | None,
        post: PostFn,
        max_queue: int,
    ) -> None:
        check_url(f"{label}.url", url)
        check_number(f"{label}.timeout", timeout, 0, lo_open=True)
        check_int("sink.max_queue", max_queue, lo=1)
        self.timeout = float(timeout)
        self.max_queue = max_queue
        self.sent = 0
        self.failures = 0
        self.dropped = 0
        self._post = post
        self._backoff = backoff or Backoff()
        self._retry_at: float | None = None
        self._queue: deque[IncidentEvent] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._idle = True
        self._thread = threading.Thread(target=self._run, name=f"sdcwatch-{label}", daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def publish(self, event: IncidentEvent) -> None:
        """Queue ``event``; returns at once and never raises."""
        try:
            with self._cond:
                if self._closing:
                    self.dropped += 1
                    return
                if len(self._queue) >= self.max_queue:
                    self._queue.popleft()
                    self.dropped += 1
                self._queue.append(event)
                self._idle = False
                self._cond.notify()
        except Exception:  # pragma: no cover - publish must never raise into detection
            log.exception("%s: could not queue an incident event", self._thread.name)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued event has been handled and nothing awaits retry; True if so."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self._idle and not self._queue):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(remaining, 0.05))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued (one last attempt each), then stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    due = self._due()
                    if due is not None and due <= time.monotonic():
                        break
                    self._cond.wait(None if due is None else max(0.0, due - time.monotonic()))
                batch = list(self._queue)
                self._queue.clear()
                closing = self._closing
            try:
                if batch:
                    self._handle(batch)
                due = self._due()
                if due is not None and due <= time.monotonic():
                    self._tick()
                if closing:
                    self._final()
            except Exception:  # the worker must survive any bug in a subclass or receiver
                log.exception("%s: delivery step failed", self._thread.name)
            with self._cond:
                self._idle = self._settled()
                self._cond.notify_all()
                if closing and not self._queue:
                    return

    def _handle(self, events: list[IncidentEvent]) -> None:
        raise NotImplementedError

    def _due(self) -> float | None:
        raise NotImplementedError

    def _tick(self) -> None:
        raise NotImplementedError

    def _final(self) -> None:
        """Called once while closing: make a last delivery attempt of anything pending."""

    def _settled(self) -> bool:
        """True when nothing awaits (re)delivery; :meth:`flush` waits for this."""
        return not self._pending

    def _retry_later(self, message: str, *args: Any) -> None:
        """Count a failed POST and set the retry after the backoff, logging ``message % args`` and the delay."""
        self.failures += 1
        delay = self._backoff.failed()
        self._retry_at = time.monotonic() + delay
        logging.getLogger(type(self).__module__).warning(message + "; retrying in %.1fs", *args, delay)
