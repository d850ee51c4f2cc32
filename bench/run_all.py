"""Every benchmark in one go: ``sdcwatch bench all`` as a script.

    python bench/run_all.py [--quick] [--out-dir results/]

Writes one JSON file per benchmark and ``results/benchmarks.md`` (machine, command, tables).
"""

import sys

from sdcwatch.testbed.campaign.cli import all_main

if __name__ == "__main__":
    all_main(sys.argv[1:])
