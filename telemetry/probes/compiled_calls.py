"""The calls compiled code keeps on the modules it measures, and taking them back at a step's end.
(docs/probes.md, "How the probes are built", says how and why.)
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

__all__ = ["kept_calls"]


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
