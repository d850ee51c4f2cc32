"""No host sync on the step path: at the default configuration, nothing the probes do while the
training loop runs (forward, backward, optimizer step, ``watch.step``) reads a device value on the
training thread. On a GPU each such read would stall the step until the device caught up.

The reads are made to raise on the training thread (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool()``, ``float()``, ``int()`` of a tensor); the record is read on the probes'
sender thread a step later, as it must be, and the test checks the records arrived.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import pytest
import sdcwatch.core
import sdcwatch.telemetry
import torch
from sdcwatch.telemetry.probes.presets import PROBE_PRESETS
from sdcwatch.telemetry.probes.watch import attach

_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class HostRead(AssertionError):
    pass


#: The product's code (the optimizer's own reads, of a CPU step counter, are the job's, not ours).
_PRODUCT = tuple(os.path.dirname(m.__file__) + os.sep for m in (sdcwatch.telemetry, sdcwatch.core))


def _from_sdcwatch() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PRODUCT):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def no_host_reads(thread: threading.Thread):
    """Every device-to-host read of a tensor raises on ``thread`` while inside."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def guard(name):
        original = saved[name]

        def read(self, *args, **kwargs):
            if threading.current_thread() is thread and _from_sdcwatch():
                raise HostRead(f"Tensor.{name}() on the training thread")
            return original(self, *args, **kwargs)

        return read

    for name in _READS:
        setattr(torch.Tensor, name, guard(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


class Records:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def emit(self, step: int, **fields) -> None:
        self.steps.append(step)


@pytest.mark.parametrize("preset", ["default", "forward-checksums"])
def test_training_step_reads_nothing_on_the_host(preset):
    from sdcwatch.testbed.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = Records()
    watch = attach(model, records, optimizer=opt, config=PROBE_PRESETS[preset])
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(34)]
    with no_host_reads(threading.current_thread()):
        for step, x in enumerate(batches):  # steps 0 and 16 sampled (checksums, attention, activations)
            loss = model(x).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            watch.step(step, loss=loss)
    watch.close()
    assert watch.errors == 0
    assert records.steps == list(range(34))


def test_the_guard_catches_a_read():
    """The patch itself works: the product's host-side read of a packed step (what the sender
    thread does) raises on the training thread, and not on another thread."""
    from sdcwatch.telemetry.probes.packing import pack_step, unpack_step

    packed = pack_step(3, {"loss": torch.tensor(1.5)}, None, {}, {})
    with no_host_reads(threading.current_thread()):
        with pytest.raises(HostRead):
            unpack_step(packed)
        assert torch.ones(2).sum().item() == 2.0  # the test's own read is not the product's
        out = []
        other = threading.Thread(target=lambda: out.append(unpack_step(packed)[1]["loss"]))
        other.start()
        other.join()
        assert out == [1.5]
