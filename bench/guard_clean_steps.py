"""The shipped guard's false actions over a long clean run, with the whole loop closed.

Trains the campaign's simulated ranks to its checkpoint (the guard learning its baselines in report
mode, as the campaign does), warms the default detection pipeline up on those steps, then trains N
clean steps with ``GuardConfig(mode="act")`` and every completed step through the pipeline and
``ControlPolicy(actions=True)`` into the guard (:func:`sdcwatch.testbed.campaign.guarded.run_clean_guarded`).
Every action is a false one; the target is none.

    python bench/guard_clean_steps.py --steps 10000 --ranks 4 --out results/guard_clean_steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000, help="clean guarded steps after the checkpoint (10000)")
    ap.add_argument("--ranks", type=int, default=4, help="simulated data-parallel ranks (4)")
    ap.add_argument("--pretrain", type=int, default=150, help="steps to the checkpoint (150)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=500, help="steps between progress lines (and partial results)")
    ap.add_argument("--out", help="write the JSON result here (rewritten after every chunk)")
    args = ap.parse_args(argv)

    import torch

    from sdcwatch.telemetry.guard.config import GuardConfig
    from sdcwatch.testbed.campaign.branches import frames_of, new_run
    from sdcwatch.testbed.campaign.run import CampaignConfig
    from sdcwatch.testbed.campaign.guarded import campaign_guard_config, run_clean_guarded
    from sdcwatch.testbed.campaign.scoring import SdcwatchRunner, alarms_of

    torch.set_num_threads(1)
    config = replace(CampaignConfig(), world=args.ranks, pretrain_steps=args.pretrain, seed=args.seed)
    guard = campaign_guard_config()
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "command": "python bench/guard_clean_steps.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {**asdict(config), "steps": args.steps},
        "guard": asdict(guard),
        "control_policy": "ControlPolicy(actions=True)",
        "load_average_at_start": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="sdcwatch-guard-clean-") as tmp:
        records: list = []
        run = new_run(config, (), records, "campaign", guard=GuardConfig())  # report mode: baselines only
        try:
            run.train(config.pretrain_steps)
            run.save_checkpoint(Path(tmp) / "checkpoint.pt")
        finally:
            run.close()
        runner = SdcwatchRunner()
        result["alarms_during_warmup"] = len(alarms_of(runner, frames_of(records, config.world, config.wire)))

        def progress(state: dict[str, Any]) -> None:
            result.update(state, total_seconds=round(time.perf_counter() - t0, 1))
            print(
                f"guard clean steps: {state['steps']}/{args.steps} steps, {state['actions']} actions, "
                f"loss {state['last_loss']:.3f}, {state['seconds']:.0f}s",
                file=sys.stderr,
                flush=True,
            )
            _write(args.out, result)

        state = run_clean_guarded(
            config,
            Path(tmp) / "checkpoint.pt",
            args.seed + 1,
            runner,
            args.steps,
            guard=guard,
            chunk=args.chunk,
            progress=progress,
        )
    result.update(state, total_seconds=round(time.perf_counter() - t0, 1), met=state["actions"] == 0)
    _write(args.out, result)
    print(json.dumps({k: result[k] for k in ("steps", "actions", "reported_only", "reruns", "met", "total_seconds")}))
    return result


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
