"""One announcement per incident across a kill: the journal of what was published since the snapshot."""

from __future__ import annotations

import shutil

from detector_synth import Fault, SyntheticRun
from polling import step_until
from sdcwatch.service.announced import JOURNAL_FILE
from memory_source import MemorySource
from sdcwatch.service.loop import DetectorService
from sdcwatch.telemetry import MemoryBus, MemoryTransport
from stand_ins import ListSink


def _opened(sink: ListSink) -> list[str]:
    return [e.incident.id for e in sink.events if e.change == "opened"]


def _start(bus, state_dir, committed: int) -> tuple[DetectorService, ListSink]:
    """A service as ``sdcwatch serve`` starts after a crash: state from the folder, reading from the
    last committed offset."""
    source = MemorySource(bus)
    source._offset = source._committed = committed
    sink = ListSink()
    return DetectorService(source, sinks=[sink], state_dir=state_dir, snapshot_every=3600, poll_timeout=0.01), sink


def _run_until_drained(svc: DetectorService) -> None:
    step_until(svc.step, lambda: svc.source.lag() == 0, 120, "the source drained")
    for _ in range(3):
        svc.step()


def test_an_incident_found_again_after_a_kill_is_announced_once_and_without_the_journal_twice(tmp_path):
    bus = MemoryBus()
    run = SyntheticRun(seed=5, run="killed", faults=[Fault("nonfinite", 80, rank=2)])
    tr = MemoryTransport(bus)
    for s in range(60):
        tr.send(run.records(s))
    first, sink_a = _start(bus, tmp_path, 0)
    _run_until_drained(first)
    first.snapshot()  # the last snapshot before the kill: state and offsets at step 59
    committed = first.source._committed
    for s in range(60, 120):
        tr.send(run.records(s))
    _run_until_drained(first)
    assert _opened(sink_a) == ["killed:nonfinite:80"]
    # SIGKILL: no close(), no snapshot; the journal on disk is all that says what was announced
    shutil.copytree(tmp_path, tmp_path.parent / "no-journal")
    (tmp_path.parent / "no-journal" / JOURNAL_FILE).unlink()

    second, sink_b = _start(bus, tmp_path, committed)
    assert second.resumed
    for _ in range(12):  # snapshots before the re-read reaches the incident (a slow group join)
        second.snapshot()
    _run_until_drained(second)
    assert _opened(sink_b) == [], "the incident announced before the kill was announced again"
    assert second.journal.suppressed >= 1
    # the re-read incident is this instance's now: it goes on to resolve it, once
    for s in range(120, 200):
        tr.send(run.records(s))
    _run_until_drained(second)
    second.snapshot()
    assert not (tmp_path / JOURNAL_FILE).exists()  # a snapshot holds everything announced

    # the same restart without the journal (what the service did before) announces it twice
    third, sink_c = _start(bus, tmp_path.parent / "no-journal", committed)
    _run_until_drained(third)
    assert _opened(sink_c) == ["killed:nonfinite:80"]


def test_a_journal_that_cannot_be_written_costs_a_count_not_the_alert(tmp_path):
    bus = MemoryBus()
    run = SyntheticRun(seed=6, run="disk", faults=[Fault("nonfinite", 30, rank=1)])
    tr = MemoryTransport(bus)
    for s in range(50):
        tr.send(run.records(s))
    svc, sink = _start(bus, tmp_path, 0)
    (tmp_path / JOURNAL_FILE).mkdir()  # the journal's path cannot be opened as a file
    _run_until_drained(svc)
    assert _opened(sink) == ["disk:nonfinite:30"]
    assert svc.journal.write_errors >= 1
