"""Fault-injection campaign: ``sdcwatch bench campaign`` as a script.

    python bench/campaign.py [--faults FILE] [--trials N] [--seed S] [--ranks W] [--out results/campaign.json] [--quick]

See bench/README.md for what it measures; the implementation is :mod:`sdcwatch.testbed.campaign.run`.
"""

import sys

from sdcwatch.testbed.campaign.cli import campaign_main

if __name__ == "__main__":
    campaign_main(sys.argv[1:])
