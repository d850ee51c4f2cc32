"""``sdcwatch report``: one self-contained HTML page of a captured run. data loads, deviation scores
ranks against each other, plots draws, page renders; what the page shows: docs/service.md,
"Capture a run, replay it offline".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from sdcwatch.core.errors import SdcwatchError
from sdcwatch.core.vocabulary import DEVIATION_METRICS
from sdcwatch.report.data import RunData, load_incidents, load_records
from sdcwatch.report.deviation import Deviation, rank_deviation, robust_z
from sdcwatch.report.page import render_report, write_report
from sdcwatch.testbed.faultspec import load_faults

__all__ = [
    "RunData",
    "load_records",
    "load_incidents",
    "robust_z",
    "rank_deviation",
    "Deviation",
    "write_report",
    "render_report",
    "report_main",
    "build_parser",
    "DEVIATION_METRICS",
]


def build_parser() -> argparse.ArgumentParser:
    """Declare ``sdcwatch report``'s arguments."""
    p = argparse.ArgumentParser(prog="sdcwatch report")
    p.description = "Write a self-contained HTML report of a captured run: loss and gradient norm with incidents, a rank x step heat map of deviation, attention entropy per layer, and the incident table."
    p.add_argument(
        "records",
        metavar="RECORDS.jsonl",
        help="the run's records as JSON lines: what 'sdcwatch capture' (or the emitter's file transport) wrote",
    )
    p.add_argument(
        "--incidents",
        metavar="INCIDENTS.jsonl",
        help="the incidents to mark, one JSON object a line: 'sdcwatch replay RECORDS.jsonl --json' writes them "
        "(the report draws; it does not detect)",
    )
    p.add_argument(
        "-o", "--output", metavar="PATH", default="report.html", help="where to write the report (default: report.html)"
    )
    p.add_argument("--title", help="page title (default: 'sdcwatch report — RUN')")
    p.add_argument(
        "--injected",
        metavar="TEXT|FILE",
        help="what was injected: free text shown in the header (e.g. 'bitflip on rank 5 at step 120'), "
        "or a fault file in the injector's format (.json / .jsonl), also drawn on the plots",
    )
    p.add_argument("--run", help="the run to show when the file holds several (default: the one with most records)")
    return p


def report_main(argv: Sequence[str] | None = None) -> int:
    """``sdcwatch report RECORDS.jsonl [--incidents INCIDENTS.jsonl] [-o report.html]``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        injected: Any = args.injected
        if injected and Path(injected).suffix in (".json", ".jsonl") and Path(injected).is_file():
            injected = [f.to_dict() for f in load_faults(injected)]
        out = write_report(args.records, args.incidents, args.output, title=args.title, injected=injected, run=args.run)
    except SdcwatchError as exc:
        print(f"sdcwatch report: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sdcwatch report: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(out)
    return 0
