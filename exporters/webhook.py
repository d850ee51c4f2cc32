"""Posts every incident change as JSON to a generic webhook (chat bridges, ticketing, custom tools):
``{"version": 1, "change": "opened|updated|resolved", "incident": Incident.to_dict()}``, in order,
each retried with backoff up to ``max_attempts`` times, then given up and counted.
"""

from __future__ import annotations

import logging
from collections import deque

from sdcwatch.core.incident import IncidentEvent
from sdcwatch.core.validate import check_int, redact_url

from .delivery import BackgroundSink, Backoff, DeliveryError, PostFn, encode_json, post_json

__all__ = ["WebhookSink", "WEBHOOK_PAYLOAD_VERSION", "webhook_payload"]

log = logging.getLogger(__name__)

WEBHOOK_PAYLOAD_VERSION = 1


def webhook_payload(event: IncidentEvent) -> dict:
    """The JSON object posted for ``event``."""
    return {"version": WEBHOOK_PAYLOAD_VERSION, "change": event.change, "incident": event.incident.to_dict()}


class WebhookSink(BackgroundSink):
    """An :class:`IncidentSink` that POSTs each incident change to ``url``; ``given_up`` counts the
    events dropped after ``max_attempts``."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        max_attempts: int = 8,
        backoff: Backoff | None = None,
        post: PostFn = post_json,
        max_queue: int = 10_000,
    ) -> None:
        super().__init__("webhook", url, timeout=timeout, backoff=backoff, post=post, max_queue=max_queue)
        check_int("webhook.max_attempts", max_attempts, lo=1)
        self.url = url
        self.max_attempts = max_attempts
        self.given_up = 0
        self._pending: deque[bytes] = deque()
        self._attempts = 0  # failed attempts of the event at the head of _pending
        self._start()

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

    def _drain(self) -> None:
        while self._pending:
            if not self._attempt(final=False):
                return

    def _attempt(self, *, final: bool) -> bool:
        body = self._pending[0]
        try:
            self._post(self.url, body, self.timeout)
        except (DeliveryError, OSError) as exc:
            self._attempts += 1
            if final:
                self.failures += 1
                return False
            if self._attempts >= self.max_attempts:
                self._pending.popleft()
                self.given_up += 1
                self._attempts = 0
                log.error("webhook: gave up on an event after %d attempts: %s", self.max_attempts, exc)
            self._retry_later("webhook: delivery to %s failed (%s)", redact_url(self.url), exc)
            return False
        self._pending.popleft()
        self._attempts = 0
        self._backoff.succeeded()
        self.sent += 1
        return True
