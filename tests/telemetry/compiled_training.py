"""Training a watched model under torch.compile for the compile tests (test_compile*.py): the
models, their batches, a record sink, torch.compile's counters and the settings each test runs
under. Split from the tests so that their modules (graphs, inductor, the integrations) run on
different workers."""

from __future__ import annotations

import torch
from sdcwatch.telemetry.probes.presets import PROBE_PRESETS
from sdcwatch.telemetry.probes.watch import attach

__all__ = ["STEPS", "Records", "Sink", "compiled_settings", "counters", "reference", "run_steps", "tokens", "train"]

# sampled steps 0 and 16 (attention, activations, checksums every 16th), plain ones between and step 17
# after: sampled -> plain, plain -> sampled and sampled -> plain again, each compiled variant reused
STEPS = 18


class Records:
    def __init__(self) -> None:
        self.by_step: dict[int, dict] = {}

    def emit(self, step: int, **fields) -> None:
        self.by_step[step] = fields


class Sink(Records):
    def close(self, timeout: float | None = None) -> None:
        pass


def reference():
    """The reference model, its loss and its batches."""
    from sdcwatch.testbed.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    return model, lambda m, x: m(x).float().logsumexp(-1).mean(), lambda s: tokens(s, 256, (4, 32))


def counters():
    """torch.compile's counters (torch._dynamo imported here, not at collection: seconds of every test worker's start)."""
    from torch._dynamo.utils import counters

    return counters


def tokens(step: int, vocab: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(step))


def run_steps(model, loss_of, batch, opt, w, steps) -> None:
    """Train ``model`` over ``steps`` with the watch ``w`` closing each step, then close it."""
    for step in steps:
        loss = loss_of(model, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        w.step(step, loss=loss)
    w.close()


def train(build, *, watch: bool, backend: str = "aot_eager", compile_first: bool = False, preset: str = "default"):
    """(graphs, graph breaks, graph break reasons, records) of STEPS compiled training steps."""
    torch._dynamo.reset()
    count = counters()
    count.clear()
    model, loss_of, batch = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = Records()
    compiled = torch.compile(model, backend=backend)
    w = None
    if watch:
        target = compiled if compile_first else model
        w = attach(target, records, optimizer=opt, config=PROBE_PRESETS[preset])
    try:
        for step in range(STEPS):
            loss = loss_of(compiled, batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if w is not None:
                w.step(step, loss=loss)
    finally:
        if w is not None:
            w.close()
    graphs = count["stats"]["unique_graphs"]
    breaks = sum(count["graph_break"].values())
    return graphs, breaks, dict(count["graph_break"]), records.by_step


def compiled_settings(monkeypatch):
    """What each compile test runs under (a generator for an autouse fixture): the opt-in
    weight-gradient check on, one torch thread, Dynamo's caches reset after the test."""
    # the weight-gradient check in compiled backwards is opt-in (it failed inductor on torch 2.11 CUDA)
    monkeypatch.setenv("SDCWATCH_COMPILED_GRAD_CHECK", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch._dynamo.reset()
