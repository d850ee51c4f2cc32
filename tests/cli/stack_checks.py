"""What tests/cli/test_stack.py and test_wheel.py check an exported stack against: the repository's
dashboards/ folder (the package data, so the single source) and the commands the export prints."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def repo_stack_files() -> dict[str, bytes]:
    """The repository's dashboards/ folder as the stack ships it: every file but Python and caches."""
    out = {}
    for path in sorted(DASHBOARDS.rglob("*")):
        rel = path.relative_to(DASHBOARDS)
        hidden = any(part.startswith((".", "__")) for part in rel.parts)
        if path.is_file() and path.suffix not in (".py", ".pyc") and not hidden:
            out[rel.as_posix()] = path.read_bytes()
    return out


def exported(dest: Path) -> dict[str, bytes]:
    """Every file under ``dest`` by its relative POSIX path."""
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def next_commands(stdout: str) -> list[str]:
    """The lines after ``next:`` in the export's output."""
    lines = stdout.splitlines()
    return [ln.strip() for ln in lines[lines.index("next:") + 1 :]]


def run_next_commands(stdout: str) -> list[str]:
    """Run the printed promtool and amtool commands whose tool is installed (each must pass); return
    the first three words of each one run."""
    ran = []
    for step in next_commands(stdout):
        argv = shlex.split(step)
        if argv[0] in ("promtool", "amtool") and shutil.which(argv[0]):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{step}: {done.stdout}{done.stderr}"
            ran.append(" ".join(argv[:3]) if argv[0] == "promtool" else " ".join(argv[:2]))
    return ran
