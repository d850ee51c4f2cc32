"""The embedded broker: starts on loopback, refuses a taken port clearly, stops on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest
from polling import wait_for
from serve_process import run_cli
from sdcwatch.core.errors import BrokerError

from sdcwatch.broker import EmbeddedBroker, free_port

pytestmark = pytest.mark.integration


def test_starts_on_a_free_port_and_stops():
    with EmbeddedBroker(port=0) as b:
        assert b.running
        with socket.create_connection((b.host, b.port), timeout=2):
            pass
    assert not b.running
    with pytest.raises(OSError):
        socket.create_connection((b.host, b.port), timeout=1).close()


def test_taken_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} .* already in use"):
            EmbeddedBroker(port=port).start()


def refused(port: int) -> bool:
    """Whether a connection to ``port`` on the loopback is refused (nothing listens there)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def test_missing_binary_is_a_clear_error(tmp_path):
    with pytest.raises(BrokerError, match="does not exist"):
        EmbeddedBroker(port=0, binary=str(tmp_path / "no-tansu")).start()


def test_cli_broker_runs_until_sigterm():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdcwatch.cli", "broker", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert f"listening on 127.0.0.1:{port}" in line
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: refused(port), 30, f"port {port} to be closed")


def test_cli_broker_taken_port_exits_2_with_message():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run_cli("broker", "--port", str(port), timeout=30)
    assert out.returncode == 2
    assert f"port {port}" in out.stderr and "already in use" in out.stderr
