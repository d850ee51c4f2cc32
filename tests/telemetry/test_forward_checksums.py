"""``checksum_forward_every``: the forward products and the weights in memory checked on every
step while the weight-gradient check stays sampled. A one-off flip in a product's output and a
weight flipped in memory are named at their step, on steps whose backward is not checked, and a
clean step raises nothing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from reference_loop import train_reference  # noqa: E402
from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.core.vocabulary import GEMM_METRICS  # noqa: E402
from sdcwatch.telemetry.probes.config import ProbeConfig  # noqa: E402
from sdcwatch.telemetry.probes.presets import PROBE_PRESETS, probe_config  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.testbed.faults import flip_bit  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402

torch.set_num_threads(1)
CFG = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4)
OUTPUT_FLIP = (3, "blocks.0.mlp.fc")  # step, product whose output gets one bit flipped
WEIGHT_FLIP = (5, "blocks.1.attn.proj")  # step, layer whose weight is flipped before the forward


class Recorder:
    def __init__(self):
        self.records = []

    def emit(self, step, *, layers=None, fingerprints=None, time=None, **scalars):
        self.records.append({"step": step, "layers": layers or {}, "scalars": scalars})


def _train(config: ProbeConfig, steps: int = 8) -> tuple[list[dict], list[str]]:
    """Train the reference model ``steps`` steps with the two flips; the records and product names."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = Recorder()
    watch = attach(model, rec, optimizer=opt, config=config)

    def flip_output(module, args, out):
        out = out.clone()
        flat = out.detach().view(-1)
        flip_bit(flat, int(flat.abs().argmax()), 23)  # the lowest exponent bit: the value doubles or halves
        return out

    def flip_weight():  # a weight changed in memory after the optimizer wrote it
        w = model.get_submodule(WEIGHT_FLIP[1]).weight.data
        flip_bit(w, int(w.abs().argmax()), 23)

    # a one-off fault of the product, before the probes' hooks see it
    output = model.get_submodule(OUTPUT_FLIP[1])
    faults = {
        OUTPUT_FLIP[0]: lambda: output.register_forward_hook(flip_output, prepend=True),
        WEIGHT_FLIP[0]: flip_weight,
    }
    train_reference(model, opt, watch, steps, faults=faults)
    names = list(watch.checksums.names)
    watch.close()
    assert [r["step"] for r in rec.records] == list(range(steps))
    return rec.records, names


def test_output_and_weight_flips_are_named_at_their_step_without_the_backward_check():
    name, config = probe_config("forward-checksums")
    assert name == "forward-checksums" and config.checksum_forward_every == 1 and config.checksum_every > 8
    records, names = _train(config)
    out_layer, weight_layer = names.index(OUTPUT_FLIP[1]), names.index(WEIGHT_FLIP[1])
    for r in records:
        s, layers = r["step"], r["layers"]
        assert set(GEMM_METRICS) <= set(layers), s  # the forward and the weights: every step
        fwd, weight, bwd = layers["gemm_fwd"], layers["gemm_weight"], layers["gemm_bwd"]
        assert len(fwd) == len(names)
        if s == 0:  # the backward's own step (checksum_every): checked, and clean
            assert 0 < max(bwd) < 1
        else:  # not the backward's step: nothing measured there
            assert max(bwd) == 0, s
        if s == OUTPUT_FLIP[0]:
            assert fwd[out_layer] > 1 and [i for i, v in enumerate(fwd) if v > 1] == [out_layer]
        else:
            assert max(fwd) < 1, (s, fwd)  # no false alarm on a clean step
        if s == WEIGHT_FLIP[0]:
            assert weight[weight_layer] > 1 and [i for i, v in enumerate(weight) if v > 1] == [weight_layer]
        else:  # sealed after every optimizer step: the updates themselves are not flagged
            assert max(weight) < 1, (s, weight)


def test_without_it_the_same_flips_wait_for_a_sampled_step():
    # the control: checksums every 16th step only; neither flip is checked at its step
    records, _ = _train(ProbeConfig(checksum_forward_every=0))
    for r in records:
        assert ("gemm_fwd" in r["layers"]) == (r["step"] == 0)


def test_the_setting_is_validated_and_named_in_the_presets():
    assert PROBE_PRESETS["forward-checksums"].checksum_every == ProbeConfig().checksum_every
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ConfigError, match="checksum_forward_every"):
            ProbeConfig(checksum_forward_every=bad)
    with pytest.raises(ConfigError, match="checksum_forward_every"):
        ProbeConfig.from_settings(checksum_forward_every=-2)
