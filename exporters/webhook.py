"""Posts every incident change as JSON to a generic webhook (chat bridges, ticketing, custom tools).

Body: ``{"version": 1, "change": "opened|updated|resolved", "incident": Incident.to_dict()}``.
Events are delivered in order from a background thread; a failing receiver is retried with
exponential backoff up to ``max_attempts`` per event, then that event is given up and counted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping

from sdcwatch.core.incident import IncidentEvent
from sdcwatch.core.validate import check_int, check_number, redact_url

from .delivery import BackgroundSink, Backoff, DeliveryError, PostFn, check_url, encode_json, post_json

__all__ = ["WebhookSink", "WEBHOOK_PAYLOAD_VERSION", "webhook_payload"]

log = logging.getLogger(__name__)

WEBHOOK_PAYLOAD_VERSION = 1


def webhook_payload(event: IncidentEvent) -> dict:
    """The JSON object posted for ``event``."""
    return {"version": WEBHOOK_PAYLOAD_VERSION, "change": event.change, "incident": event.incident.to_dict()}


class WebhookSink(BackgroundSink):
    """An :class:`IncidentSink` that POSTs each incident change to ``url``.

    Counters: :attr:`sent`, :attr:`failures` (failed attempts), :attr:`given_up` (events dropped
    after ``max_attempts``), :attr:`dropped` (queue overflow).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        max_attempts: int = 8,
        backoff: Backoff | None = None,
        headers: Mapping[str, str] | None = None,
        post: PostFn = post_json,
        max_queue: int = 10_000,
    ) -> None:
        check_url("webhook.url", url)
        check_number("webhook.timeout", timeout, 0, lo_open=True)
        check_int("webhook.max_attempts", max_attempts, lo=1)
        self.url = url
        self.timeout = float(timeout)
        self.max_attempts = max_attempts
        self.headers = dict(headers or {})
        self.sent = 0
        self.failures = 0
        self.given_up = 0
        self._post = post
        self._backoff = backoff or Backoff()
        self._pending: deque[bytes] = deque()
        self._attempts = 0  # failed attempts of the event at the head of _pending
        self._retry_at: float | None = None
        super().__init__(name="sdcwatch-webhook", max_queue=max_queue)

    def _handle(self, events: list[IncidentEvent]) -> None:
        for event in events:
            try:
                self._pending.append(encode_json(webhook_payload(event)))
            except (TypeError, ValueError) as exc:
                self.given_up += 1
                log.error("webhook: incident %s cannot be encoded as JSON: %s", event.incident.id, exc)
        if self._retry_at is None:
            self._drain()

    def _due(self) -> float | None:
        return self._retry_at

    def _tick(self) -> None:
        self._retry_at = None
        self._drain()

    def _final(self) -> None:
        # One last attempt per event, no waiting: closing must not hang on a dead receiver.
        while self._pending:
            if not self._attempt(final=True):
                self.given_up += len(self._pending)
                self._pending.clear()

    def _settled(self) -> bool:
        return not self._pending

    def _drain(self) -> None:
        while self._pending:
            if not self._attempt(final=False):
                return

    def _attempt(self, *, final: bool) -> bool:
        body = self._pending[0]
        try:
            self._post(self.url, body, self.headers, self.timeout)
        except (DeliveryError, OSError) as exc:
            self.failures += 1
            self._attempts += 1
            if final:
                return False
            if self._attempts >= self.max_attempts:
                self._pending.popleft()
                self.given_up += 1
                self._attempts = 0
                log.error("webhook: gave up on an event after %d attempts: %s", self.max_attempts, exc)
            delay = self._backoff.failed()
            self._retry_at = time.monotonic() + delay
            log.warning("webhook: delivery to %s failed (%s); retrying in %.1fs", redact_url(self.url), exc, delay)
            return False
        self._pending.popleft()
        self._attempts = 0
        self._backoff.succeeded()
        self.sent += 1
        return True
