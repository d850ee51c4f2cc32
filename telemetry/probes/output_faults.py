"""The seam through which a fault reaches a product that the probes compute themselves.
(docs/probes.md, "How the probes are built", says how and why.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["OutputFault", "output_faults"]


class OutputFault:
    """A forward hook that corrupts a module's output: ``hook(module, inputs, output)``, a non-None
    result replacing the output, as a module call would use it."""

    __slots__ = ("hook",)

    def __init__(self, hook: Any) -> None:
        self.hook = hook

    def __call__(self, module: Any, inputs: Any, output: Any) -> Any:
        return self.hook(module, inputs, output)


def output_faults(module: Any) -> list[OutputFault]:
    """The :class:`OutputFault` hooks on ``module``, in the order the module runs them (empty when
    none is attached: the usual case).

    Whoever computes the module's product outside a module call passes its result through them, as
    the module call would: a simulated faulty device then corrupts that product too, as a real one
    would. The module's other hooks (the probes', a user's) are not run.
    """
    hooks = getattr(module, "_forward_hooks", None)
    if not hooks:
        return []
    return [h for h in hooks.values() if isinstance(h, OutputFault)]
