"""The ``sdcwatch`` command line: demo, serve, capture, replay, report, broker, bench.

Each subcommand lives in its own module and is imported only when it runs, so ``sdcwatch --help``
stays fast and a missing optional dependency (torch) only affects the commands that need it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from typing import Callable, Sequence

from sdcwatch import __version__
from sdcwatch.core.errors import SdcwatchError

__all__ = ["main", "build_parser", "broker_main", "TORCH_MISSING"]

log = logging.getLogger("sdcwatch")

#: What a command that trains (demo, bench campaign and clean) says when torch is not installed.
TORCH_MISSING = "this command needs PyTorch, which is not installed: pip install 'sdcwatch[torch]'"

# subcommand -> (module, function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": (
        "sdcwatch.demo",
        "demo_main",
        "train a small model on 8 simulated ranks, inject an SDC, watch it get caught",
    ),
    "serve": ("sdcwatch.serve", "serve_main", "run the detector service against a Kafka cluster (production)"),
    "capture": (
        "sdcwatch.capture",
        "capture_main",
        "write one run's telemetry from the bus as JSON lines (for replay and report)",
    ),
    "replay": (
        "sdcwatch.service.offline",
        "replay_main",
        "run the detectors over a captured run (JSON lines) or a CSV training log",
    ),
    "report": ("sdcwatch.report", "report_main", "write an HTML report (plots and incidents) of a captured run"),
    "broker": ("sdcwatch.cli", "broker_main", "run the embedded Kafka-protocol broker (Tansu) on loopback"),
    "bench": (
        "sdcwatch.bench",
        "bench_main",
        "run the benchmarks (campaign and clean from the package; e2e, ingest and all need a clone)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdcwatch",
        description="Catch silent data corruption and loss spikes in large-model training.",
        epilog="Run 'sdcwatch COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"sdcwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def _resolve(name: str) -> Callable[[Sequence[str]], int]:
    module, func, _ = COMMANDS[name]
    return getattr(importlib.import_module(module), func)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # its reconnect chatter is not the user's business
    try:
        return int(_resolve(argv[0])(argv[1:]) or 0)
    except SdcwatchError as exc:
        print(f"sdcwatch {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional dependency: one line saying what to install
        if (exc.name or "").partition(".")[0] != "torch":
            raise
        print(f"sdcwatch {argv[0]}: error: {TORCH_MISSING}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a command that had nothing of its own to say on Ctrl-C: say why it ended
        print(f"sdcwatch {argv[0]}: interrupted", file=sys.stderr)
        return 130


def broker_main(argv: Sequence[str]) -> int:
    """``sdcwatch broker``: run Tansu on loopback until Ctrl-C or SIGTERM."""
    from sdcwatch.broker import EmbeddedBroker

    parser = argparse.ArgumentParser(
        prog="sdcwatch broker",
        description=(
            "Run the embedded Kafka-protocol broker (Tansu, in-memory storage) for local use. "
            "Data is lost when it stops; use a real Kafka cluster in production."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument(
        "--port", type=int, default=9092, help="port to listen on; 0 picks a free one (default %(default)s)"
    )
    args = parser.parse_args(argv)
    broker = EmbeddedBroker(args.host, args.port)
    stopping = []

    def stop(signum, frame):
        stopping.append(signum)
        broker.terminate()  # the main thread is in wait(); it reaps the process and cleans up

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    broker.start()
    print(f"sdcwatch broker: listening on {broker.bootstrap} (Ctrl-C to stop)", flush=True)
    code = broker.wait()
    broker.stop()
    if stopping:
        print("sdcwatch broker: stopped", flush=True)
        return 0
    print(f"sdcwatch broker: the broker exited unexpectedly (code {code})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
