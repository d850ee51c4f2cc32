"""The probes and torch.compile: whether code runs compiled, and making compiled code run the probes'
hooks (docs/probes.md, "How the probes are built").
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from sdcwatch.telemetry.probes.residual_stream import repeated_blocks
from torch import nn

__all__ = ["make_room_for_blocks", "running_compiled", "watch_compiled_code"]


def running_compiled() -> bool:
    """Whether the calling code runs under torch.compile: traced by Dynamo now, or called from a
    frame that torch.compile evaluates (a hook of a compiled module that Dynamo did not inline)."""
    if torch.compiler.is_compiling():
        return True
    try:
        return torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)
    except Exception:  # a torch without this private hook: taken as eager
        return False


def _has_compiled_code(model: nn.Module) -> bool:
    """Whether Dynamo holds compiled code for the forward of any module class in ``model`` (or for
    the module call itself, which ``module.compile()`` compiles)."""
    try:
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    except AttributeError:
        return False
    codes = {type(m).forward.__code__ for m in model.modules() if hasattr(type(m).forward, "__code__")}
    codes.add(nn.Module._call_impl.__code__)
    return any(entries(code) for code in codes)


def make_room_for_blocks(model: nn.Module) -> None:
    """Raise Dynamo's recompile limit to what compiling ``model``'s blocks one by one needs with the
    probes attached (each block compiles up to three variants; the default limit runs the blocks past
    the third eagerly). Never lowers a limit."""
    config = torch._dynamo.config
    blocks = len(repeated_blocks(model))
    if blocks and hasattr(config, "recompile_limit"):
        config.recompile_limit = max(config.recompile_limit, 4 * blocks + 8)
        if hasattr(config, "accumulated_recompile_limit"):
            config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * blocks + 64)


def watch_compiled_code(model: nn.Module) -> None:
    """Make compiled code run the hooks attach() adds to ``model``: Dynamo's guards on module hooks
    on, and its caches reset when the model already ran compiled (a one-time recompile). Never raises."""
    with contextlib.suppress(Exception):  # a torch without Dynamo: nothing is compiled
        import torch._dynamo

        torch._dynamo.config.skip_nnmodule_hook_guards = False
        make_room_for_blocks(model)
        if _has_compiled_code(model):
            warnings.warn(
                "sdcwatch probes: torch.compile already compiled code for this model's modules (this model or "
                "another of the same classes: Dynamo shares it between them, without the probes' hooks); "
                "Dynamo's caches are reset so that compiled code runs the hooks (a one-time recompile). "
                "Attach before the first compiled step to avoid it.",
                RuntimeWarning,
                stacklevel=3,
            )
            torch.compiler.reset()
