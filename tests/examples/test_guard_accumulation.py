"""tests/examples/guarded_accumulation.py as a user runs it (one process, then torchrun with two gloo
ranks): nanoGPT's accumulation loop is guarded without a change to its micro-step body, and

- in report mode the guarded loop's parameters are bit for bit the unguarded loop's;
- a NaN of one step is rerun as the transient fault it is and nothing is lost: the parameters end bit
  for bit where the clean loop's do;
- a NaN that lasts is repeated by the rerun and the step is skipped, at its step and the next ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).with_name("guarded_accumulation.py")
FAULT_STEP = 8


def run(*launcher: str) -> list[dict]:
    """Each rank's JSON line, ordered by rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    out = subprocess.run([sys.executable, *launcher, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return sorted(lines, key=lambda r: r["rank"])


def check(rank: dict) -> None:
    clean, _ = rank["nanogpt"]
    assert rank["report"] == [clean, []], rank["report"]
    assert rank["transient"] == [clean, [[FAULT_STEP, "rerun", "transient", True]]], rank["transient"]
    faulted, outcomes = rank["persistent"]
    assert faulted != clean
    assert outcomes[:3] == [[s, "skip", "reproducible", False] for s in (FAULT_STEP, FAULT_STEP + 1, FAULT_STEP + 2)]


def test_one_process_transient_is_recovered_bit_for_bit_and_persistent_is_skipped():
    (rank,) = run()
    check(rank)


@pytest.mark.integration
def test_two_ddp_ranks_recover_a_transient_fault_of_one_rank_and_stay_equal():
    ranks = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        check(rank)
    assert ranks[0]["transient"] == ranks[1]["transient"]  # the replicas stay equal
