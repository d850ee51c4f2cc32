"""Fixtures shared by every test folder (the embedded broker, the real-logs location) and the order
the modules run in (the costliest first, so that no worker is left with a long one at the end)."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
from polling import wait_for

from sdcwatch.broker import EmbeddedBroker

REAL_LOGS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "real-logs"


@pytest.fixture(scope="session")
def broker():
    """A real Kafka-protocol broker (Tansu) on a free loopback port, for the whole session."""
    with EmbeddedBroker(port=0) as b:
        yield b


@pytest.fixture
def bootstrap(broker) -> str:
    """Address of the session broker, restarted first if an outage test left it down."""
    if not broker.running:
        broker.start()
    return broker.bootstrap


@pytest.fixture
def unique_topic() -> str:
    """A topic name no other test uses (the session broker is shared)."""
    return f"t.{uuid.uuid4().hex[:10]}"


def read_topic(bootstrap: str, topic: str, want: int, timeout: float = 90.0, *, grace: float = 1.0):
    """Read ``topic`` from the start until ``want`` records arrived (or ``timeout``), then for
    ``grace`` seconds more, to catch anything beyond what was expected. Returns (records, source)."""
    import time

    from sdcwatch.service.ingest import as_records
    from sdcwatch.service.kafka_source import KafkaSource

    src = KafkaSource(bootstrap, topic, group=f"g-{uuid.uuid4().hex[:8]}", deadletter_topic=f"{topic}.dead")
    got = []

    def enough() -> bool:  # the source returns v2 records as column blocks: expanded here, tests look at records
        got.extend(as_records(src.poll(0.5)))
        return len(got) >= want

    try:
        try:
            wait_for(enough, timeout, f"{want} records on {topic}", interval=0)
        except AssertionError:
            pass  # fewer: returned all the same, the caller's assertion says what is missing
        end = time.monotonic() + grace  # a window to see anything beyond what was expected
        while time.monotonic() < end:
            got.extend(as_records(src.poll(0.2)))
        src.commit()
        return got, src
    finally:
        src.close()


@pytest.fixture(scope="session")
def consume():
    """``consume(bootstrap, topic, want, timeout)`` -> (records, source): see :func:`read_topic`."""
    return read_topic


@pytest.fixture
def real_logs() -> Path:
    """The folder of real training logs that ships beside the repository (skip when absent)."""
    if not REAL_LOGS.is_dir():
        pytest.skip(f"real training logs not found at {REAL_LOGS}: they ship beside the repository in CI")
    return REAL_LOGS


def _module_cost(items: list) -> tuple[int, int, int]:
    """How long a module's tests keep a worker, as its markers say: slow ones (more than ~20 s each),
    then those that start servers or torch.distributed, then how many tests."""
    slow = sum(it.get_closest_marker("slow") is not None for it in items)
    integration = sum(it.get_closest_marker("integration") is not None for it in items)
    return slow, integration, len(items)


@pytest.hookimpl(trylast=True)  # after `-m` deselected: a module's bench-marked tests do not run
def pytest_collection_modifyitems(config, items):
    """The costliest modules first (``--no-loadscope-reorder`` keeps this order under -n): a worker
    that takes a minute-long module last would have the others wait for it at the end."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    costliest = sorted(modules.values(), key=_module_cost, reverse=True)  # stable: ties keep their order
    items[:] = [item for module in costliest for item in module]


def pytest_configure(config):
    # without bytecode caches (PYTHONDONTWRITEBYTECODE set, as in some containers) every process the
    # suite starts (ranks, services, the CLI) compiles sdcwatch again and every run rewrites each test
    # module's asserts again (6 of a worker's 12 CPU seconds of collection); git ignores the caches
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    os.environ.setdefault("SDCWATCH_HOST", "testhost")
    # a developer's exported job key would make every in-memory bus sign (tests that want one set it)
    os.environ.pop("SDCWATCH_KEY", None)
    os.environ.pop("SDCWATCH_KEY_FILE", None)
