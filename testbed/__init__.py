"""The test bed: what the tests, the demo and the benchmarks train and inject faults into.

Not part of what runs in a rank's normal training. The reference training run, a small byte-level
GPT on a corpus built from the stdlib, the fault injector, and the example users copy:

* :mod:`.model` - the GPT, attention written out so probes and faults reach q, k and the logits;
* :mod:`.corpus` - the standard library's ``.py`` files as bytes, batches a function of
  ``(seed, step, rank)``;
* :mod:`.faultspec` / :mod:`.faults` - what a fault is, and the injector that applies faults to a
  model (in any training loop: to test your alerting);
* :mod:`.simulated` - W virtual data-parallel ranks in one process (fast: demos, benchmarks);
* :mod:`.ddp` - real ``torch.distributed`` DDP over gloo (integration test, user example);
* :mod:`.campaign` - the fault-injection campaign that scores sdcwatch and the baselines, from its
  parts: :mod:`.fault_classes`, :mod:`.trials`, :mod:`.branches` (a run from the checkpoint),
  :mod:`.impact` (the ground truth), :mod:`.scoring`, :mod:`.campaign_summary`,
  :mod:`.campaign_targets` and :mod:`.guard_campaign` (the guarded third way).

Importing this package is cheap; each name imports its module (and torch) on first use (PEP 562).
"""

from __future__ import annotations

from sdcwatch.core.lazy import lazy_attributes

_LAZY = {
    "GPT": "sdcwatch.testbed.model",
    "GPTConfig": "sdcwatch.testbed.model",
    "next_byte_loss": "sdcwatch.testbed.model",
    "Corpus": "sdcwatch.testbed.corpus",
    "stdlib_sources": "sdcwatch.testbed.corpus",
    "shared_corpus": "sdcwatch.testbed.simulated",
    "SimulatedRun": "sdcwatch.testbed.simulated",
    "DDPSettings": "sdcwatch.testbed.ddp",
    "launch": "sdcwatch.testbed.ddp",
    "FaultSpec": "sdcwatch.testbed.faultspec",
    "load_faults": "sdcwatch.testbed.faultspec",
    "parse_faults": "sdcwatch.testbed.faultspec",
    "FaultInjector": "sdcwatch.testbed.faults",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_attributes(__name__, _LAZY)
