"""The examples in the docstrings run: every module of every package that has examples, as doctests.

A module is a case when its source has an example in a docstring (of the module, a class, a
function or a method) that is not skipped; its doctest must then run at least one example, and
every one must pass.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

#: The packages, each from its own folder (the wheel maps core/, telemetry/, detectors/, service/,
#: exporters/ and testbed/ in).
PACKAGES = (
    "sdcwatch",
    "sdcwatch.core",
    "sdcwatch.telemetry",
    "sdcwatch.detectors",
    "sdcwatch.service",
    "sdcwatch.exporters",
    "sdcwatch.testbed",
)


def _walk() -> list[str]:
    """Every module of the packages (found without importing them: only the packages are)."""
    names = set(PACKAGES)
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        names.update(m.name for m in pkgutil.walk_packages(path, package + "."))
    return sorted(n for n in names if not n.endswith("__main__"))  # running it is the command


def _examples_in(module: str) -> int:
    """How many examples the docstrings of ``module``'s source hold, as doctest parses them (an
    example marked ``# doctest: +SKIP`` does not run, so it does not count)."""
    source = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
    parser = doctest.DocTestParser()
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                count += sum(not ex.options.get(doctest.SKIP) for ex in parser.get_examples(doc))
    return count


ALL_MODULES = _walk()
#: module -> the examples its source holds, for the modules that hold any
EXAMPLES = {m: n for m in ALL_MODULES if (n := _examples_in(m))}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 1, f"{name} has {EXAMPLES[name]} examples in its source, doctest ran none"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_walk_reaches_every_package():
    """Each package, the ones mapped from other folders too, has modules the walk finds."""
    for package in PACKAGES:
        assert any(m.startswith(package + ".") for m in ALL_MODULES), f"no module of {package} found"
    assert {
        "sdcwatch.cli",
        "sdcwatch.core.record",
        "sdcwatch.core.jsonsafe",
        "sdcwatch.telemetry.wire.emitter",
        "sdcwatch.detectors.spike",
        "sdcwatch.detectors.river_hst",
        "sdcwatch.service.aligner",
        "sdcwatch.exporters.collector",
        "sdcwatch.testbed.simulated",
    } <= set(ALL_MODULES)


def test_the_documented_examples_are_found():
    """The modules known to carry examples are cases, with every example counted."""
    assert {
        "sdcwatch.detectors.spike",
        "sdcwatch.detectors.registry",
        "sdcwatch.detectors.spread",
        "sdcwatch.service.offset_gaps",
    } <= set(EXAMPLES)
    assert EXAMPLES["sdcwatch.detectors.spike"] >= 3  # RobustBaseline's example
    from sdcwatch.detectors import spike

    assert doctest.testmod(spike).attempted == EXAMPLES["sdcwatch.detectors.spike"]
