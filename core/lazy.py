"""Lazy package attributes (PEP 562): a package names its public objects and the modules that define
them, and each is imported on first use, so importing a package stays cheap (no torch, kafka or
scipy until a name that needs them is used)."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping

__all__ = ["by_module", "lazy_attributes"]


def lazy_attributes(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """The module-level ``__getattr__`` of ``package``: ``table[name]`` is the module defining
    ``name``; the object is imported once, then kept on the package.

    >>> getattr_ = lazy_attributes("sdcwatch.core", {"IncidentKind": "sdcwatch.core.kinds"})
    >>> getattr_("IncidentKind").__name__
    'IncidentKind'
    >>> getattr_("nothing")
    Traceback (most recent call last):
    AttributeError: module 'sdcwatch.core' has no attribute 'nothing'
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def by_module(modules: Mapping[str, str]) -> dict[str, str]:
    """The ``name -> module`` table of :func:`lazy_attributes` from ``module -> "name name ..."``
    (names separated by spaces, as in :func:`collections.namedtuple`).

    >>> by_module({"sdcwatch.core.kinds": "IncidentKind Severity"})
    {'IncidentKind': 'sdcwatch.core.kinds', 'Severity': 'sdcwatch.core.kinds'}
    """
    return {name: module for module, names in modules.items() for name in names.split()}
