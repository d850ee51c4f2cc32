"""docs/guard.md runs as written: its Python blocks copied into files and run as a user runs them (the
training loop against the embedded broker, the device skip to a file), its TOML read by `serve`'s
configuration loader.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

DOC = Path(__file__).resolve().parents[2] / "docs" / "guard.md"


def blocks(lang: str) -> list[str]:
    """The page's fenced blocks of ``lang``, in order."""
    return [code for tag, code in re.findall(r"```(\w*)\n(.*?)```", DOC.read_text(), re.S) if tag == lang]


def block_with(lang: str, text: str) -> str:
    (code,) = [b for b in blocks(lang) if text in b]
    return code


def run_block(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    (cwd / "block.py").write_text(code)
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    environ.update(OMP_NUM_THREADS="1", **env)
    return subprocess.run(
        [sys.executable, "block.py"], cwd=cwd, env=environ, capture_output=True, text=True, timeout=180
    )


def test_every_python_block_of_the_page_is_run_by_a_test():
    loops = [b for b in blocks("python") if "guard.step(" in b]
    skips = [b for b in blocks("python") if "DeviceSkip(" in b]
    assert len(loops) == 1 and len(skips) == 1 and len(blocks("python")) == 2


def test_the_device_skip_block_runs_and_records_every_step(tmp_path):
    out = run_block(block_with("python", "DeviceSkip("), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert sorted(set(s for s in steps if s >= 0)) == list(range(40))
    assert out.stdout.count("{") == 2  # skipped() printed on the logging steps 0 and 20


@pytest.mark.integration
def test_the_training_loop_runs_on_the_bus_and_sends_every_step(bootstrap, consume, tmp_path):
    topic, run = f"t.{uuid.uuid4().hex[:10]}", f"doc-guard-{uuid.uuid4().hex[:6]}"
    code = block_with("python", "guard.step(")
    out = run_block(code, tmp_path, SDCWATCH_BOOTSTRAP=bootstrap, SDCWATCH_RUN=run, SDCWATCH_BUS_TELEMETRY_TOPIC=topic)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = int(re.search(r"ACCUM, STEPS = \d+, (\d+)", code).group(1))
    records, _ = consume(bootstrap, topic, steps, grace=0.5)
    got = sorted({r.step for r in records if r.run == run and r.step >= 0})
    assert got == list(range(steps)), got


def test_the_service_settings_are_what_serve_reads(tmp_path):
    from sdcwatch.config.loaders import load_config

    (tmp_path / "serve.toml").write_text(block_with("toml", "[guard]"))
    guard = load_config(tmp_path / "serve.toml", env={}).guard
    assert guard.actions is True
    assert (guard.on_sdc_suspected, guard.on_replica_divergence, guard.on_loss_spike) == ("evict", "rollback", "none")
