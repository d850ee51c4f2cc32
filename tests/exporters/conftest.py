"""Fixtures for the exporter tests: a capturing HTTP receiver and a real Alertmanager (both from _support.py)."""

from __future__ import annotations

import importlib.util
import sys
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


@pytest.fixture
def receiver():
    r = support.Receiver()
    yield r
    r.close()


@pytest.fixture(scope="session")
def alertmanager(tmp_path_factory):
    """A real Alertmanager whose only receiver posts to ``alertmanager.notifications``."""
    notifications = support.Receiver()
    server = support.start_alertmanager(tmp_path_factory.mktemp("alertmanager"), notifications.url + "/notify")
    server.notifications = notifications
    yield server
    server.stop()
    notifications.close()
