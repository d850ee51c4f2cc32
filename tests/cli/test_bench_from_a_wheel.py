"""``sdcwatch bench`` from installed packages: without the campaign distribution it says in one line
what to install; with it, ``campaign`` and ``clean`` run from the package, ``e2e``, ``ingest`` and
``all`` run the scripts of a clone's ``bench/`` folder and say so plainly (no wheel has such a
folder: ``SDCWATCH_BENCH_DIR`` pointed at a missing one stands in for it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sdcwatch.bench import CAMPAIGN_MISSING
from sdcwatch.cli import main
from sdcwatch.core.errors import ConfigError
from sdcwatch.testbed.campaign.cli import BENCH_DIR_ENV, bench_dir, bench_main

CLONE_ONLY = ("e2e", "ingest", "all")
REPO_BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def no_clone(monkeypatch, tmp_path):
    """As from a wheel: no bench/ folder where sdcwatch looks for it."""
    missing = tmp_path / "site-packages" / "bench"
    monkeypatch.setenv(BENCH_DIR_ENV, str(missing))
    return missing


@pytest.mark.parametrize("argv", [["campaign", "--quick"], ["e2e"], ["--help"], []])
def test_without_the_campaign_distribution_bench_says_what_to_install(argv, monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "sdcwatch.testbed.campaign.cli", raising=False)
    monkeypatch.setitem(sys.modules, "sdcwatch.testbed.campaign", None)  # as in the base wheel: no such package
    assert main(["bench", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [CAMPAIGN_MISSING]
    assert CAMPAIGN_MISSING.startswith("sdcwatch bench: error: this command needs the campaign and benchmarks")
    assert CAMPAIGN_MISSING.endswith("pip install ./testbed/campaign (from a clone of the repository)")


def _listed(help_text: str, heading: str) -> list[str]:
    """The subcommands listed under the help's line that starts with ``heading``."""
    lines = help_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(heading)) + 1
    names = []
    for ln in lines[start:]:
        if not ln.startswith("  "):
            break
        names.append(ln.split()[0])
    return names


@pytest.mark.parametrize("name", CLONE_ONLY)
def test_a_clone_only_benchmark_without_the_bench_folder_exits_2_with_one_line(name, no_clone, capsys):
    assert main(["bench", name, "--quick"] if name != "ingest" else ["bench", name]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"sdcwatch bench {name}: needs a clone of the repository: it runs scripts of its bench/")
    assert str(no_clone) in line and f"set {BENCH_DIR_ENV} to a clone's bench/ folder" in line
    assert "'sdcwatch bench campaign', 'clean' and 'fleet' run from the installed package" in line


def test_bench_dir_refuses_a_missing_folder_and_takes_the_one_named(no_clone, monkeypatch):
    with pytest.raises(ConfigError, match="needs a clone of the repository"):
        bench_dir()
    monkeypatch.setenv(BENCH_DIR_ENV, str(REPO_BENCH))
    assert bench_dir() == REPO_BENCH
    monkeypatch.delenv(BENCH_DIR_ENV)
    assert bench_dir() == REPO_BENCH  # in a clone: the folder beside the package


def test_bench_help_says_which_benchmarks_need_a_clone(no_clone, capsys):
    assert bench_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert _listed(out, "from the installed package") == ["campaign", "clean", "fleet"]
    assert _listed(out, "from a clone of the repository") == list(CLONE_ONLY)
    assert f"no bench/ folder at {no_clone}: set {BENCH_DIR_ENV} to a clone's bench/ folder" in out
    assert bench_main([]) == 2  # no command: the same text on stderr
    assert _listed(capsys.readouterr().err, "from a clone of the repository") == list(CLONE_ONLY)


def test_bench_help_in_a_clone_names_its_bench_folder(monkeypatch, capsys):
    monkeypatch.delenv(BENCH_DIR_ENV, raising=False)
    assert bench_main(["--help"]) == 0
    assert f"bench/ folder: {REPO_BENCH}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["e2e", "ingest"])
def test_a_clone_only_benchmarks_help_says_it_needs_a_clone(name, no_clone, capsys):
    assert bench_main([name, "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"sdcwatch bench {name}: ") and lines[0].endswith(
        "from a clone of the repository (not in the installed package)"
    )
    assert lines[1] == (
        f"no bench/ folder at {no_clone}: run it from a clone, or set {BENCH_DIR_ENV} to a clone's bench/ folder"
    )


def test_in_a_clone_the_e2e_help_says_so_and_then_shows_the_scripts_options(monkeypatch, capsys):
    monkeypatch.delenv(BENCH_DIR_ENV, raising=False)
    with pytest.raises(SystemExit) as done:
        bench_main(["e2e", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("from a clone of the repository (not in the installed package)")
    assert "--ranks" in out and "--duration" in out


@pytest.mark.parametrize(
    "name, said",
    [
        ("campaign", "Runs from the installed package"),
        ("clean", "Runs from the installed package"),
        ("all", "Needs a clone of the repository"),
    ],
)
def test_each_benchmarks_own_help_says_whether_it_needs_a_clone(name, said, no_clone, capsys):
    with pytest.raises(SystemExit) as done:
        bench_main([name, "--help"])
    assert done.value.code == 0
    assert said in " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog
