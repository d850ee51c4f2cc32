"""The test bed: what the tests, the demo and the benchmarks train and inject faults into.

Not part of what runs in a rank. The reference training run, a small byte-level GPT on a corpus
built from the stdlib, and the example users copy:

* :mod:`.model` - the GPT, attention written out so probes and faults reach q, k and the logits;
* :mod:`.corpus` - the standard library's ``.py`` files as bytes, batches a function of
  ``(seed, step, rank)``;
* :mod:`.simulated` - W virtual data-parallel ranks in one process (fast: demos, benchmarks);
* :mod:`.ddp` - real ``torch.distributed`` DDP over gloo (integration test, user example);
* :mod:`.campaign` - the fault-injection campaign that scores sdcwatch and the baselines.

Importing this package imports torch.
"""

from sdcwatch.testbed.corpus import Corpus, stdlib_sources
from sdcwatch.testbed.model import GPT, GPTConfig, next_byte_loss
from sdcwatch.testbed.simulated import SimulatedRun, shared_corpus

__all__ = [
    "GPT",
    "GPTConfig",
    "next_byte_loss",
    "Corpus",
    "stdlib_sources",
    "shared_corpus",
    "SimulatedRun",
    "DDPSettings",
    "launch",
]


def __getattr__(name: str):
    # the DDP driver pulls in torch.distributed: only when asked for
    if name in ("DDPSettings", "launch"):
        from sdcwatch.testbed import ddp

        return getattr(ddp, name)
    raise AttributeError(f"module 'sdcwatch.testbed' has no attribute {name!r}")
