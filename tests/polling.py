"""Waiting in tests for something another thread or process does: one polling loop with a generous
bound, and a call that must return rather than block. Tests assert what happened, never how fast:
speed lives in bench/. Importable from every test folder (``pythonpath = ["tests"]`` in pyproject.toml).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

__all__ = ["wait_for", "returns", "step_until"]

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


def returns(call: Callable[[], T], timeout: float, what: str) -> T:
    """Run ``call`` on a thread and return its result (or raise its exception); AssertionError
    naming ``what`` when it has not returned after ``timeout`` seconds, i.e. it blocked on something
    it must not wait for (a bus that is down, a peer that never answers).

    The bound separates "returns" from "blocks": give it generous room, never a speed target.
    """
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"returns: {what}", daemon=True)
    thread.start()
    wait_for(lambda: not thread.is_alive(), timeout, what, interval=0.01)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def step_until(step: Callable[[], object], done: Callable[[], T], timeout: float, what: str) -> T:
    """Call ``step`` (one turn of a loop the test drives, a service's ``step``) until ``done()``
    returns something true, and return that; AssertionError naming ``what`` after ``timeout`` s."""

    def stepped() -> T:
        step()
        return done()

    return wait_for(stepped, timeout, what, interval=0)
