"""``nonfinite_first`` on a real model: the forward position of the first NaN, Inf or near-INF output
the probes saw, smaller for a fault in an earlier module, sent only on a step with a bad value."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.vocabulary import FIRST_BAD  # noqa: E402
from sdcwatch.telemetry.probes.forward_order import ForwardOrder  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402

torch.set_num_threads(1)
CFG = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4, vocab=64)


class Recorder:
    def __init__(self):
        self.records = []

    def emit(self, step, *, layers=None, fingerprints=None, time=None, **scalars):
        self.records.append({"step": step, "layers": layers, "scalars": scalars})


def _poison(value: float):
    def hook(module, args, output):
        out = output.clone()
        out.view(-1)[5] = value
        return out

    return hook


@pytest.fixture(scope="module")
def positions():
    """{(step, module the value was written into): the step's record scalars}: one step per fault on
    a fresh replica of one model (checked steps and scanned steps alike)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rec = Recorder()
    watch = attach(model, rec, checksum_every=2, stream_every=1, activations_every=0)
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq_len))
    faults = [
        (None, math.nan),
        ("blocks.0.attn.qkv", math.nan),
        ("blocks.0.attn.scores", math.inf),
        ("blocks.1.attn.qkv", math.nan),
        ("blocks.1.mlp.fc", 1e12),
        ("blocks.1", math.nan),
        ("head", math.nan),
    ]
    out = {}
    for step, (target, value) in enumerate(faults * 2):  # each fault on a checked and a scanned step
        model.load_state_dict(state)
        handle = model.get_submodule(target).register_forward_hook(_poison(value), prepend=True) if target else None
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab), tokens.reshape(-1))
        loss.backward()
        model.zero_grad()
        if handle is not None:
            handle.remove()
        watch.step(step, loss=loss)
        watch.flush()
        out[step, target] = rec.records[-1]["scalars"]
    watch.close()
    return out, len(faults)


def test_a_fault_in_an_earlier_module_has_a_smaller_position(positions):
    got, n = positions
    for checked in (True, False):
        at = {target: s.get(FIRST_BAD) for (step, target), s in got.items() if (step % 2 == 0) == checked}
        assert at[None] is None  # a clean step sends none
        # forward order: qkv (a product), the logits, mix, proj, fc, mlp.proj, the block's output
        assert at["blocks.0.attn.qkv"] == 0.0
        assert at["blocks.0.attn.scores"] == 1.0  # the first attention layer's logits
        assert at["blocks.1.attn.qkv"] == 7.0
        assert at["blocks.1.mlp.fc"] == 11.0  # near-INF counts
        assert at["blocks.1"] == 13.0  # the second block's output, written after its products
        assert at["head"] == 14.0
        order = [at[t] for t in ("blocks.0.attn.qkv", "blocks.0.attn.scores", "blocks.1.attn.qkv", "blocks.1.mlp.fc")]
        assert order == sorted(order)


def test_forward_order_without_a_bad_value_gives_minus_one_and_restarts():
    order = ForwardOrder()
    assert order.first() is None
    a, b = order.tick(), order.tick()
    order.note([a, b], torch.tensor([1.0, 2.0]))
    assert float(order.first()) == -1.0
    assert order.tick() == 0  # the next step numbers from 0
    c = order.tick()
    order.note([0, c], torch.tensor([float("nan"), float("inf")]))
    assert float(order.first()) == 0.0
