"""examples/nanogpt_ddp.py as a user runs it: torchrun with two gloo ranks, the run named by
SDCWATCH_RUN, records through the embedded broker to `sdcwatch serve`.

The two runs go side by side, as two jobs would. A NaN written into block 1's attention output on
rank 1 at step 12 must be one non-finite incident naming rank 1, layer 1 and step 12; the same
script without the fault must raise no incident at all.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest

pytest.importorskip("torch")

from example_runs import EXAMPLES, finish, start_example  # noqa: E402
from serve_process import ServeProcess, Topics, wait_finished  # noqa: E402

pytestmark = pytest.mark.integration

EXAMPLE = EXAMPLES / "nanogpt_ddp.py"
STEPS, NAN_STEP, NAN_RANK, NAN_LAYER = 24, 12, 1, 1


def torchrun(bootstrap: str, topic: str, run: str, *flags: str) -> subprocess.Popen:
    """Start the example on two ranks as ``torchrun --standalone --nproc-per-node 2`` would."""
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE)]
    return start_example([*args, "--steps", str(STEPS), "--topic", topic, *flags], bootstrap, run)


def test_nan_on_rank_1_is_named_and_a_clean_run_raises_nothing(bootstrap, tmp_path):
    topics = Topics.fresh()
    clean, faulty = f"clean-{uuid.uuid4().hex[:6]}", f"nan-{uuid.uuid4().hex[:6]}"
    with ServeProcess(bootstrap, topics, tmp_path / "state") as service:
        url = service.wait_banner()
        flags = ("--nan-step", str(NAN_STEP), "--nan-rank", str(NAN_RANK), "--nan-layer", str(NAN_LAYER))
        runs = [torchrun(bootstrap, topics.telemetry, clean), torchrun(bootstrap, topics.telemetry, faulty, *flags)]
        outs = [finish(proc) for proc in runs]
        for out in outs:
            for rank in (0, 1):
                assert f"rank {rank}: {STEPS} steps, {STEPS} records sent, 0 dropped" in out, out
        opened = service.wait_incident("nonfinite")
        # both runs sent their end-of-run markers: everything they sent has been judged
        wait_finished(url, (clean, faulty))
        events = service.events()
    assert opened["run"] == faulty
    assert (opened["first_step"], opened["ranks"], opened["layer"]) == (NAN_STEP, [NAN_RANK], NAN_LAYER), opened
    assert [e for e in events if e["run"] == clean] == []
    assert {e["kind"] for e in events if e["run"] == faulty} == {"nonfinite"}, events
