"""``sdcwatch bench``: the benchmarks, which live with the fault-injection campaign outside the base
wheel (:mod:`sdcwatch.testbed.campaign`, the ``sdcwatch-campaign`` distribution built from the
repository's ``testbed/campaign/``); without it the command says in one line what to install.
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["bench_main", "CAMPAIGN_MISSING"]

#: What ``sdcwatch bench`` says (exit status 2) where the campaign machinery is not installed.
CAMPAIGN_MISSING = (
    "sdcwatch bench: error: this command needs the campaign and benchmarks (sdcwatch-campaign), which are "
    "not installed: pip install ./testbed/campaign (from a clone of the repository)"
)


def bench_main(argv: Sequence[str]) -> int:
    """Entry point of ``sdcwatch bench``: the campaign distribution's, or one line and 2 without it."""
    try:
        from sdcwatch.testbed.campaign.cli import bench_main as run
    except ModuleNotFoundError as exc:
        if exc.name not in ("sdcwatch.testbed.campaign", "sdcwatch.testbed.campaign.cli"):
            raise
        print(CAMPAIGN_MISSING, file=sys.stderr)
        return 2
    return run(argv)
