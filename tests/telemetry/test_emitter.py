"""The emitter on the in-memory bus: never raises, never blocks, counts every record."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time

import pytest
from polling import returns, wait_for
from sdcwatch.core.errors import ConfigError
from sdcwatch.telemetry import Emitter, FileTransport, MemoryBus, MemoryTransport, NullEmitter, from_json, is_end_marker


def make(bus, **kw):
    kw.setdefault("run", "run1")
    kw.setdefault("rank", 2)
    kw.setdefault("world", 4)
    kw.setdefault("host", "node0")
    return Emitter(MemoryTransport(bus), **kw)


def test_records_arrive_with_identity_and_values():
    bus = MemoryBus()
    with make(bus) as em:
        for step in range(50):
            em.emit(step, loss=1.0 / (step + 1), layers={"attn_entropy": [1.0, 2.0]}, fingerprints={"param_fp": step})
        assert em.flush(5)
    recs = bus.records()
    assert [r.step for r in recs] == list(range(50)) + [49]  # close() ends with the marker at the last step
    assert [is_end_marker(r) for r in recs] == [False] * 50 + [True]
    r = recs[7]
    assert (r.run, r.rank, r.world, r.host) == ("run1", 2, 4, "node0")
    assert r.scalars["loss"] == pytest.approx(1 / 8)
    assert r.scalars["emitter_dropped"] == 0.0
    assert r.layers["attn_entropy"] == (1.0, 2.0)
    assert r.fingerprints["param_fp"] == 7
    assert em.sent == 50 and em.dropped == 0 and em.emitted == 50


def test_bus_down_buffers_to_bound_then_drops_and_counts(caplog):
    bus = MemoryBus()
    bus.down = True
    em = make(bus, buffer=100, batch=10)
    with caplog.at_level(logging.WARNING, logger="sdcwatch.telemetry"):
        for step in range(1000):
            em.emit(step, loss=1.0)
            assert em.pending <= 100
    assert em.dropped == 900
    drop_lines = [r for r in caplog.records if "dropping records" in r.getMessage()]
    assert len(drop_lines) == 1  # said once, not 900 times
    bus.down = False  # the bus comes back: the sender reconnects by itself
    assert em.flush(10)
    em.emit(1000, loss=2.0)
    assert em.flush(10)
    em.close()
    recs = bus.records()
    assert [r.step for r in recs] == list(range(100)) + [1000, 1000]  # ... and the end-of-run marker
    assert [is_end_marker(r) for r in recs[-2:]] == [False, True]
    assert em.sent + em.dropped == em.emitted == 1001  # the marker is not a record of the run
    assert recs[-2].scalars["emitter_dropped"] == 900.0  # the service sees the loss
    assert recs[-1].scalars["emitter_dropped"] == 900.0


def test_emit_never_raises_on_garbage():
    bus = MemoryBus()
    with make(bus) as em:
        em.emit(1, loss="not a number")
        em.emit(2, **{"bad name!": 1.0})
        em.emit(3, layers={"attn_entropy": object()})
        em.emit(-5, loss=1.0)
        em.emit(4, loss=math.nan)  # non-finite values are data, not errors
        assert em.flush(5)
    assert [(r.step, is_end_marker(r)) for r in bus.records()] == [(4, False), (4, True)]
    assert em.invalid == 4


def test_closed_emitter_drops_and_counts():
    bus = MemoryBus()
    em = make(bus)
    em.close()
    em.emit(1, loss=1.0)
    assert em.dropped == 1 and em.sent == 0 and em.emitted == 1


def test_close_with_bus_down_counts_unsent_as_dropped():
    bus = MemoryBus()
    bus.down = True
    em = make(bus, buffer=50)
    for step in range(20):
        em.emit(step, loss=1.0)
    returns(lambda: em.close(timeout=0.3), 30, "close(timeout=0.3) to return with the bus down")
    assert em.dropped == 20 and em.sent == 0
    assert em.emitted == 20  # the batch the sender held counts once, as dropped


def test_identity_from_torch_environment():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "SDCWATCH_RUN": "llama", "SDCWATCH_HOST": "h3"}
    em = Emitter(MemoryTransport(MemoryBus()), env=env)
    assert (em.run, em.rank, em.world, em.local_rank, em.host) == ("llama", 5, 8, 1, "h3")
    em.close()


@pytest.mark.parametrize(
    "kwargs, env, key",
    [
        (dict(buffer=0), {}, "buffer"),
        (dict(batch=-1), {}, "batch"),
        ({}, {"RANK": "x"}, "RANK"),
    ],
)
def test_bad_settings_name_the_key(kwargs, env, key):
    with pytest.raises(ConfigError) as info:
        Emitter(MemoryTransport(MemoryBus()), env=env, **kwargs)
    assert info.value.key == key


def test_file_transport_writes_json_lines(tmp_path):
    path = tmp_path / "cap" / "run.jsonl"
    with Emitter(FileTransport(path), run="r", rank=0, world=1, host="h") as em:
        for step in range(10):
            em.emit(step, loss=float(step), layers={"q_norm_max": [1.5]})
    lines = path.read_text().splitlines()
    assert [from_json(line).step for line in lines] == list(range(10)) + [9]
    assert is_end_marker(from_json(lines[-1])) and not is_end_marker(from_json(lines[-2]))
    assert from_json(lines[3]).scalars["loss"] == 3.0


def test_null_emitter_does_nothing():
    with NullEmitter() as em:
        em.emit(1, loss=1.0)
        assert em.flush() and em.sent == 0


def test_a_tight_loop_of_emits_reaches_the_bus_whole_and_in_order():
    # how fast emit() returns is bench/bench_emitter.py's (target p99 <= 20 us); here, what arrives
    bus = MemoryBus()
    em = make(bus, buffer=1_000_000)
    for step in range(20_000):
        em.emit(step, loss=1.0, grad_norm_local=2.0, layers={"attn_entropy": [1.0, 2.0]})
    em.close()
    assert em.sent == em.emitted == 20_000 and em.dropped == 0
    assert [r.step for r in bus.records(em.transport.topic)] == list(range(20_000)) + [19_999]


def test_import_is_light():
    code = (
        "import sys, sdcwatch.telemetry as t; t.Emitter; t.MemoryBus; "
        "heavy = [m for m in ('torch', 'kafka', 'scipy', 'river', 'prometheus_client') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_in_rank_package_imports_only_itself_and_the_shared_core():
    """Every module of the in-rank package and its sub-packages, torch ones included, pulls in no
    detector, service, exporter, CLI or test-bed module: a rank carries only what it needs."""
    code = (
        "import sys, pkgutil, importlib, sdcwatch.telemetry as t; "
        "names = [m.name for m in pkgutil.walk_packages(t.__path__, 'sdcwatch.telemetry.')]; "
        "[importlib.import_module(n) for n in names]; "
        "bad = sorted(m for m in sys.modules if m.startswith('sdcwatch.') and not "
        "m.startswith(('sdcwatch.telemetry', 'sdcwatch.core'))); print(len(names), ','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    count, _, bad = out.partition(" ")
    assert int(count) >= 40, f"the walk found only {count} modules"  # the sub-packages are walked
    assert bad == ""


def test_the_wire_imports_no_torch():
    """The emitter's side (``telemetry/wire``) is what a loop that only emits carries: no torch."""
    code = (
        "import sys, pkgutil, importlib, sdcwatch.telemetry.wire as w; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(w.__path__, 'sdcwatch.telemetry.wire.')]; "
        "print(len(w.__path__), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "1 False"


def test_flush_waits_for_a_record_the_sender_is_still_building(monkeypatch):
    """The sender pops a record before it holds it as in flight; flush must not return in that gap."""
    bus = MemoryBus()
    em = Emitter(MemoryTransport(bus), run="r", rank=0, world=1, host="h", linger=0.001)
    building = Emitter._build

    def slow_build(self, item):
        time.sleep(0.2)  # the record is off the queue and not yet in flight
        return building(self, item)

    monkeypatch.setattr(Emitter, "_build", slow_build)
    em.emit(0, loss=1.0)
    wait_for(lambda: not em._queue, 30, "the sender to pop the record", interval=0.001)
    assert em.flush(10)
    assert (em.sent, len(bus.records(em.transport.topic))) == (1, 1)
    em.close()
