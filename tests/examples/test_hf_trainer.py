"""examples/hf_trainer.py as a user runs it (one process, the run named by SDCWATCH_RUN), records
through the embedded broker to `sdcwatch serve`: a NaN at step 12 must be one non-finite incident
at step 12 naming layer 1 (block ``transformer.h.1``); the same script without it raises nothing.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from installed import needs

pytest.importorskip("torch")
needs("transformers", "accelerate")

from example_runs import EXAMPLES, finish, start_example  # noqa: E402
from polling import wait_for  # noqa: E402
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC  # noqa: E402
from serve_process import ServeProcess, Topics, wait_finished  # noqa: E402

pytestmark = pytest.mark.integration

EXAMPLE = EXAMPLES / "hf_trainer.py"
STEPS, NAN_STEP = 24, 12


def start(bootstrap: str, run: str, out: Path, *flags: str) -> subprocess.Popen:
    """Start ``python examples/hf_trainer.py`` with the run's environment."""
    return start_example([str(EXAMPLE), "--steps", str(STEPS), "--output-dir", str(out), *flags], bootstrap, run)


def test_nan_is_an_incident_at_its_step_and_layer_and_a_clean_run_raises_nothing(bootstrap, tmp_path):
    # the callback's emitter writes the default topic, as a user's would; the runs' names keep
    # them apart from anything else the session broker holds there
    tag = uuid.uuid4().hex[:8]
    topics = Topics(TELEMETRY_TOPIC, f"anom.{tag}", f"dead.{tag}")
    clean, faulty = f"hf-clean-{uuid.uuid4().hex[:6]}", f"hf-nan-{uuid.uuid4().hex[:6]}"
    with ServeProcess(bootstrap, topics, tmp_path / "state") as service:
        url = service.wait_banner()
        runs = [
            start(bootstrap, clean, tmp_path / "clean"),
            start(bootstrap, faulty, tmp_path / "nan", "--nan-step", str(NAN_STEP)),
        ]
        for out in [finish(proc) for proc in runs]:
            assert f"{STEPS} steps, {STEPS} records sent, 0 dropped" in out, out
        opened = wait_for(
            lambda: next((e for e in service.events() if e["run"] == faulty and e["change"] == "opened"), None),
            90,
            f"an incident of run {faulty}",
            interval=0.5,
        )
        wait_finished(url, (clean, faulty))
        events = service.events()
    assert opened["kind"] == "nonfinite"
    assert (opened["first_step"], opened["layer"]) == (NAN_STEP, 1), opened
    assert [e for e in events if e["run"] == clean] == []
    assert {e["kind"] for e in events if e["run"] == faulty} == {"nonfinite"}, events
