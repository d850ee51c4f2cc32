"""What the watch's indexed metrics index: its name lists, handed to the emitter when they grow."""

from __future__ import annotations

from typing import Any

from sdcwatch.telemetry.probes.activations import layer_of_module

__all__ = ["NameHandoff", "watch_names"]


def watch_names(watch: Any) -> dict[str, list[str]]:
    """``{family: names}`` of a watch's indexed metrics, as they are now."""
    checks, canary = watch.sampled_checks, watch.gemm_canary
    return {
        "products": list(checks.checksums.names) if checks.checksums is not None else [],
        "blocks": list(checks.stream.names) if checks.stream is not None else [],
        "layers": watch.layer_names,
        "modules": list(watch.leaf_names),
        # a driver that computes the canary outside the watch (the simulated ranks) names its products
        "canary_products": list(canary.names) if canary is not None else list(watch.canary_names),
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
        names = watch_names(w)
        sizes = tuple(len(v) for v in names.values())
        if sizes != self._sizes:
            self._sizes = sizes
            set_names(names)
