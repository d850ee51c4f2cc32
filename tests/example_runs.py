"""Running the examples as a user runs them: a child process with the run's environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def start_example(args: list[str], bootstrap: str, run: str) -> subprocess.Popen:
    """Start ``python ARGS...`` (an example, or ``-m torch.distributed.run ...``) with the run named
    by ``SDCWATCH_RUN`` and the bus by ``SDCWATCH_BOOTSTRAP``, as a user's shell would set them."""
    env = dict(os.environ, SDCWATCH_BOOTSTRAP=bootstrap, SDCWATCH_RUN=run, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    """Wait for a run started by :func:`start_example` (it must succeed); its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    return out
