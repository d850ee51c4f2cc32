"""What teams use today, as detectors on the same aligned steps sdcwatch sees: the campaign's
baselines (Megatron-LM's rules, ZClip, a NaN-loss check) and river's HalfSpaceTrees, one per file.

Each takes one :class:`~sdcwatch.detectors.frame.StepFrame` per step and answers with findings,
exactly like sdcwatch's own detectors, so the fault-injection campaign scores every detector with
one code path. river's HalfSpaceTrees is also one of sdcwatch's own detectors (opt-in), so it lives
in :mod:`sdcwatch.detectors.river_hst`; the others mirror another tool's rule and live here, with
the campaign, outside the base wheel.
"""

from __future__ import annotations

from sdcwatch.detectors.river_hst import RiverConfig, RiverHalfSpaceTrees
from sdcwatch.testbed.campaign.baselines.megatron import MegatronConfig, MegatronRules
from sdcwatch.testbed.campaign.baselines.nan_check import NanLossCheck
from sdcwatch.testbed.campaign.baselines.zclip import ZClipConfig, ZClipDetector

__all__ = [
    "MegatronRules",
    "MegatronConfig",
    "ZClipDetector",
    "ZClipConfig",
    "NanLossCheck",
    "RiverHalfSpaceTrees",
    "RiverConfig",
    "baseline_classes",
]


def baseline_classes() -> dict[str, type]:
    """Baseline name -> class, in the order the campaign scores them next to sdcwatch.

    >>> list(baseline_classes())
    ['megatron', 'zclip', 'nan_check', 'river_hst']
    """
    return {cls.name: cls for cls in (MegatronRules, ZClipDetector, NanLossCheck, RiverHalfSpaceTrees)}
