"""The test bed: what the tests, the demo and the benchmarks train and inject faults into.

Not part of what runs in a rank's normal training. The reference training run, a small byte-level
GPT on a corpus built from the stdlib, the fault injector, and the example users copy:

* :mod:`.model` - the GPT, attention written out so probes and faults reach q, k and the logits;
* :mod:`.corpus` - the standard library's ``.py`` files as bytes, batches a function of
  ``(seed, step, rank)``;
* :mod:`.faultspec` / :mod:`.faults` - what a fault is, and the injector that applies faults to a
  model (in any training loop: to test your alerting);
* :mod:`.simulated` - W virtual data-parallel ranks in one process (fast: demos, benchmarks);
* :mod:`.synthetic_steps` - every rank's statistics of a step drawn at once, no training (detector
  tests, the fleet campaign);
* :mod:`.wire_frames` - the frames the service builds from records sent in a wire format;
* :mod:`.ddp` - real ``torch.distributed`` DDP over gloo (integration test, user example);
* :mod:`.campaign` - the fault-injection campaign and the benchmarks (``sdcwatch bench``); not in
  the base wheel: the ``sdcwatch-campaign`` distribution, built from ``testbed/campaign/``.

Importing this package is cheap; each name imports its module (and torch) on first use (PEP 562).
"""

from __future__ import annotations

from sdcwatch.core.lazy import by_module, lazy_attributes

_LAZY = by_module(
    {
        "sdcwatch.testbed.model": "GPT GPTConfig next_byte_loss",
        "sdcwatch.testbed.corpus": "Corpus stdlib_sources",
        "sdcwatch.testbed.simulated": "shared_corpus SimulatedRun",
        "sdcwatch.testbed.ddp": "DDPSettings launch",
        "sdcwatch.testbed.faultspec": "FaultSpec load_faults parse_faults",
        "sdcwatch.testbed.faults": "FaultInjector",
    }
)

__all__ = sorted(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
