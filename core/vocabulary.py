"""Names every layer agrees on, defined once: the Kafka topics and the metric names a record
carries (others are allowed; these are the ones sdcwatch knows).
"""

from __future__ import annotations

__all__ = [
    "RUN_END",
    "TELEMETRY_TOPIC",
    "ANOMALY_TOPIC",
    "DEADLETTER_TOPIC",
    "SUMMARY_TOPIC",
    "CONTROL_TOPIC",
    "TOPICS",
    "SCALARS",
    "STEP_SCALARS",
    "FIRST_BAD",
    "CANARY_PRODUCT",
    "LAYER_METRICS",
    "ATTENTION_STATS",
    "FINGERPRINTS",
    "GEMM_METRICS",
    "STREAM_METRICS",
    "CHECK_METRICS",
    "RATIO_METRICS",
    "RANK_SCALARS",
    "DATA_METRICS",
    "DEVIATION_METRICS",
    "FAMILIES",
    "NOUNS",
    "family_of",
]

#: The topic the emitters write to and the detector service reads.
TELEMETRY_TOPIC = "sdcwatch.telemetry"
#: The topic the service writes incident changes to (opened, updated, resolved), as JSON.
ANOMALY_TOPIC = "sdcwatch.anomalies"
#: Where malformed telemetry messages are moved, untouched, for a person to inspect.
DEADLETTER_TOPIC = "sdcwatch.deadletter"
#: Between the spatial and the temporal stage of a scaled-out service: one step summary a message.
SUMMARY_TOPIC = "sdcwatch.summaries"
#: Decisions for the training jobs' guards (skip, roll back, evict), keyed by run; rank 0 reads it.
CONTROL_TOPIC = "sdcwatch.control"
#: The reserved scalar that makes a record an end-of-run marker (:mod:`sdcwatch.core.messages`).
RUN_END = "sdcwatch.run_end"
#: Every default topic, by its purpose.
TOPICS = {
    "telemetry": TELEMETRY_TOPIC,
    "anomalies": ANOMALY_TOPIC,
    "deadletter": DEADLETTER_TOPIC,
    "summaries": SUMMARY_TOPIC,
    "control": CONTROL_TOPIC,
}

