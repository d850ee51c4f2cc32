"""``sdcwatch checkpoints`` end to end: a job reports checkpoints through the real broker, a real
``sdcwatch serve`` marks them from its incidents, the command lists them and names the newest clean one."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid

import pytest
from polling import wait_for
from sdcwatch.telemetry import Emitter
from serve_process import ServeProcess, Topics

pytestmark = pytest.mark.integration


def _listing(bootstrap: str, topic: str, run: str) -> dict:
    cmd = [sys.executable, "-m", "sdcwatch.cli", "checkpoints", "--run", run, "--json"]
    out = subprocess.run(
        [*cmd, "--bootstrap", bootstrap, "--topic", topic], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


def test_checkpoints_after_a_divergence_at_step_50_are_not_clean_and_40_is_the_newest_clean(bootstrap, tmp_path):
    topics, run = Topics.fresh(), f"ck-{uuid.uuid4().hex[:6]}"
    with ServeProcess(bootstrap, topics, tmp_path / "state", "--detectors-align-timeout-s", "1") as serve:
        serve.wait_banner()
        rng = random.Random(1)
        ems = [
            Emitter(run=run, rank=r, world=4, host=f"h{r}", bootstrap=bootstrap, topic=topics.telemetry)
            for r in range(4)
        ]
        for step in range(100):
            for r, em in enumerate(ems):  # rank 2's parameters differ from its replicas' from step 50
                fp = 1000 + step + (7 if r == 2 and step >= 50 else 0)
                em.emit(
                    step,
                    loss=2.0 + rng.gauss(0, 0.01),
                    grad_norm=1.0 + rng.gauss(0, 0.01),
                    fingerprints={"param_fp": fp},
                )
            if step in (20, 40, 60, 80):
                ems[0].checkpoint(step, f"/ckpt/{run}/step-{step}")
        for em in ems:
            em.close()

        def marked() -> dict | None:
            got = _listing(bootstrap, topics.anomalies, run)
            return got if len(got["checkpoints"]) == 4 else None

        got = wait_for(marked, 60, "four checkpoints marked", interval=1.0)
        marks = {c["step"]: c["mark"] for c in got["checkpoints"]}
        assert marks[20] == marks[40] == "clean"
        assert marks[60] in ("suspect", "after-fault") and marks[80] in ("suspect", "after-fault")
        assert got["newest_clean"]["step"] == 40 and got["newest_clean"]["path"] == f"/ckpt/{run}/step-40"
        samples = serve.scrape()
        clean = [s for s in samples if s.name == "sdcwatch_checkpoint_newest_clean_step" and s.labels["run"] == run]
        assert [s.value for s in clean] == [40.0]
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdcwatch.cli",
            "checkpoints",
            "--run",
            run,
            "--bootstrap",
            bootstrap,
            "--topic",
            topics.anomalies,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert f"newest clean: step 40 /ckpt/{run}/step-40" in text
