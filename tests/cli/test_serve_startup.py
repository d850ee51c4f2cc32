"""`sdcwatch serve` with no broker at its address: it says at once what it is waiting for, and its
error (after ``--connect-timeout`` seconds, 30 by default) names the address and how to get a bus.
Before, the service printed nothing for those 30 s, then only kafka-python's timeout.

Two instances of one group started before their telemetry topic exists: the first stays.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from polling import wait_for

from sdcwatch.broker import free_port

pytestmark = pytest.mark.integration


def test_serve_without_a_broker_says_where_it_connects_then_how_to_get_a_bus(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    cmd = [sys.executable, "-m", "sdcwatch.cli", "serve", "--bus-bootstrap", address, "--metrics-port", "0"]
    cmd += ["--state-dir", str(tmp_path / "state"), "--connect-timeout", "2"]  # each client gives up after 2 s
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:  # that the first line comes while serve still waits is the next test's: a signal then interrupts it
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = err.splitlines()
    text = "\n".join(lines)
    assert proc.returncode == 2, text
    first = lines[0]
    assert first.startswith(f"sdcwatch serve: connecting to Kafka at {address}"), text
    error = lines[-1]
    assert error.startswith(f"sdcwatch serve: error: cannot connect to Kafka at {address}"), text
    assert "sdcwatch broker" in error, text


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_connect_timeout_that_is_not_above_zero_is_refused_naming_the_setting(tmp_path, value):
    out = subprocess.run(
        [sys.executable, "-m", "sdcwatch.cli", "serve", "--connect-timeout", value, "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"bus.connect_timeout_s: must be a number > 0, got {float(value)}" in out.stderr, out.stderr
    assert "connecting to Kafka" not in out.stderr, out.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_while_connecting_stops_serve_at_once(tmp_path, sig):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there: serve waits in the connection
    cmd = [sys.executable, "-m", "sdcwatch.cli", "serve", "--bus-bootstrap", address, "--metrics-port", "0"]
    cmd += ["--state-dir", str(tmp_path / "state")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert first.startswith("sdcwatch serve: connecting to Kafka"), first
        time.sleep(1.0)  # the signal lands inside the connection attempt: the case tested, not a wait
        proc.send_signal(sig)
        # not after the bus wait (about 30 s), which would end in exit status 2 anyway
        wait_for(lambda: proc.poll() is not None, 20, f"serve to stop after {sig.name}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode in (130, -sig), proc.returncode
    if proc.returncode == 130:  # stopped by the signal, it says so rather than end in silence
        rest = proc.stderr.read()
        assert "sdcwatch serve: interrupted" in rest, rest


@pytest.mark.slow
def test_of_two_instances_started_before_the_topic_exists_the_first_stays_and_finds_the_nan(bootstrap, tmp_path):
    """Before: both joined the group before the topic existed, each was given half of it when it
    appeared, and both exited with status 2 (no monitor at all). Now the first creates the topic (as
    the emitters would): the second, which finds it, is the newcomer that leaves (status 2, as
    documented); the first stays, takes every partition and finds the NaN at its step and rank."""
    from serve_process import ServeProcess, Topics, rank_emitters, train_ranks

    topics = Topics.fresh()
    group = f"first-stays-{topics.telemetry}"
    share = ("--bus-share-timeout-s", "3")
    first = ServeProcess(bootstrap, topics, tmp_path / "first", *share, group=group, metrics_port=0)
    second = None
    emitters = []
    try:
        first.wait_banner()
        second = ServeProcess(bootstrap, topics, tmp_path / "second", *share, group=group, metrics_port=0)
        second.wait_banner()
        assert second.wait(120) == 2
        assert "another instance shares its consumer group" in second.stderr()
        first.wait_line(lambda ln: "assigned partitions [0, 1, 2, 3]" in ln, 60, "the first to hold the whole topic")
        emitters = rank_emitters(bootstrap, topics.telemetry)
        train_ranks(emitters, range(20), lambda step, rank, loss: float("nan") if (step, rank) == (12, 2) else loss)
        nan = first.wait_incident("nonfinite", 90)
        assert nan["first_step"] == 12 and nan["ranks"] == [2], nan
        assert first.running()
    finally:
        for em in emitters:
            em.close(5)
        first.close()
        if second is not None:
            second.close()
