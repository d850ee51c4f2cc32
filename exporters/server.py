"""Serves ``/metrics`` for the detector service from its own ``CollectorRegistry`` (exactly the
catalogue, no process collectors), on loopback unless told otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import ServiceView

from .collector import SdcwatchCollector
from .metrics_settings import DEFAULT_METRICS_ADDRESS, DEFAULT_METRICS_PORT, check_address, check_port

__all__ = ["MetricsServer"]


class MetricsServer:
    """An HTTP server for ``/metrics`` fed by ``view_fn`` at every scrape (``port=0``: a free one);
    scrapes within ``cache_seconds`` share one rendering. Other options are :class:`SdcwatchCollector`'s."""

    def __init__(
        self,
        view_fn: Callable[[], ServiceView],
        *,
        address: str = DEFAULT_METRICS_ADDRESS,
        port: int = DEFAULT_METRICS_PORT,
        cache_seconds: float = 1.0,
        **collector_options: Any,
    ) -> None:
        check_address(address)
        check_port(port)
        self.address = address
        self.registry = CollectorRegistry(auto_describe=True)
        self.collector = SdcwatchCollector(view_fn, cache_seconds=cache_seconds, **collector_options)
        self.registry.register(self.collector)
        self._requested_port = port
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the requested one until started)."""
        if self._httpd is not None:
            return int(self._httpd.server_address[1])
        return self._requested_port

    @property
    def url(self) -> str:
        """Where Prometheus should scrape, e.g. ``http://127.0.0.1:9400/metrics``."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> "MetricsServer":
        """Bind and serve from a daemon thread; ``ConfigError`` if the address cannot be bound."""
        if self._httpd is not None:
            return self
        try:
            self._httpd, self._thread = start_http_server(
                self._requested_port, addr=self.address, registry=self.registry
            )
        except OSError as exc:
            raise ConfigError("metrics.port", f"cannot listen on {self.address}:{self._requested_port}: {exc}") from exc
        self._httpd.socket.listen(128)  # the default backlog of 5 resets a burst of concurrent scrapers
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> "MetricsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
