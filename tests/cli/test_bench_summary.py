"""``bench/summarise.py``: a run's raw JSON becomes its section of its benchmark's committed page,
with the command, the numbers as tables, the long samples counted; the page's other sections stay."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "summarise.py"


@pytest.fixture(scope="module")
def summarise():
    spec = importlib.util.spec_from_file_location("bench_summarise", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RESULT = {
    "command": "python bench/bench_overhead.py --batch-size 32 --out bench/results/overhead_b32_x.json",
    "batch_size": 32,
    "results": {
        "default": {"median_cpu_ratio": 1.0852043, "cpu_overhead_pct": 8.520431, "probes": {"every": 1}},
        "scalars-only": {"median_cpu_ratio": 1.0102, "cpu_overhead_pct": 1.02},
    },
    "trials": [{"index": i, "detected": i % 2 == 0, "impact": {"class": "spike"}} for i in range(30)],
}


@pytest.mark.parametrize(
    "name, result, benchmark",
    [
        ("overhead_b32_x", RESULT, "overhead"),
        ("campaign_flips", {"command": "sdcwatch bench campaign --classes bitflip_exponent"}, "campaign"),
        ("guard_clean_steps", {"command": "python bench/guard_clean_steps.py --steps 10000"}, "guard_clean_steps"),
        ("gpu_h200_clip", {}, "gpu"),
        ("ingest_signed_1", [], "ingest"),
    ],
)
def test_a_result_belongs_to_the_benchmark_its_command_names(summarise, name, result, benchmark):
    assert summarise.benchmark_of(name, result) == benchmark


def test_a_result_without_a_command_naming_its_benchmark_is_refused(summarise):
    with pytest.raises(ValueError, match="no command names its benchmark"):
        summarise.benchmark_of("mystery", {"command": "make it"})


def test_a_result_becomes_its_section_and_the_pages_other_sections_stay(summarise, tmp_path):
    page = tmp_path / "overhead.md"
    page.write_text("# overhead\n\n## overhead_old\n\nCommand: `python bench/bench_overhead.py`\n\n| key | value |\n")
    summarise.update_page(page, {"overhead_b32_x": RESULT})
    text = page.read_text()
    assert "## overhead_old\n\nCommand: `python bench/bench_overhead.py`" in text  # kept as it was
    new = text[text.index("## overhead_b32_x") :]
    assert f"Command: `{RESULT['command']}`" in new
    assert "| batch_size | 32 |" in new
    assert "|  | median_cpu_ratio | cpu_overhead_pct |" in new  # a row per configuration
    assert "| default | 1.0852 | 8.52043 |" in new
    assert "`results.default.probes`:" in new and "| every | 1 |" in new
    assert "`trials`: 30 entries (in the raw JSON)" in new
    assert text.index("## overhead_b32_x") < text.index("## overhead_old")  # sections sorted by name
    summarise.update_page(page, {"overhead_b32_x": RESULT})
    assert page.read_text() == text  # made again from the same JSON: the same page


def test_the_command_line_writes_each_result_into_its_page(summarise, tmp_path, monkeypatch):
    monkeypatch.setattr(summarise, "RESULTS", tmp_path)
    (tmp_path / "elastic.json").write_text(json.dumps({"summary": {"left_at": 63, "lost_steps": 0}}))
    assert summarise.main([str(tmp_path / "elastic.json")]) == 0
    text = (tmp_path / "elastic.md").read_text()
    assert "Command: `python bench/bench_elastic.py --out bench/results/elastic.json`" in text
    assert "| left_at | 63 |" in text and "| lost_steps | 0 |" in text
