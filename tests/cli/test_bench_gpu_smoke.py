"""The GPU benchmark's smoke test: ``bench/gpu/bench_gpu.py --smoke`` runs its own code at toy sizes
on the CPU, as a plain checkout on a stock CUDA PyTorch image would run it (sdcwatch not installed,
no kafka-python, crc32c, prometheus_client or transformers), so the script cannot rot between the
sessions that have a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "bench_gpu.py"
ABSENT = ("kafka", "crc32c", "prometheus_client", "transformers", "river", "matplotlib", "lightning", "accelerate")

# Run as `python3 bench/gpu/bench_gpu.py` runs it on the GPU machine: the script's folder first on
# sys.path, no editable install of sdcwatch, and the packages a stock CUDA PyTorch image lacks absent
# (an import of one fails, and is listed at exit).
STOCK_IMAGE = f"""
import atexit, importlib.abc, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
for name in [m for m in sys.modules if m == "sdcwatch" or m.startswith("sdcwatch.")]:
    del sys.modules[name]
sys.path[0] = {str(SCRIPT.parent)!r}
tried = []
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            tried.append(name)
            raise ImportError("not in a stock CUDA PyTorch image: " + name)
sys.meta_path.insert(0, Absent())
atexit.register(lambda: print("ABSENT-IMPORTS-TRIED", sorted(set(tried)), file=sys.stderr))
sys.argv = [{str(SCRIPT)!r}] + sys.argv[1:]
"""


def _stock_python(code: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", STOCK_IMAGE + code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.bench
def test_the_gpu_benchmark_smoke_run_reports_every_row_and_finds_every_fault_at_its_step(tmp_path):
    out = tmp_path / "out"
    done = _stock_python(
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')", "--smoke", "--json", str(out / "b.json"), timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ABSENT-IMPORTS-TRIED []" in done.stderr
    assert "mapped from pyproject's package-dir" in done.stdout  # sdcwatch came from this checkout
    res = json.loads((out / "b.json").read_text())
    assert [s["status"] for s in res["sections"]] == ["ok"] * 3, res["sections"]

    # every timed row: eager clean and three presets, compiled clean and one preset, side by side
    rows = {(r["mode"], r["config"]): r for r in res["timing"]}
    expected = [("eager", c) for c in ("clean", "scalars-only", "default", "forward-checksums")]
    expected += [("compiled", "clean"), ("compiled", "scalars-only")]
    assert sorted(rows) == sorted(expected)
    for (mode, config), r in rows.items():
        assert r["ms_median"] > 0, r
        if config != "clean":
            assert r["steps"] == 4 and r["clean_ms_median"] > 0 and r["probe_errors"] == 0, r
            assert r["messages"] >= 6 and r["false_alarms"] == [], r  # a record a step, no alarm on clean steps
            # the row rounds both medians to 0.001 ms and the percentage to 0.01: the bound of those roundings
            a, b = r["ms_median"], r["clean_ms_median"]
            rounding = 0.005 + 100 * 0.0005 * (1 / b + a / b**2) * 1.01
            assert r["overhead_pct"] == pytest.approx(100 * (a / b - 1), abs=rounding)
        if mode == "compiled":
            assert isinstance(r["graph_breaks"], int) and r["graphs"] >= 1 and "recompiles" in r, r
    assert rows[("eager", "default")]["host_syncs"] == "n/a (cpu)"  # checked on a GPU only

    # every fault: injected into its product's output at its step, named there on rank 0
    faults = {(r["config"], r["fault"].split()[0]): r for r in res["faults"]}
    assert sorted(faults) == sorted(
        (c, k) for c in ("default", "forward-checksums") for k in ("bitflip", "nan", "near_inf")
    )
    for r in faults.values():
        assert r["mode"] == "eager" and r["injected"], r
        assert (r["found_step"], r["found"], r["ranks"]) == (r["injected_step"], True, [0]), r
        assert r["false_alarms_before"] == [], r
    assert faults[("default", "bitflip")]["fault"] == "bitflip bit 14"  # bf16's top exponent bit

    # one markdown table, printed last, with a row for each of them
    lines = done.stdout.rstrip().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| part |"))
    table = lines[start + 2 :]
    assert table and all(ln.startswith("| ") and ln.endswith(" |") for ln in table)
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in table]
    assert sorted((c[2], c[3]) for c in cells if c[0] == "timing") == sorted(expected)
    found = [c for c in cells if c[0] == "fault"]
    assert len(found) == 6
    for c in found:
        step = c[8].split(" step ")[1].split()[0]
        assert c[9].startswith(f"step {step}, rank 0, "), c


def test_the_script_maps_sdcwatch_onto_the_checkout_when_only_its_root_is_on_the_path():
    """``PYTHONPATH=.``: ``import sdcwatch`` half-works (the composition root, not ``sdcwatch.core``);
    the script still measures this checkout's probes."""
    code = (
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"ns = runpy.run_path({str(SCRIPT)!r}, run_name='bench_gpu')\n"
        "import sdcwatch.telemetry.probes.watch as w, sdcwatch.service.pipeline as p\n"
        "print(ns['SOURCE']); print(w.__file__); print(p.__file__)\n"
    )
    done = _stock_python(code, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    source, watch, pipeline = done.stdout.splitlines()[-3:]
    assert source == f"checkout {ROOT} (mapped from pyproject's package-dir)"
    assert watch == str(ROOT / "telemetry" / "probes" / "watch.py")
    assert pipeline == str(ROOT / "service" / "pipeline.py")
    assert "ABSENT-IMPORTS-TRIED []" in done.stderr
