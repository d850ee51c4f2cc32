"""Waiting in tests for something another process does: one polling loop with a generous bound.

Importable from every test folder (``pythonpath = ["tests"]`` in pyproject.toml).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

__all__ = ["wait_for"]

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    *,
    interval: float = 0.2,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something true, and return
    that; raise AssertionError naming ``what`` (and the last answer) after ``timeout`` seconds.

    An exception of a type in ``retry_on`` (say ``OSError`` from a server not listening yet, or a
    scrape that times out under load) counts as "not yet"; any other exception fails at once.
    Slow shared machines take longer, so callers give generous bounds: targets live in benchmarks.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except retry_on as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r:.2000})")
