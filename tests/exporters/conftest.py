"""Fixtures for the exporter tests: a capturing HTTP receiver and a real Alertmanager."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


def _load_support():
    name = "sdcwatch_exporter_test_support"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_support.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


support = _load_support()


class Receiver:
    """An HTTP endpoint on loopback that records every JSON POST; ``fail_next`` answers 503."""

    def __init__(self) -> None:
        self.bodies: list = []
        self.paths: list[str] = []
        self.fail_next = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    if receiver.fail_next > 0:
                        receiver.fail_next -= 1
                        status = 503
                    else:
                        receiver.bodies.append(json.loads(body))
                        receiver.paths.append(self.path)
                        status = 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def snapshot(self) -> list:
        with self._lock:
            return list(self.bodies)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="session")
def alertmanager(tmp_path_factory):
    """A real Alertmanager whose only receiver posts to ``alertmanager.notifications``."""
    notifications = Receiver()
    server = support.start_alertmanager(tmp_path_factory.mktemp("alertmanager"), notifications.url + "/notify")
    server.notifications = notifications
    yield server
    server.stop()
    notifications.close()