#: The forward position of the first NaN, Inf or near-INF output the probes saw at a step (only then
#: sent): the ranks that saw it first made it (:mod:`sdcwatch.telemetry.probes.forward_order`).
FIRST_BAD = "nonfinite_first"
#: Sent with ``gemm_canary_fp``: the index of the product the per-product canary checked at that step
#: in the rank's ``watch.gemm_canary.products`` (:mod:`sdcwatch.telemetry.probes.gemm_canary`).
CANARY_PRODUCT = "gemm_canary_product"
#: Well-known scalar names (others are allowed; these are what the probes and detectors use).
SCALARS = (
    "loss",  # the rank's own micro-batch loss
    "loss_global",  # loss averaged over ranks, when the caller has it
    "grad_norm_local",  # L2 norm of the rank's gradient before the all-reduce
    "grad_norm_global",  # L2 norm of the all-reduced gradient (must agree across replicas)
    "grad_cosine",  # cosine of the local gradient with the all-reduced one
    "step_time",  # seconds for the step on this rank
    "nonfinite",  # count of NaN/Inf values seen in loss, gradients and probed activations
    "lr",  # learning rate
    "emitter_dropped",  # records this rank's emitter dropped so far (cumulative)
    "act_max",  # largest |output| of any module in the forward pass (sampled steps)
    "act_max_module",  # which module produced act_max: an index into the rank's Watch.leaf_names
    "act_max_layer",  # the attention layer whose block holds that module (-1: outside every layer)
    FIRST_BAD,  # forward position of the first NaN/Inf/near-INF output the probes saw (only then sent)
    CANARY_PRODUCT,  # the product the per-product canary checked at this step (sent with gemm_canary_fp)
)
#: Well-known per-layer metrics, one value per layer: the statistics one attention observation
#: yields, in this order.
LAYER_METRICS = (
    "attn_entropy",  # mean over sampled heads and queries, nats
    "attn_entropy_min",  # lowest head's mean entropy
    "q_norm_mean",
    "q_norm_max",
    "k_norm_mean",
    "k_norm_max",
    "attn_logit_max",  # largest pre-softmax attention logit (every step when the layer hands its logits over)
)
#: The probes' name for the per-layer statistics (the same list).
ATTENTION_STATS = LAYER_METRICS
#: Well-known fingerprints: exact, must be bit-identical across data-parallel replicas.
FINGERPRINTS = ("param_fp", "grad_fp", "gemm_canary_fp")  # gemm_canary_fp: one product of a known input
#: Per-layer checks: matrix-product checksums (one value per checked product, ratios to their
#: rounding bound) and extreme values; read by the checksum and non-finite detectors, never
#: compared across ranks as statistics.
GEMM_METRICS = (
    "gemm_fwd",  # largest forward residual / its rounding bound (> 1: the product is wrong)
    "gemm_bwd",  # largest weight- and bias-gradient residual / bound (0: not checked this step)
    "gemm_weight",  # change of the weights since the optimizer wrote them / rounding bound
    "gemm_in",  # largest |input| of the product: a NaN, Inf or near-INF fed into it shows here
    "gemm_out",  # largest |row sum| of the product's output, every step: a NaN, Inf or near-INF it wrote shows here
)
#: Extreme values outside the products, every step. The largest attention logit is measured every
#: step too, as ``attn_logit_max`` (one of :data:`LAYER_METRICS`: one definition, whichever probe
#: measured it).
STREAM_METRICS = (
    "stream_max",  # largest |value| of each block's output (the residual stream)
    "attn_logit_min",  # smallest attention logit that is not a mask, every step (a near-INF below zero)
)
CHECK_METRICS = GEMM_METRICS + STREAM_METRICS
#: Check metrics that are ratios to a bound (> 1 is the finding): large finite values are not near-INF.
RATIO_METRICS = ("gemm_fwd", "gemm_bwd", "gemm_weight")

#: What a data-parallel rank's record carries on every step when the probes have its loss and
#: optimizer (the rest of :data:`SCALARS` on sampled or bad steps), in the synthetic steps' column order.
STEP_SCALARS = (
    "loss",
    "grad_norm_local",
    "grad_norm_global",
    "grad_cosine",
    "step_time",
    "nonfinite",
    "lr",
    "emitter_dropped",
)

#: Per-rank scalars that vary across ranks with the rank's data, compared rank against rank.
#: Values that must be identical (global norm, lr, fingerprints) belong to the replica detector,
#: step time to the straggler detector.
RANK_SCALARS = ("loss", "grad_norm_local", "grad_cosine")
#: Attribution: a rank extreme only in these had a bad batch (the same list).
DATA_METRICS = RANK_SCALARS
#: The report's heat map of cross-rank deviation (the same list).
DEVIATION_METRICS = RANK_SCALARS

#: Layer-name families (:class:`~sdcwatch.core.rank_notes.LayerNames`): family -> the metrics whose
#: index is a position in that family's list. ``act_max`` carries the attention layer of its module
#: (``act_max_layer``), so it is named from the layers.
FAMILIES: dict[str, tuple[str, ...]] = {
    "products": GEMM_METRICS,
    "blocks": ("stream_max",),
    "layers": (*LAYER_METRICS, "attn_logit_min", "act_max"),
    "modules": ("act_max_module",),
    "canary_products": ("gemm_canary_fp",),  # the per-product canary's rotation (gemm_canary_product)
}
#: What one index of a family is called in a message (``product 11``, ``block 3``).
NOUNS = {"products": "product", "blocks": "block", "layers": "layer", "modules": "module", "canary_products": "product"}
_FAMILY_OF = {m: fam for fam, metrics in FAMILIES.items() for m in metrics}


def family_of(metric: str) -> str | None:
    """The family whose list a ``metric``'s index points into (None: not an indexed metric)."""
    return _FAMILY_OF.get(metric)
