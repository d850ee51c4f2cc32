"""What teams use today, as detectors on the same aligned steps sdcwatch sees: the campaign's
baselines (Megatron-LM's rules, ZClip, a NaN-loss check) and river's HalfSpaceTrees.

Each is registered with ``@register(baseline=True)``; :func:`~sdcwatch.detectors.registry.baseline_classes`
lists them for the campaign.
"""

from sdcwatch.detectors.baselines.river_hst import RiverConfig, RiverHalfSpaceTrees, rank_features
from sdcwatch.detectors.baselines.rules import (
    MegatronConfig,
    MegatronRules,
    NanLossCheck,
    ZClipConfig,
    ZClipDetector,
)

__all__ = [
    "MegatronRules",
    "MegatronConfig",
    "ZClipDetector",
    "ZClipConfig",
    "NanLossCheck",
    "RiverHalfSpaceTrees",
    "RiverConfig",
    "rank_features",
]
