"""The cost of the exporter's per-piece statistics at large world sizes, beside the run-wide ones.

``frame_stats`` runs in the spatial stage every ``stats_every`` (10) steps and, in one process,
when a scrape finds a new step (:func:`sdcwatch.service.run_state.run_view`); under tensor or
pipeline parallelism it also takes the quantiles within every model piece
(:func:`sdcwatch.detectors.piece_stats.piece_stats`). This times both on a synthetic step of 11
scalars and 7 layer metrics x 5 layers (a pipeline stage's share), best of ``--rounds``::

    .venv/bin/python bench/bench_piece_stats.py --layouts tp=8,pp=16,dp=128 tp=8,pp=16,dp=782
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from sdcwatch.core.mesh import DIMS, Layout
from sdcwatch.detectors.frame import StepFrame, frame_stats
from sdcwatch.detectors.piece_stats import piece_stats


def synthetic_frame(layout: str, seed: int = 0) -> StepFrame:
    """One step of every rank of ``layout`` with random values, each rank carrying its coordinates."""
    lay = Layout.parse(layout)
    coords = np.full((lay.world, len(DIMS)), -1, np.int64)
    for rank in range(lay.world):
        for d, v in lay.coords(rank).items():
            coords[rank, DIMS.index(d)] = v
    rng = np.random.default_rng(seed)
    return StepFrame(
        run="bench",
        step=0,
        world=lay.world,
        hosts=("",) * lay.world,
        present=np.ones(lay.world, bool),
        scalar_names=tuple(f"s{i}" for i in range(11)),
        scalars=rng.normal(size=(lay.world, 11)),
        layer_names=tuple(f"l{i}" for i in range(7)),
        layers=rng.normal(size=(lay.world, 7, 5)),
        coords=coords,
    )


def best_of(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["tp=8,pp=16,dp=128", "tp=8,pp=16,dp=782"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for layout in args.layouts:
        frame = synthetic_frame(layout)
        frame.peers  # the detectors form the peer groups of every step anyway
        result = {
            "layout": layout,
            "world": frame.world,
            "pieces": frame.peers.n,
            "frame_stats_ms": round(1e3 * best_of(lambda: frame_stats(frame), args.rounds), 1),
            "piece_stats_ms": round(1e3 * best_of(lambda: piece_stats(frame), args.rounds), 1),
        }
        print(json.dumps(result))


if __name__ == "__main__":
    main()
