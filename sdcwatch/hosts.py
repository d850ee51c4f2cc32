"""``sdcwatch hosts``: the service's verdict on each host across runs, read from its state folder
(``hosts.json``); the drain lines a scheduler would run, printed and never run; an operator's clear
of a repaired host, recorded for the running service to apply (docs/hosts.md).
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import duration_seconds, is_host
from sdcwatch.service.host_files import read_hosts, record_clear

__all__ = ["parse_duration", "host_line", "drain_lines", "build_parser", "hosts_main"]

_ACTIONS = ("list", "drain-commands", "clear")


def parse_duration(text: str) -> float:
    """Seconds of ``90``, ``90s``, ``30m``, ``12h``, ``7d`` or ``2w`` (argparse reports a bad one).

    >>> parse_duration("36h")
    129600.0
    """
    seconds = duration_seconds(text)
    if seconds is None:
        raise argparse.ArgumentTypeError(f"not a duration (such as 90s, 30m, 12h, 7d): {text!r}")
    return seconds


def _when(wall: float, now: float) -> str:
    if not wall:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(wall))
    age = max(0.0, now - wall)
    ago = f"{age / 86400:.1f}d" if age >= 86400 else f"{age / 3600:.1f}h" if age >= 3600 else f"{age / 60:.0f}m"
    return f"{stamp} ({ago} ago)"


def host_line(h: dict[str, Any], now: float) -> str:
    """One host on one line: name, verdict, score, runs, evidence kinds, since when (and who cleared it).

    >>> host_line({"host": "node17", "verdict": "suspect", "score": 1.75, "runs": ["a", "b"],
    ...            "kinds": ["checksum"], "since": 0.0}, 0.0)
    'node17               suspect      1.75     2  checksum                  -'
    """
    kinds = ",".join(h.get("kinds") or []) or "-"
    line = f"{h['host']:<20} {h['verdict']:<10} {float(h.get('score', 0.0)):6.2f} {len(h.get('runs') or []):5d}  "
    line += f"{kinds:<24}  {_when(float(h.get('since') or 0.0), now)}"
    if h.get("cleared_by"):
        line += f"  cleared by {h['cleared_by']}: {h.get('reason', '')}"
    return line


def _reason(h: dict[str, Any]) -> str:
    """The drain reason: the verdict and its evidence, in characters every scheduler takes."""
    kinds, runs = ",".join(h.get("kinds") or []), len(h.get("runs") or [])
    text = f"sdcwatch: {h['verdict']}, score {float(h.get('score', 0.0)):.2f}, {runs} runs ({kinds})"
    return re.sub(r"[^A-Za-z0-9 _.,:()=+-]", "_", text)


def drain_lines(hosts: Sequence[dict[str, Any]], *, slurm: bool = True, kubernetes: bool = True) -> list[str]:
    """The Slurm and Kubernetes lines that would take ``hosts`` out of scheduling. A host label is what
    a rank chose to report: one that is not a host name gets a comment, never a command.

    >>> for line in drain_lines([{"host": "node17", "verdict": "quarantine", "score": 3.2,
    ...                           "runs": ["a", "b", "c"], "kinds": ["checksum"]}]):
    ...     print(line)
    scontrol update nodename=node17 state=drain reason="sdcwatch: quarantine, score 3.20, 3 runs (checksum)"
    kubectl cordon node17
    kubectl taint nodes node17 sdcwatch=quarantine:NoSchedule
    """
    out = []
    for h in hosts:
        name = str(h["host"])
        if not is_host(name) or name.startswith("-"):
            out.append(f"# skipped {name!r}: not a host name")
            continue
        if slurm:
            out.append(f'scontrol update nodename={name} state=drain reason="{_reason(h)}"')
        if kubernetes:
            out.append(f"kubectl cordon {name}")
            out.append(f"kubectl taint nodes {name} sdcwatch={h['verdict']}:NoSchedule")
    return out


def build_parser() -> argparse.ArgumentParser:
    """Declare ``sdcwatch hosts``' actions and options."""
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_mutually_exclusive_group()
    where.add_argument("--state-dir", metavar="DIR", help="the service's state folder (state.dir)")
    where.add_argument("--config", metavar="PATH", help="serve configuration file (TOML): its state.dir")
    parser = argparse.ArgumentParser(
        prog="sdcwatch hosts",
        description="The detector service's verdict on each host across runs (clean, suspect, quarantine, "
        "cleared), as it last wrote it to hosts.json in its state folder at a snapshot. 'drain-commands' "
        "prints the Slurm and Kubernetes lines that would take the flagged hosts out of scheduling (never "
        "runs them); 'clear HOST --reason R' records an operator's clear of a repaired host, which the running "
        "service applies at its next snapshot. The state folder comes from --state-dir, else the serve "
        "configuration (--config, SDCWATCH_CONFIG, SDCWATCH_STATE_DIR). Exits 0, 1 when a --wait ran out, "
        "2 on bad input.",
    )
    actions = parser.add_subparsers(dest="action", metavar="{list,drain-commands,clear}")
    listing = actions.add_parser("list", parents=[common], help="the hosts, worst first (the default)")
    listing.add_argument("--json", action="store_true", help="hosts.json as the service wrote it (filtered)")
    listing.add_argument(
        "--since",
        type=parse_duration,
        metavar="DURATION",
        help="only hosts whose verdict (not clean) began within DURATION (90s, 30m, 12h, 7d)",
    )
    drain = actions.add_parser("drain-commands", parents=[common], help="print the scheduler lines, never run them")
    drain.add_argument("--suspects", action="store_true", help="suspect hosts too, not only quarantined ones")
    drain.add_argument("--scheduler", choices=("slurm", "kubernetes", "both"), default="both")
    clear = actions.add_parser("clear", parents=[common], help="record an operator's clear of a repaired host")
    clear.add_argument("host", help="the host, as hosts.json names it")
    clear.add_argument("--reason", required=True, help="why it is clear (the repair)")
    clear.add_argument("--by", help="who clears it (default: the user running the command)")
    clear.add_argument(
        "--wait",
        type=parse_duration,
        default=0.0,
        metavar="DURATION",
        help="wait up to DURATION for the service to apply the clear (it writes hosts.json at each snapshot)",
    )
    return parser


