"""The simulated training job the service tests watch: data-parallel ranks of the reference model
sending to a topic through the real broker, with a NaN in rank 2's attention scores at one step."""

from __future__ import annotations

__all__ = ["nan_run"]


def nan_run(bootstrap: str, topic: str, run: str, nan_step: int, world: int = 4, **settings):
    """A ``SimulatedRun`` of ``world`` ranks (seed 3, batches of 4) emitting run ``run`` to ``topic``,
    with a NaN in block 0's attention scores on rank 2 at ``nan_step``; ``settings`` go to it."""
    from sdcwatch.telemetry import Emitter, KafkaTransport
    from sdcwatch.testbed.faultspec import FaultSpec
    from sdcwatch.testbed.simulated import SimulatedRun

    fault = FaultSpec(
        kind="nan", rank=2, step=nan_step, duration=1, target="blocks.0.attn.scores", where="output", seed=1
    )
    return SimulatedRun(
        world=world,
        seed=3,
        faults=[fault],
        batch_size=4,
        emitter_factory=lambda rank, host: Emitter(
            KafkaTransport(bootstrap, topic), run=run, rank=rank, world=world, host=host
        ),
        **settings,
    )
