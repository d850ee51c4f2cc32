"""What the watch's indexed metrics index: its name lists, handed to the emitter when they grow.

A record's ``gemm_*`` vectors index ``watch.checksums.names`` (the checked products),
``stream_max`` the transformer blocks, the attention statistics ``watch.layer_names``, the
``act_max_module`` scalar ``watch.leaf_names``, the canary's ``gemm_canary_product`` ``watch.gemm_canary.products``. The lists grow as the probes discover modules
(products and attention layers are found in the first forward pass), so :class:`NameHandoff`
compares their lengths (they only grow) before each record and hands the emitter the lists, as
``{family: names}`` (:data:`sdcwatch.core.layer_names.FAMILIES`), when one grew. An emitter
without ``set_names`` (a stand-in) is left alone. The same step resolves the record's own index into
a name: ``act_max_module`` (the module of the largest output) becomes ``watch.act_max_module`` and
the attention layer holding it, ``act_max_layer``. Runs on the watch's sender thread.
"""

from __future__ import annotations

from typing import Any

from sdcwatch.telemetry.probes.activations import layer_of_module

__all__ = ["NameHandoff", "watch_names"]


def watch_names(watch: Any) -> dict[str, list[str]]:
    """``{family: names}`` of a watch's indexed metrics, as they are now."""
    finite = watch._finite
    canary = getattr(watch, "gemm_canary", None)
    # a driver that computes the canary outside the watch (the simulated ranks) names its products here
    canary_names = getattr(watch, "gemm_canary_names", None)
    if canary_names is None:
        canary_names = canary.names if canary is not None else []
    return {
        "products": list(finite.checksums.names) if finite.checksums is not None else [],
        "blocks": list(finite.stream.names) if finite.stream is not None else [],
        "layers": watch.layer_names,
        "modules": list(watch.leaf_names),
        "canary_products": list(canary_names),
    }


class NameHandoff:
    """Hands a watch's name lists to its emitter whenever one of them grew; places a record's
    ``act_max_module`` among the attention layers (``act_max_layer``) and keeps its name."""

    def __init__(self, watch: Any) -> None:
        self._watch = watch
        self._sizes: tuple[int, ...] | None = None

    def __call__(self, scalars: dict[str, float]) -> None:
        w = self._watch
        module = scalars.get("act_max_module")
        if module is not None and 0 <= module < len(w.leaf_names):
            w.act_max_module = w.leaf_names[int(module)]
            scalars["act_max_layer"] = float(layer_of_module(w.act_max_module, w.layer_names))
        set_names = getattr(w.emitter, "set_names", None)
        if set_names is None:
            return
        finite = w._finite
        sizes = (
            len(finite.checksums.names) if finite.checksums is not None else 0,
            len(finite.stream.names) if finite.stream is not None else 0,
            w.n_layers,
            len(w.leaf_names),
        )
        if sizes != self._sizes:
            self._sizes = sizes
            set_names(watch_names(w))
