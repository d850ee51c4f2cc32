"""The demo on a simulated tensor x pipeline x data parallel job (``--parallel tp=2,pp=2,dp=4``),
end to end on the real broker: ranks of different pieces differ by design and must not be blamed."""

from __future__ import annotations

import io
import json

import pytest
from serve_process import run_cli
from sdcwatch.core.kinds import LOCALISING_KINDS

pytestmark = pytest.mark.integration

pytest.importorskip("torch")

LAYOUT = "tp=2,pp=2,dp=4"


@pytest.mark.bench
def test_demo_parallel_names_the_unhealthy_rank_in_its_json_summary(tmp_path):
    demo = ["demo", "--parallel", LAYOUT, "--fault", "unhealthy-node", "--steps", "110", "--fault-step", "70"]
    out = run_cli(*demo, "--json", "--out-dir", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["ranks"] == 16
    assert summary["fault_rank"] == 11  # the default: a rank of the last stage (replica 1, tensor shard 1)
    assert summary["detected"] is True, summary["incidents"]
    assert summary["localized_rank"] == 11, summary["incidents"]
    assert summary["first_detection_step"] - 70 <= 50
    assert summary["false_alarms"] == 0, summary["incidents"]
    blamed = {r for i in summary["incidents"] if i["kind"] in LOCALISING_KINDS for r in i["ranks"]}
    assert blamed == {11}, summary["incidents"]
    named = next(i for i in summary["incidents"] if i["ranks"] == [11])
    assert named["coords"] == [{"pp": 1, "dp_replicate": 1, "tp": 1}]  # the incident says where the rank sits
    # the canary's incident names the product: at step 70 the last stage's canary checks its
    # product 70 mod 5 (blocks.1.attn.qkv, blocks.1.attn.proj, blocks.1.mlp.fc, blocks.1.mlp.proj, head)
    canary = next(i for i in summary["incidents"] if i["metric"] == "gemm_canary_fp")
    assert (canary["ranks"], canary["first_step"], canary["layer"]) == ([11], 70, 0), canary
    assert "gemm_canary_fp of blocks.1.attn.qkv (product 0)" in canary["message"], canary
    assert "16 simulated ranks (pp=2,dp_replicate=4,tp=2)" in out.stderr  # the progress says what it simulates


@pytest.mark.bench
def test_demo_parallel_clean_run_raises_nothing(tmp_path):
    from sdcwatch.demo import run_demo

    r = run_demo(
        fault="none", parallel=LAYOUT, steps=110, seed=0, out_dir=str(tmp_path), progress=io.StringIO(), quiet=True
    )
    assert r.ranks == 16
    assert r.incidents == []
    assert not r.detected and r.localized_rank is None


def test_demo_parallel_layout_errors_are_clear():
    out = run_cli("demo", "--parallel", "tp=2,pp=2,dp=4", "--ranks", "8")
    assert out.returncode != 0 and "--parallel" in out.stderr
    out = run_cli("demo", "--parallel", "tp=2,pp=two")
    assert out.returncode != 0 and "pp='two'" in out.stderr and "not a whole number" in out.stderr
