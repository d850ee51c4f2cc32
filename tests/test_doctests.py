"""The examples in the docstrings run: every module of every package, as doctests."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

#: The packages, each from its own folder (the wheel maps telemetry/, detectors/, exporters/ in).
PACKAGES = (
    "sdcwatch",
    "sdcwatch.core",
    "sdcwatch.telemetry",
    "sdcwatch.detectors",
    "sdcwatch.service",
    "sdcwatch.exporters",
    "sdcwatch.testbed",
)


def _modules() -> list[str]:
    names = set(PACKAGES)
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        names.update(m.name for m in pkgutil.walk_packages(path, package + "."))
    return sorted(n for n in names if not n.endswith("__main__"))  # running it is the command


MODULES = _modules()


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_documented_examples_are_found():
    """The walk reaches the packages mapped from other folders, and their examples count."""
    assert {
        "sdcwatch.detectors.spike",
        "sdcwatch.core.record",
        "sdcwatch.exporters.collector",
        "sdcwatch.core.jsonsafe",
    } <= set(MODULES)
    from sdcwatch.detectors import spike

    assert doctest.testmod(spike).attempted >= 3  # RobustBaseline's example runs
