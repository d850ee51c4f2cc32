"""Elastic eviction against a clean twin and against evict-and-restart, on real torchft replica groups.

Two runs of ``--replicas`` replica groups of the reference GPT (one process each, gloo on the CPU,
one thread per process, a torchft lighthouse): ``leave``, with the ``unhealthy-node`` noise on
``--fault-rank`` from ``--fault-step`` and the detector service's evict decision read by rank 0's
guard at ``--decide-at`` (a :class:`~sdcwatch.core.control.Decision` decoded from its wire form; the
default delay, 3 steps, is the demo's: ``sdcwatch demo --guard --fault unhealthy-node`` finds the
fault at its step and the guard acts 3 steps later), and ``clean``, the same job with neither.
Reported: the step the group left, the steps the others did not commit (lost), their final loss on
a fixed held-out set against the clean twin's, whether the survivors' parameters are bit-identical
(SHA-256), the seconds the quorum change cost them, and what evict-and-restart would cost instead:
modelled from this run's measured start-up (spawn, imports, model, manager, first quorum) plus the
steps replayed from the last checkpoint (every ``--checkpoint-every`` steps) at the measured step
time::

    .venv/bin/python bench/bench_elastic.py --out bench/results/elastic.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def summarise(leave: dict, clean: dict, checkpoint_every: int) -> dict:
    """The numbers of the note from the two runs' reports."""
    s = leave["settings"]
    gone = [r for r in leave["replicas"] if r["left_at"] is not None]
    stay = [r for r in leave["replicas"] if r["left_at"] is None]
    left_at = gone[0]["left_at"] if gone else None
    step_s = statistics.median(t for r in stay for t in r["step_seconds"][1:])
    change = max(r["step_seconds"][left_at + 1] for r in stay) if left_at is not None else 0.0
    clean_loss = statistics.mean(r["eval_loss"] for r in clean["replicas"])
    loss = statistics.mean(r["eval_loss"] for r in stay)
    startup = max(r["startup_seconds"] + r["step_seconds"][0] for r in leave["replicas"])
    replay = (left_at + 1) % checkpoint_every if left_at is not None else 0
    restart = startup + replay * step_s
    return {
        "replicas": s["replicas"],
        "steps": s["steps"],
        "fault": {"rank": s["fault_rank"], "step": s["fault_step"], "decision_at": s["decide_at"]},
        "left_at_step": left_at,
        "left_ranks": [r["replica"] for r in gone],
        "quorum_after": stay[0]["quorum"][left_at + 1] if left_at is not None else None,
        "survivor_steps_lost": sum(len(r["commits"]) - sum(r["commits"]) for r in stay)
        + sum(s["steps"] - r["steps_run"] for r in stay),
        "survivor_eval_loss": loss,
        "clean_twin_eval_loss": clean_loss,
        "loss_vs_clean_twin_pct": 100 * (loss - clean_loss) / clean_loss,
        "left_replica_eval_loss": gone[0]["eval_loss"] if gone else None,
        "survivor_params_identical": len({r["param_sha256"] for r in stay}) == 1,
        "median_step_seconds": step_s,
        "quorum_change_seconds": change - step_s,
        "restart_model": {
            "startup_and_rendezvous_seconds": startup,
            "steps_replayed": replay,
            "checkpoint_every": checkpoint_every,
            "seconds": restart,
        },
        "time_saved_seconds": restart - (change - step_s),
    }


def main(argv: list[str] | None = None) -> int:
    from sdcwatch.testbed.elastic import ElasticSettings, run_elastic

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--fault-rank", type=int, default=2)
    ap.add_argument("--fault-step", type=int, default=60)
    ap.add_argument("--decide-at", type=int, default=63)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    base = ElasticSettings(
        replicas=a.replicas, steps=a.steps, fault_rank=a.fault_rank, fault_step=a.fault_step, decide_at=a.decide_at
    )
    leave = run_elastic(base)
    clean = run_elastic(replace(base, mode="clean"))
    result = summarise(leave, clean, a.checkpoint_every)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"summary": result, "leave": leave, "clean": clean}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
