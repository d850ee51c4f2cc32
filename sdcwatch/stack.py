"""``sdcwatch stack export DIR``: the monitoring stack that ships in the package (the package data
of ``sdcwatch.dashboards``: Grafana dashboard and provisioning, Prometheus config, alert rules and
their tests, Alertmanager routing, their reference), written out.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from importlib.resources import files
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Sequence

from sdcwatch.core.errors import ConfigError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = ["STACK_PACKAGE", "stack_files", "describe", "export_stack", "next_steps", "stack_main"]

#: The package whose data files are the stack.
STACK_PACKAGE = "sdcwatch.dashboards"

#: What a file is, by the end of its path (the first that matches).
_WHAT = (
    (".rules.test.yml", "promtool unit tests of the alert rules"),
    (".rules.yml", "Prometheus alert rules"),
    ("prometheus.yml", "Prometheus scrape config (loads the rules)"),
    ("alertmanager.yml", "Alertmanager routing example"),
    ("datasources/datasource.yml", "Grafana provisioning: the Prometheus data source"),
    ("dashboards/dashboards.yml", "Grafana provisioning: the dashboard provider"),
    (".json", "Grafana dashboard"),
    ("README.md", "reference: setting up, every metric, every alert"),
)


def _is_stack_file(name: str) -> bool:
    """The package's Python source (its ``__init__``, the dashboard's generator) and caches stay behind."""
    return not (name.startswith((".", "__pycache__")) or name.endswith((".py", ".pyc")))


def stack_files() -> list[tuple[str, Traversable]]:
    """(relative POSIX path, resource) of every file of the stack, sorted by path."""
    out: list[tuple[str, Traversable]] = []
    todo: list[tuple[PurePosixPath, Traversable]] = [(PurePosixPath(), files(STACK_PACKAGE))]
    while todo:
        where, folder = todo.pop()
        for entry in folder.iterdir():
            if not _is_stack_file(entry.name):
                continue
            if entry.is_dir():
                todo.append((where / entry.name, entry))
            else:
                out.append((str(where / entry.name), entry))
    return sorted(out, key=lambda item: item[0])


def describe(path: str) -> str:
    """What the stack file at ``path`` (relative) is; empty for one this module does not know."""
    return next((what for end, what in _WHAT if path.endswith(end)), "")


def export_stack(dest: Path, *, force: bool = False) -> list[str]:
    """Write every stack file under ``dest`` (created if missing) and return their relative paths;
    a ``dest`` not empty is refused unless ``force`` (the folder's other files are left alone)."""
    if dest.exists() and not dest.is_dir():
        raise ConfigError("DIR", f"{dest} is a file, not a folder")
    if dest.is_dir() and not force and any(dest.iterdir()):
        raise ConfigError("DIR", f"{dest} is not empty: name a new or empty folder, or pass --force to overwrite")
    written = []
    for rel, resource in stack_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(resource.read_bytes())
        written.append(rel)
    return written


def next_steps(dest: Path, written: Sequence[str]) -> list[str]:
    """The commands that check the written files and load them, one a line."""

    def at(rel: str) -> str:
        return shlex.quote(str(dest / rel))

    steps = [f"promtool check config {at(r)}" for r in written if r.endswith("prometheus.yml")]
    steps += [f"promtool check rules {at(r)}" for r in written if r.endswith(".rules.yml")]
    steps += [f"promtool test rules {at(r)}" for r in written if r.endswith(".rules.test.yml")]
    steps += [f"amtool check-config {at(r)}" for r in written if r.endswith("alertmanager.yml")]
    steps += [f"Grafana: Dashboards > New > Import, upload {at(r)}" for r in written if r.endswith(".json")]
    if any(r.startswith("provisioning/") for r in written):
        steps.append(
            f"or provision Grafana: mount {at('provisioning')} at /etc/grafana/provisioning and "
            f"{shlex.quote(str(dest))} at /var/lib/grafana/dashboards/sdcwatch"
        )
    return steps


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdcwatch stack",
        description=(
            "The monitoring stack that ships in the package: the Grafana dashboard and provisioning, the "
            "Prometheus config, alert rules and their promtool tests, the Alertmanager routing."
        ),
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = sub.add_parser("export", help="write the stack's files into DIR, then say how to check and load them")
    export.add_argument("dir", metavar="DIR", type=Path, help="folder to write into (created if missing)")
    export.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    return parser


def stack_main(argv: Sequence[str]) -> int:
    """``sdcwatch stack export DIR [--force]``."""
    args = _parser().parse_args(list(argv))
    dest = args.dir.resolve()
    written = export_stack(dest, force=args.force)
    width = max(len(rel) for rel in written)
    lines = [f"sdcwatch stack: wrote {len(written)} files to {dest}"]
    lines += [f"  {rel:<{width}}  {describe(rel)}".rstrip() for rel in written]
    lines += ["next:"] + [f"  {step}" for step in next_steps(dest, written)]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
