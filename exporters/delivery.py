"""Queued, retried delivery of incident events to an HTTP receiver, off the detection thread.

:class:`BackgroundSink` owns the queue and the worker thread that network sinks share:
``publish`` only appends under a short lock (never blocks on the network, never raises), the
worker drains the queue and hands batches to the subclass, and sleeps until the next event, retry
or timer. :class:`Backoff` is the retry schedule; :func:`post_json` the default HTTP transport
(standard library only), replaceable by any callable with the same signature (tests pass fakes).
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
from collections.abc import Callable, Mapping
from typing import Any

from sdcwatch.core.errors import ConfigError, DeliveryError
from sdcwatch.core.incident import IncidentEvent
from sdcwatch.core.validate import check_int, check_number, redact_url, url_problem

__all__ = ["BackgroundSink", "Backoff", "PostFn", "post_json", "encode_json", "check_url"]

log = logging.getLogger(__name__)

#: ``post(url, body, headers, timeout)`` -> HTTP status; raises :class:`DeliveryError` on failure.
PostFn = Callable[[str, bytes, Mapping[str, str], float], int]


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


def post_json(url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> int:
    """POST ``body`` (already JSON) to ``url``; the status on 2xx, :class:`DeliveryError` otherwise.

    Credentials in the URL (``https://user:password@host``) are sent as HTTP Basic authorization;
    errors name the URL with the password replaced by ``***``.
    """
    shown = redact_url(url)
    try:
        target, auth = _credentials(url)
    except ValueError as exc:
        raise DeliveryError(f"{shown}: {exc}") from None
    request = urllib.request.Request(
        target, data=body, method="POST", headers={"Content-Type": "application/json", **auth, **headers}
    )
    url = shown
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        detail = exc.read(512).decode("utf-8", "replace").strip()
        raise DeliveryError(f"{url}: HTTP {exc.code} {detail}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DeliveryError(f"{url}: {exc}") from exc


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

    @property
    def failures(self) -> int:
        """Consecutive failures since the last success."""
        return self._failures

    def failed(self) -> float:
        """Record a failure; the delay to wait before the next attempt."""
        delay = min(self.maximum, self.initial * self.factor**self._failures)
        self._failures += 1
        return delay

    def succeeded(self) -> None:
        self._failures = 0


class BackgroundSink:
    """Base of sinks that deliver from their own thread.

    Subclasses implement :meth:`_handle` (take new events; may try delivery) and optionally
    :meth:`_due` (the monotonic time of the next retry or timer, or ``None``) and
    :meth:`_tick` (called when that time has come). Both run on the worker thread only, so
    subclass state needs no lock. ``max_queue`` bounds memory when the worker cannot keep up: the
    oldest events are dropped and counted in :attr:`dropped`.

    The worker starts in this constructor: subclasses set up their own state first and call
    ``super().__init__`` last.
    """

    def __init__(self, *, name: str, max_queue: int = 10_000) -> None:
        check_int("sink.max_queue", max_queue, lo=1)
        self.max_queue = max_queue
        self.dropped = 0  # events lost because the queue was full
        self._queue: deque[IncidentEvent] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._idle = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the detection thread's side --------------------------------------------------------------

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

    # -- the worker -------------------------------------------------------------------------------

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
        return None

    def _tick(self) -> None:
        pass

    def _final(self) -> None:
        """Called once while closing: make a last delivery attempt of anything pending."""

    def _settled(self) -> bool:
        """True when nothing awaits (re)delivery; :meth:`flush` waits for this."""
        return True