def _state_dir(args: argparse.Namespace) -> Path:
    if args.state_dir:
        return Path(args.state_dir).expanduser()
    from sdcwatch.config import load_config

    return load_config(args.config).state.dir


def _listed(folder: Path) -> dict[str, Any]:
    body = read_hosts(folder)
    if body is None:
        raise ConfigError("state.dir", f"no {folder / 'hosts.json'}: has a service written a snapshot there yet?")
    return body


def _list(args: argparse.Namespace, folder: Path, now: float, out: TextIO) -> int:
    body = _listed(folder)
    hosts = body["hosts"]
    if args.since is not None:
        hosts = [h for h in hosts if h.get("verdict") != "clean" and float(h.get("since") or 0.0) >= now - args.since]
    if args.json:
        print(json.dumps({**body, "hosts": hosts}, allow_nan=False), file=out)
        return 0
    flagged = sum(h.get("verdict") in ("suspect", "quarantine") for h in body["hosts"])
    print(f"{'HOST':<20} {'VERDICT':<10} {'SCORE':>6} {'RUNS':>5}  {'KINDS':<24}  SINCE", file=out)
    for h in hosts:
        print(host_line(h, now), file=out)
    written = _when(float(body.get("written") or 0.0), now)
    print(f"{len(body['hosts'])} hosts tracked, {flagged} suspect or quarantined; written {written}", file=out)
    return 0


def _drain(args: argparse.Namespace, folder: Path, out: TextIO) -> int:
    flagged = ("suspect", "quarantine") if args.suspects else ("quarantine",)
    hosts = [h for h in _listed(folder)["hosts"] if h.get("verdict") in flagged]
    print(f"# sdcwatch: {len(hosts)} host(s) {' or '.join(flagged)}; printed for review, not run", file=out)
    slurm, kube = args.scheduler in ("slurm", "both"), args.scheduler in ("kubernetes", "both")
    for line in drain_lines(hosts, slurm=slurm, kubernetes=kube):
        print(line, file=out)
    return 0


def _clear(args: argparse.Namespace, folder: Path, out: TextIO) -> int:
    body = read_hosts(folder)
    clear = record_clear(folder, args.host, by=args.by or getpass.getuser(), reason=args.reason)
    tracked = body is not None and any(h.get("host") == clear.host for h in body["hosts"])
    note = "" if tracked else " (the service's last hosts.json does not list it)"
    print(f"recorded: {clear.host} cleared by {clear.by}: {clear.reason}{note}", file=out)
    deadline = time.monotonic() + args.wait
    while args.wait:
        body = read_hosts(folder)
        if body is not None and float(body.get("clears_through") or 0.0) >= clear.wall:
            h = next((h for h in body["hosts"] if h.get("host") == clear.host), None)
            print(f"applied by the service: {clear.host} is {h['verdict'] if h else 'not tracked'}", file=out)
            return 0
        if time.monotonic() >= deadline:
            print(f"not applied within {args.wait:g} s: is a service running on {folder}?", file=out)
            return 1
        time.sleep(0.2)
    print("the service applies it at its next snapshot (state.snapshot_interval_s)", file=out)
    return 0


def hosts_main(argv: Sequence[str]) -> int:
    """``sdcwatch hosts [list|drain-commands|clear HOST] [...]``; the exit code."""
    argv = list(argv)
    if not argv or (argv[0] not in _ACTIONS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "list")
    args = build_parser().parse_args(argv)
    folder, now = _state_dir(args), time.time()
    if args.action == "clear":
        return _clear(args, folder, sys.stdout)
    if args.action == "drain-commands":
        return _drain(args, folder, sys.stdout)
    return _list(args, folder, now, sys.stdout)
