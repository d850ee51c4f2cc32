"""Where in the model a finding is, in words: rendered from its metric, index and module name.

A finding that points into the model says so with a metric and an index (``gemm_out`` index 11,
``attn_entropy`` layer 2); once the rank has sent its layer names (:mod:`sdcwatch.core.rank_notes`)
the index also has a module's name. Every message that names a place renders it here, from
those fields, so the words are the same wherever they appear. The index is called what its
metric's family counts (:func:`noun_of`): a product of the checksums is not a layer::

    >>> where("gemm_out", 11)
    'gemm_out (product 11)'
    >>> where("stream_max", 3)
    'stream_max (block 3)'
    >>> where("attn_entropy", 2)
    'attn_entropy layer 2'
    >>> where("gemm_out", 11, "model.layers.1.mlp.gate_proj")
    'gemm_out of model.layers.1.mlp.gate_proj (product 11)'
    >>> index_text(2, "model.layers.2.self_attn")
    'model.layers.2.self_attn (layer 2)'

A detector builds its message with :func:`message_at`, which also returns the text either side of
the place; the finding keeps that (:attr:`~sdcwatch.core.incident.Finding.around`) so the service
can render the message again from the fields once it knows the module's name
(:meth:`~sdcwatch.core.incident.Finding.name_module`), rather than read its own text back.
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
    """The place of ``metric``'s value at index ``layer`` (None: a scalar), named ``name`` when known.

    ``noun`` says what the index counts (default: what ``metric``'s family counts, :func:`noun_of`).
    Without a name a layer reads ``attn_entropy layer 2`` and anything else names its noun
    (``gemm_out (product 11)``, ``stream_max (block 3)``); with one, the noun says what the index
    counts (``gemm_out of <name> (product 11)``), and a scalar's module stands alone
    (``act_max of <name>``).
    """
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
