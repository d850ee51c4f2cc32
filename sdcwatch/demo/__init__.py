"""``sdcwatch demo``: the whole product in one command, on a laptop (the embedded broker, the detector
service, simulated ranks with a fault injected on one, the alerts, a summary and an HTML report).
This module is the command; plan, service, training, run and result are its parts.
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

from sdcwatch.core.errors import ConfigError
from sdcwatch.demo.plan import PRESETS, preset_faults
from sdcwatch.demo.result import DemoResult, format_summary, summarize
from sdcwatch.demo.run import run_demo

__all__ = [
    "PRESETS",
    "preset_faults",
    "DemoResult",
    "run_demo",
    "build_parser",
    "demo_main",
    "summarize",
    "format_summary",
]


def build_parser() -> argparse.ArgumentParser:
    """Declare ``sdcwatch demo``'s options."""
    parser = argparse.ArgumentParser(
        prog="sdcwatch demo",
        description="Train a small GPT on simulated data-parallel ranks that stream telemetry through an embedded "
        "Kafka broker to the detector service, inject a fault on one rank, and watch sdcwatch catch it.",
    )
    parser.add_argument(
        "--fault",
        default="bitflip",
        metavar="PRESET|FILE",
        help="a preset (" + ", ".join(PRESETS) + ") or a fault file in the injector's JSON format "
        "(default %(default)s)",
    )
    parser.add_argument("--ranks", type=int, default=None, help="simulated data-parallel ranks (default 8)")
    parser.add_argument(
        "--parallel",
        metavar="LAYOUT",
        default=None,
        help="simulate a tensor x pipeline x data parallel job instead, e.g. tp=2,pp=2,dp=4 (16 ranks; "
        "--fault-rank is then a global rank, default one on the last pipeline stage)",
    )
    parser.add_argument("--steps", type=int, default=160, help="training steps (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model, data and fault (default %(default)s)")
    parser.add_argument("--fault-rank", type=int, default=None, help="rank the preset hits (default: ranks/2 - 1)")
    parser.add_argument(
        "--fault-step", type=int, default=None, help="step the preset starts at (default: 55%% of the run)"
    )
    parser.add_argument("--report", default=None, metavar="PATH", help="where to write the HTML report")
    parser.add_argument("--out-dir", default=None, metavar="DIR", help="folder for records, incidents and state")
    parser.add_argument("--metrics-port", type=int, default=0, help="port for /metrics (default 9400, or a free one)")
    parser.add_argument(
        "--guard",
        action="store_true",
        help="guard the training: skip, rerun, roll back or evict on a detection, and show it",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    parser.add_argument("--list-presets", action="store_true", help="list the fault presets and exit")
    return parser


def demo_main(argv: Sequence[str]) -> int:
    """``sdcwatch demo``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.list_presets:
        for name, (desc, _) in PRESETS.items():
            print(f"{name:15s} {desc}")
        return 0
    if args.ranks is not None and args.parallel is not None:
        raise ConfigError("ranks", "give --ranks or --parallel, not both (the layout sets the rank count)")
    result = run_demo(
        fault=args.fault,
        ranks=8 if args.ranks is None else args.ranks,
        steps=args.steps,
        seed=args.seed,
        fault_rank=args.fault_rank,
        fault_step=args.fault_step,
        report=args.report,
        out_dir=args.out_dir,
        metrics_port=args.metrics_port,
        quiet=False,
        guard=args.guard,
        parallel=args.parallel,
    )
    if args.json:
        print(json.dumps(result.to_dict(), allow_nan=False))
    else:
        print(format_summary(result))
    return 0
