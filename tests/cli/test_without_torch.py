"""The commands that train (demo, bench campaign and clean) without torch installed: exit 2 with
one line naming the pip command, not a traceback; the others are not affected."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sdcwatch.cli import needs_message

#: Runs ``sdcwatch ARGS`` as if torch were not installed: every ``import torch`` fails as a
#: missing module does.
WITHOUT_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.modules.pop("torch", None)
sys.meta_path.insert(0, NoTorch())
from sdcwatch.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def sdcwatch_without_torch(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["demo", "--fault", "nan", "--json"],
        ["bench", "campaign", "--quick"],
        ["bench", "clean", "--steps", "10"],
    ],
)
def test_a_command_that_trains_says_to_install_torch_in_one_line(argv):
    out = sdcwatch_without_torch(*argv)
    assert out.returncode == 2, out.stderr[-3000:]
    torch_missing = needs_message(["torch"])
    assert out.stderr.splitlines() == [f"sdcwatch {argv[0]}: error: {torch_missing}"]
    assert "pip install 'sdcwatch[torch]'" in torch_missing
    assert out.stdout == ""


def test_commands_that_do_not_train_run_without_torch():
    presets = sdcwatch_without_torch("demo", "--list-presets")
    assert presets.returncode == 0 and presets.stdout.startswith("bitflip"), presets.stderr[-3000:]
    helped = sdcwatch_without_torch("bench", "campaign", "--help")
    assert helped.returncode == 0 and "Runs from the installed package" in " ".join(helped.stdout.split())
