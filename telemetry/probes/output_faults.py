"""The seam through which a fault reaches a product that the probes compute themselves (docs/probes.md)."""

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
    """The :class:`OutputFault` hooks on ``module``, in the order it runs them (usually none): whoever
    computes its product outside a module call passes the result through them, so a simulated faulty
    device corrupts that product too (the module's other hooks are not run).
    """
    hooks = getattr(module, "_forward_hooks", None)
    if not hooks:
        return []
    return [h for h in hooks.values() if isinstance(h, OutputFault)]
