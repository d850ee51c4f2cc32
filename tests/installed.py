"""Module-level skips for optional packages, checked without importing them: a test module's
``pytest.importorskip("transformers")`` costs every test worker seconds at collection, though only
the worker that runs the module needs it. Importable from every test folder (``pythonpath``).
"""

from __future__ import annotations

import importlib.util

import pytest

__all__ = ["needs"]


def needs(*modules: str) -> None:
    """Skip the calling test module unless every one of ``modules`` (dotted names) is installed."""
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            pytest.skip(f"{name} is not installed", allow_module_level=True)
