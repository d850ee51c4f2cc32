"""The smallest attention logit that is not a mask: -inf and the dtype's lowest value are masks."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.telemetry.probes.residual_stream import ResidualStream  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logits_masked_with_the_dtypes_lowest_value_report_their_real_minimum(dtype):
    lowest = torch.finfo(dtype).min
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    logits = (3 * torch.randn(2, 2, 6, 6)).to(dtype)
    # Hugging Face's additive mask: the dtype's lowest value added to the logit (in bf16 and fp16
    # the sum rounds to a value a little above the lowest, or to it)
    hf = logits + torch.zeros(6, 6, dtype=dtype).masked_fill(future, lowest)
    stream = ResidualStream(torch.nn.Module(), n_attention=2)
    stream.observe_logits(0, logits.masked_fill(future, float("-inf")))
    stream.observe_logits(1, hf)
    got = stream.collect()
    expected = float(logits.masked_fill(future, float("inf")).amin())
    assert float(got["attn_logit_min"][0]) == pytest.approx(expected)
    assert float(got["attn_logit_min"][1]) == pytest.approx(expected)  # not 0 ("no minimum") any more

    if dtype == torch.float32:  # a near-INF below zero in such a layer is still a near-INF
        bad = hf.clone()
        bad[0, 1, 4, 2] = -5e10
        stream.observe_logits(1, bad)
        assert float(stream.collect()["attn_logit_min"][1]) == pytest.approx(-5e10)


def test_a_nan_in_the_logits_shows_in_the_maximum_and_leaves_no_minimum():
    logits = torch.randn(1, 1, 4, 4)
    logits[0, 0, 1, 0] = float("nan")
    stream = ResidualStream(torch.nn.Module(), n_attention=1)
    stream.observe_logits(0, logits)
    got = stream.collect()
    assert math.isnan(float(got["attn_logit_max"][0])) and float(got["attn_logit_min"][0]) == 0.0


def test_hugging_faces_own_masked_logits_give_the_smallest_unmasked_logit_of_every_layer():
    """The logits a real Hugging Face Llama hands to softmax (eager attention, causal and padding
    mask added as the dtype's lowest value), as a layer reporting them would pass them on."""
    pytest.importorskip("transformers")
    from tiny_llama import tiny_llama, tokens
    from torch.overrides import TorchFunctionMode

    batch = tokens(0, 0)
    mask = torch.ones_like(batch)
    mask[0, :3] = 0  # left padding

    class SoftmaxInputs(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax):
                self.seen.append(args[0].detach().clone())
            return func(*args, **(kwargs or {}))

    with SoftmaxInputs() as spy, torch.no_grad():
        tiny_llama("eager")(input_ids=batch, attention_mask=mask)
    lowest = torch.finfo(torch.float32).min
    assert len(spy.seen) == 2 and all(float(s.amin()) <= lowest / 2 for s in spy.seen)  # masked as HF masks
    stream = ResidualStream(torch.nn.Module(), n_attention=2)
    for i, s in enumerate(spy.seen):
        stream.observe_logits(i, s)
    got = stream.collect()["attn_logit_min"]
    for i, s in enumerate(spy.seen):
        smallest = float(s[s > lowest / 2].min())
        assert smallest < 0 and float(got[i]) == pytest.approx(smallest, rel=1e-6)


class _Blocks(torch.nn.Module):
    """Two blocks whose outputs are whatever the test sets (the hooks see them as the block outputs)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Identity()) for _ in range(2))

    def forward(self, xs):
        return [b(x) for b, x in zip(self.blocks, xs)]


@pytest.mark.parametrize(
    "values, peak",
    [
        ([0.5, 2.0, 3.0], 3.0),  # all above zero: the largest
        ([-4.0, -1.0, -0.5], 4.0),  # all below zero: the smallest's magnitude
        # -inf is a mask mark, not a value: the minimum then counts for nothing, the maximum's magnitude does
        ([float("-inf"), -3.0, 1.0], 1.0),
        ([float("-inf"), -3.0, -2.0], 2.0),
        ([float("inf"), 0.0, 1.0], math.inf),
        ([-0.0, -0.0, -0.0], 0.0),
        ([float("nan"), 1.0, -2.0], math.nan),
    ],
)
def test_each_blocks_largest_magnitude_skips_minus_inf_and_keeps_nan(values, peak):
    model = _Blocks()
    stream = ResidualStream(model, n_attention=1)
    model([torch.tensor(values), torch.tensor([1.0, -7.0])])
    stream.observe_logits(0, torch.tensor([[float("-inf"), 2.0], [-3.0, float("nan")]]))
    got = stream.collect()
    first, second = (float(v) for v in got["stream_max"])
    assert (math.isnan(first) if math.isnan(peak) else first == peak) and second == 7.0
    assert math.isnan(float(got["attn_logit_max"][0])) and float(got["attn_logit_min"][0]) == 0.0
    # a step that sees a block twice and the layers out of order: the largest per block, the smallest per layer
    model([torch.tensor([1.0, -7.0]), torch.tensor([2.0])])
    model([torch.tensor([-9.0]), torch.tensor([1.0])])
    stream.observe_logits(1, torch.tensor([[-2.0, float("-inf")]]))
    stream.observe_logits(0, torch.tensor([[-5.0, 4.0]]))
    stream.observe_logits(1, torch.tensor([[-6.0, 3.0]]))
    got = stream.collect(2)
    assert got["stream_max"].tolist() == [9.0, 2.0]
    assert got["attn_logit_max"].tolist() == [4.0, 3.0] and got["attn_logit_min"].tolist() == [-5.0, -6.0]
