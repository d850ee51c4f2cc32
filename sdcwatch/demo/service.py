"""The demo's detector service: built as ``sdcwatch serve`` builds it, on the embedded broker, with
every record it reads captured to a file (for the report) and every incident event kept and
printed as it fires; run on a thread beside the simulated training, then drained and stopped."""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.record import to_json

__all__ = ["CapturingSource", "EventLog", "DemoService"]


class CapturingSource:
    """Wraps the service's source and appends every record it returns to a JSON-lines file."""

    def __init__(self, source: Any, path: Path) -> None:
        self._source = source
        self._fh = open(path, "w", encoding="utf-8")
        self.seen = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def poll(self, timeout: float) -> list:
        from sdcwatch.service.ingest import as_records

        records = self._source.poll(timeout)
        if records:
            flat = as_records(records)  # v2 column blocks as records, for the JSON capture
            self._fh.write("".join(to_json(r) + "\n" for r in flat))
            self._fh.flush()
            self.seen += len(flat)
        return records

    def close(self) -> None:
        try:
            self._source.close()
        finally:
            self._fh.close()


class EventLog:
    """An incident sink that notes when each incident opened and which are open, and prints alerts as
    they fire (on the service's thread; the training reads ``open`` for its progress lines)."""

    def __init__(self, out: TextIO, quiet: bool) -> None:
        self.opened_wall: dict[str, float] = {}
        self.open: set[str] = set()
        self._out = out
        self._quiet = quiet

    def publish(self, event: Any) -> None:
        inc = event.incident
        if event.change == "opened":
            self.opened_wall.setdefault(inc.id, time.time())
            self.open.add(inc.id)
        elif event.change == "resolved":
            self.open.discard(inc.id)
        if self._quiet:
            return
        if event.change == "opened":
            print(f"  ALERT  [{inc.severity.value}] step {inc.first_step}: {inc.message}", file=self._out, flush=True)
        elif event.change == "resolved":
            print(f"  resolved  {inc.kind} (steps {inc.first_step}-{inc.last_step})", file=self._out, flush=True)
        elif event.change == "updated" and getattr(inc, "kind", "") == "sdc_suspected":
            print(f"  update [{inc.severity.value}] {inc.message}", file=self._out, flush=True)

    def close(self) -> None:
        pass


class DemoService:
    """The detector service of the demo, its /metrics endpoint and the thread it runs on; ``guard``:
    it also publishes decisions on the control topic; ``events``: the sink the demo prints from;
    ``metrics_port`` 0: the service's default port (9400), or a free one when another process holds it."""

    def __init__(
        self, bootstrap: str, *, state_dir: Path, records_path: Path, metrics_port: int, guard: bool, events: EventLog
    ) -> None:
        from sdcwatch.config import AlertsConfig, BusConfig, GuardPolicyConfig, MetricsConfig, ServeConfig, StateConfig
        from sdcwatch.serve import build_service

        cfg = ServeConfig(
            bus=BusConfig(bootstrap=bootstrap, group=f"sdcwatch-demo-{os.getpid()}"),
            metrics=MetricsConfig(address="127.0.0.1", **({"port": metrics_port} if metrics_port else {})),
            alerts=AlertsConfig(log=False),  # the demo prints each change itself
            state=StateConfig(dir=state_dir, snapshot_interval_s=5.0),
            # with --guard, the loop: incidents -> decisions on sdcwatch.control -> the job's guard
            guard=GuardPolicyConfig(actions=guard),
        )
        self.events = events
        self._metrics_fallback = not metrics_port
        self._max_runs = cfg.metrics.max_runs
        self.service, self.metrics = build_service(
            cfg, extra_sinks=[events], wrap_source=lambda source: CapturingSource(source, records_path)
        )
        self.source, self.pipeline = self.service.source, self.service.pipeline
        self.pipeline.book.history = []  # keep every incident, in its latest state, for the summary
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self.service.run_forever, args=(self._stop,), name="sdcwatch-service", daemon=True
        )

    @property
    def deciders(self) -> list[Any]:
        """The sinks that publish guard decisions (each counts what it ``published``)."""
        return [s for s in self.service.sinks if hasattr(s, "policy") and hasattr(s, "published")]

    def start_metrics(self) -> None:
        """Serve /metrics. On the default port held by another process (another demo, a service), serve
        on a free port instead: the server binds port 0 and reads back what it got, so two demos
        started at once never both take the default (a check that it is free, then a bind, could)."""
        from sdcwatch.exporters.server import MetricsServer

        try:
            self.metrics.start()
        except ConfigError:
            if not self._metrics_fallback:
                raise
            view = functools.partial(self.service.view, max_runs=self._max_runs)
            self.metrics = MetricsServer(view, address="127.0.0.1", port=0).start()

    def start(self) -> None:
        """Run the service on its thread."""
        self._thread.start()

    def drain(self, run_id: str, steps: int, records: int) -> None:
        """Wait (bounded) until the service has read the ``records`` the ranks sent and closed their
        ``steps`` steps."""
        deadline = time.monotonic() + 30
        while self.source.seen < records and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            view = self.service.view()
            run_view = next((r for r in view.runs if r.run == run_id), None)
            if run_view is not None and run_view.last_step >= steps - 1:
                break
            time.sleep(0.05)
        time.sleep(0.3)

    def stop(self) -> None:
        """Stop the service's thread and its /metrics endpoint."""
        self._stop.set()
        self._thread.join(timeout=30)
        self.metrics.close()

    def incidents(self) -> list[Any]:
        """Every incident in its latest state (final once the service has stopped)."""
        return list(self.pipeline.book.history)
