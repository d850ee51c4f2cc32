"""``python -m sdcwatch.report``: the same as ``sdcwatch report``."""

import sys

from sdcwatch.report import report_main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(report_main())
