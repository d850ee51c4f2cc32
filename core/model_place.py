"""Where in the model a finding is, in words, rendered from its metric, index and module name, so
the words are the same wherever they appear. The index is called what its metric's family counts
(:func:`noun_of`): a product of the checksums is not a layer::

    >>> where("gemm_out", 11)
    'gemm_out (product 11)'
    >>> where("attn_entropy", 2)
    'attn_entropy layer 2'
    >>> where("gemm_out", 11, "model.layers.1.mlp.gate_proj")
    'gemm_out of model.layers.1.mlp.gate_proj (product 11)'
    >>> index_text(2, "model.layers.2.self_attn")
    'model.layers.2.self_attn (layer 2)'
"""

from __future__ import annotations

from sdcwatch.core.vocabulary import NOUNS, family_of

__all__ = ["where", "index_text", "message_at", "noun_of"]


def noun_of(metric: str) -> str:
    """What one index of ``metric`` counts (``product``, ``block``, ``layer``...), from its family."""
    return NOUNS.get(family_of(metric) or "", "layer")


def index_text(layer: int, name: str | None = None, noun: str = "layer") -> str:
    """``layer 2``; with the module's ``name``, ``<name> (layer 2)``."""
    at = f"{noun} {layer}"
    return f"{name} ({at})" if name else at


def where(metric: str, layer: int | None, name: str | None = None, noun: str | None = None) -> str:
    """The place of ``metric``'s value at index ``layer`` (None: a scalar), named ``name`` when known;
    ``noun`` says what the index counts (default: :func:`noun_of`)."""
    noun = noun or noun_of(metric)
    if name:
        return f"{metric} of {name}" + ("" if layer is None else f" ({noun} {layer})")
    if layer is None:
        return metric
    return f"{metric} layer {layer}" if noun == "layer" else f"{metric} ({noun} {layer})"


def message_at(
    head: str, metric: str, layer: int | None, tail: str, noun: str | None = None
) -> tuple[str, tuple[str, str]]:
    """``(message, (head, tail))``: the message ``head + where(metric, layer) + tail`` and the text
    either side of its place, for a finding's ``message`` and ``around``."""
    return head + where(metric, layer, noun=noun) + tail, (head, tail)
