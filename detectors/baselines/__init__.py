"""What teams use today, as detectors on the same aligned steps sdcwatch sees: the campaign's
baselines (Megatron-LM's rules, ZClip, a NaN-loss check) and river's HalfSpaceTrees, one per file.

Each takes one :class:`~sdcwatch.detectors.frame.StepFrame` per step and answers with findings,
exactly like sdcwatch's own detectors, so the fault-injection campaign scores every detector with
one code path. Each is registered with ``@register(baseline=True, order=...)``;
:func:`~sdcwatch.detectors.registry.baseline_classes` lists them for the campaign.

Importing this package is cheap: each name is imported on first use (PEP 562).
"""

from __future__ import annotations

from sdcwatch.core.lazy import lazy_attributes

_LAZY = {
    "MegatronRules": "sdcwatch.detectors.baselines.megatron",
    "MegatronConfig": "sdcwatch.detectors.baselines.megatron",
    "ZClipDetector": "sdcwatch.detectors.baselines.zclip",
    "ZClipConfig": "sdcwatch.detectors.baselines.zclip",
    "NanLossCheck": "sdcwatch.detectors.baselines.nan_check",
    "RiverHalfSpaceTrees": "sdcwatch.detectors.baselines.river_hst",
    "RiverConfig": "sdcwatch.detectors.baselines.river_hst",
    "rank_features": "sdcwatch.detectors.baselines.river_hst",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_attributes(__name__, _LAZY)
