"""`sdcwatch serve` (and any other command) as a child process for the tests, what they read back
from it (its stderr lines, its /metrics samples and the topics it writes), and the ranks of a run
that feed it.

Each service runs on its own topics, consumer group, state folder and metrics port, so tests share
the session broker without seeing each other's records. Importable from every test folder
(``pythonpath = ["tests"]`` in pyproject.toml).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from polling import wait_for

from sdcwatch.broker import free_port

__all__ = [
    "BANNER",
    "ServeProcess",
    "Topics",
    "metric",
    "peek_events",
    "peek_topic",
    "rank_emitters",
    "run_cli",
    "scrape",
    "scrape_text",
    "train_ranks",
    "wait_finished",
    "wait_metric",
]

#: How `sdcwatch serve` says it is up (then: topic, group, stage, metrics URL or "off", state folder).
BANNER = "sdcwatch serve: consuming"


@dataclass(frozen=True)
class Topics:
    """The three topics a service reads and writes."""

    telemetry: str
    anomalies: str
    dead: str

    @classmethod
    def fresh(cls, tag: str | None = None) -> "Topics":
        """Topics no other test uses (``tel.<tag>``, ``anom.<tag>``, ``dead.<tag>``)."""
        tag = tag or uuid.uuid4().hex[:8]
        return cls(f"tel.{tag}", f"anom.{tag}", f"dead.{tag}")


class ServeProcess:
    """``sdcwatch serve`` started on ``topics`` with ``flags`` added to the command line.

    ``metrics_port`` None takes a free port, 0 turns the metrics server off; ``group`` None takes a
    fresh group; ``snapshot_interval_s`` None keeps the configured interval; ``prefix`` is a command
    the service runs under (it must exec it, so :attr:`pid` is the service's). stderr is collected in
    the background (a full pipe would block the service), so a test can wait for any line while the
    service runs; stdout is not read. Stop with :meth:`stop` (SIGTERM, exit code checked) or, when
    cleaning up after a failure, :meth:`close` (also the context manager's exit). With
    ``--auth-key-file`` among ``flags``, :meth:`events` believes only what the service signed.
    """

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        state_dir: Path,
        *flags: str,
        group: str | None = None,
        metrics_port: int | None = None,
        snapshot_interval_s: float | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.bootstrap, self.topics, self.state_dir = bootstrap, topics, Path(state_dir)
        self.key_file = flags[flags.index("--auth-key-file") + 1] if "--auth-key-file" in flags else None
        self.group = group or f"g-{uuid.uuid4().hex[:8]}"
        port = free_port() if metrics_port is None else metrics_port
        snapshots = () if snapshot_interval_s is None else ("--state-snapshot-interval-s", f"{snapshot_interval_s:g}")
        cmd = [
            *prefix,  # a wrapper the service runs under (e.g. a mount namespace of its own)
            sys.executable,
            "-m",
            "sdcwatch.cli",
            "serve",
            "--bus-bootstrap",
            bootstrap,
            "--bus-telemetry-topic",
            topics.telemetry,
            "--bus-anomalies-topic",
            topics.anomalies,
            "--bus-deadletter-topic",
            topics.dead,
            "--bus-group",
            self.group,
            "--metrics-port",
            str(port),
            "--state-dir",
            str(self.state_dir),
            *snapshots,
            "--no-alerts-log",
            *flags,
        ]
        self.banner: str | None = None
        self.metrics_url: str | None = None
        self.lines: list[str] = []
        self._terminated = False
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in iter(self.proc.stderr.readline, ""):
            self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        """What the service wrote to stderr so far."""
        return "".join(self.lines)

    def wait_line(self, pred: Callable[[str], object], timeout: float = 60.0, what: str = "a line") -> str:
        """The first stderr line for which ``pred`` is true; fails at once if the service exits first."""

        def found() -> str | None:
            exited = not self._reader.is_alive()  # before looking: every line is in by then
            line = next((ln for ln in list(self.lines) if pred(ln)), None)
            if line is None and exited:
                raise AssertionError(f"serve exited with {self.proc.wait()} before {what}")
            return line

        try:
            return wait_for(found, timeout, what, interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; serve said: {self.stderr()[-3000:]}") from None

    def wait_banner(self, timeout: float = 60.0) -> str | None:
        """Wait until the service is consuming; its metrics URL (None when metrics are off).
        A service that does not start is killed. :attr:`banner` holds the whole line."""
        try:
            self.banner = self.wait_line(lambda ln: ln.startswith(BANNER), timeout, "serve to start")
        except AssertionError:
            self.proc.kill()
            raise
        m = re.search(r"metrics (http://\S+);", self.banner)
        self.metrics_url = m.group(1) if m else None
        return self.metrics_url

    def scrape(self, timeout: float = 30.0) -> list:
        """The service's /metrics samples now."""
        return scrape(self.metrics_url, timeout)

    def events(self) -> list[dict]:
        """The incident changes on the service's anomalies topic now; with keys, those it signed."""
        from sdcwatch.core.signing import Keyring

        keyring = Keyring.from_file(self.key_file) if self.key_file is not None else None
        return peek_events(self.bootstrap, self.topics.anomalies, keyring=keyring)

    def wait_incident(self, kind: str, timeout: float = 90.0) -> dict:
        """The first ``opened`` event of an incident of ``kind``."""
        return wait_for(
            lambda: next((e for e in self.events() if e["change"] == "opened" and e["kind"] == kind), None),
            timeout,
            f"a {kind} incident on {self.topics.anomalies}",
            interval=0.5,
        )

    def terminate(self) -> None:
        """Ask the service to stop (SIGTERM), without waiting: to stop several at once."""
        if not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for the service to exit (and for the last of its stderr); its exit code."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def stop(self, timeout: float = 60.0) -> str:
        """SIGTERM, then wait: the service must exit 0 (after its final snapshot). Its stderr."""
        self.terminate()
        code = self.wait(timeout)
        assert code == 0, self.stderr()[-3000:]
        return self.stderr()

    def close(self) -> None:
        """Stop the service if it still runs (SIGTERM, then kill), checking nothing: for clean-up."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(10)

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def scrape_text(url: str, timeout: float = 30.0) -> str:
    """A /metrics page as text; OSError while it does not answer."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def scrape(url: str, timeout: float = 30.0) -> list:
    """Every sample on a /metrics page (prometheus_client's parser); OSError while it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for f in text_string_to_metric_families(scrape_text(url, timeout)) for s in f.samples]


def metric(samples: list, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 when there is none)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def peek_topic(bootstrap: str, topic: str, timeout: float = 3.0) -> list:
    """The messages ``topic`` holds now, however slow the broker is to answer, then any that come
    within ``timeout`` seconds of the last: one a service counted just now (a dead letter) may still
    be on its way."""
    return _read_now(bootstrap, topic, quiet=timeout)


def _read_now(bootstrap: str, topic: str, *, quiet: float = 0.0) -> list:
    """The messages ``topic`` holds now (none when it does not exist), read from the start to the end
    it had when asked, as ``sdcwatch incidents`` reads (no consumer group), then any that come within
    ``quiet`` seconds of the last."""
    from sdcwatch.bus_reading import read_to_end
    from sdcwatch.service.kafka_source import TopicReader

    reader = TopicReader(bootstrap, topic, from_beginning=True, connect_timeout=30)  # a loaded machine
    messages: list = []
    try:
        read_to_end(reader, messages.append, threading.Event())
        quiet_until = time.monotonic() + quiet
        while time.monotonic() < quiet_until:
            more = reader.poll_messages(min(quiet, 0.5))
            messages.extend(more)
            if more:
                quiet_until = time.monotonic() + quiet
    finally:
        reader.close()
    return messages


def peek_events(bootstrap: str, topic: str, *, keyring=None) -> list[dict]:
    """The incident changes (JSON) an anomalies topic holds now, opened as ``sdcwatch incidents``
    opens them (:func:`~sdcwatch.bus_reading.anomaly_opener`): with ``keyring`` (the service's key
    file) only what the service signed, anything else on the topic (anyone may write to it) left
    out; without, unsigned ones (a signed one fails: there is no key to verify it)."""
    from sdcwatch.bus_reading import anomaly_opener
    from sdcwatch.core.signing import AuthError

    opened = anomaly_opener(keyring)
    events = []
    for m in _read_now(bootstrap, topic):
        try:
            value = opened(m.value)
        except AuthError:
            if keyring is None:
                raise
            continue  # not the service's: what a reader refuses
        events.append(json.loads(value))
    return events


def wait_metric(url: str, pred: Callable[[list], bool], timeout: float, what: str) -> None:
    """Scrape ``url`` until ``pred(samples)`` holds; a service not answering yet (or slow to) is "not yet"."""
    wait_for(lambda: pred(scrape(url)), timeout, what, interval=0.25, retry_on=OSError)


def wait_finished(url: str, runs, timeout: float = 60.0) -> None:
    """Wait until the service at ``url`` says every one of ``runs`` finished (all end markers in)."""

    def finished(samples: list) -> bool:
        return all(metric(samples, "sdcwatch_training_run_finished", run=r) == 1 for r in runs)

    wait_metric(url, finished, timeout, f"runs {', '.join(runs)} to finish")


def run_cli(*args: str, timeout: float = 60.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """``sdcwatch ARGS`` run to its end in a child process of this interpreter, its output captured as text."""
    cmd = [sys.executable, "-m", "sdcwatch.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def rank_emitters(bootstrap: str, topic: str, run: str = "r", world: int = 4) -> list:
    """An emitter on ``topic`` for each of the ``world`` ranks of ``run``, two ranks a host (h0, h0, h1...)."""
    from sdcwatch.telemetry import Emitter, KafkaTransport

    return [
        Emitter(KafkaTransport(bootstrap, topic), run=run, rank=r, world=world, host=f"h{r // 2}") for r in range(world)
    ]


def train_ranks(emitters: list, steps, loss_at: Callable[[int, int, float], float] | None = None) -> None:
    """Emit ``steps`` of a clean run from every rank (loss about 2.0, gradient norms 1.0), one step
    every 5 ms (a training loop's pace: the workload, not a wait), then flush. ``loss_at(step, rank,
    loss)`` gives the loss a rank reports instead (a spike, a NaN)."""
    for step in steps:
        for em in emitters:
            loss = 2.0 + 0.01 * ((step * 7 + em.rank) % 5)
            loss = loss if loss_at is None else loss_at(step, em.rank, loss)
            em.emit(step, loss=loss, grad_norm_local=1.0, grad_norm_global=1.0)
        time.sleep(0.005)
    for em in emitters:
        assert em.flush(60)
