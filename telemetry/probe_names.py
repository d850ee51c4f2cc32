"""What the watch's indexed metrics index: its name lists, handed to the emitter when they grow.

A record's ``gemm_*`` vectors index ``watch.checksums.names`` (the checked products),
``stream_max`` the transformer blocks, the attention statistics ``watch.layer_names``, the
``act_max_module`` scalar ``watch.leaf_names``. The lists grow as the probes discover modules
(products and attention layers are found in the first forward pass), so :class:`NameHandoff`
compares their lengths (they only grow) before each record and hands the emitter the lists, as
``{family: names}`` (:data:`sdcwatch.core.layer_names.FAMILIES`), when one grew. An emitter
without ``set_names`` (a stand-in) is left alone. Runs on the watch's sender thread.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NameHandoff", "watch_names"]


def watch_names(watch: Any) -> dict[str, list[str]]:
    """``{family: names}`` of a watch's indexed metrics, as they are now."""
    finite = watch._finite
    return {
        "products": list(finite.checksums.names) if finite.checksums is not None else [],
        "blocks": list(finite.stream.names) if finite.stream is not None else [],
        "layers": watch.layer_names,
        "modules": list(watch.leaf_names),
    }


class NameHandoff:
    """Hands a watch's name lists to its emitter whenever one of them grew."""

    def __init__(self, watch: Any) -> None:
        self._watch = watch
        self._sizes: tuple[int, ...] | None = None

    def __call__(self) -> None:
        w = self._watch
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
