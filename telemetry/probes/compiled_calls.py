"""The calls compiled code keeps on the modules it measures, taking them back at a step's end, the
per-step bookkeeping tensors the probes cache, and removing the probes' hooks (docs/probes.md,
"How the probes are built").
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable

from torch import nn

__all__ = ["kept_calls", "cached", "remove_hooks"]


def cached(cache: dict, key: Hashable, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` when missing (a step calls its modules as the previous one
    did, so its device tensors of indices are built once); cleared past 64 entries."""
    got = cache.get(key)
    if got is None:
        if len(cache) > 64:
            cache.clear()
        got = cache[key] = make()
    return got


def kept_calls(modules: Iterable[nn.Module], attr: str) -> list[tuple[int, Any]]:
    """(index, call) of every call compiled code kept on ``modules`` under ``attr``, in module order
    (the probes' hooks in traced code append to a list on the module they run for, so that the
    traced code holds no module index); the lists are emptied."""
    out = []
    for i, m in enumerate(modules):
        calls = m.__dict__.get(attr)
        if calls:
            out.extend((i, c) for c in calls)
            calls.clear()
    return out


def remove_hooks(handles: list[Any]) -> None:
    """Remove every hook in ``handles`` (torch's removable handles) and empty the list."""
    for h in handles:
        h.remove()
    handles.clear()
