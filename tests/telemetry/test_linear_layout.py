"""Hugging Face's ``Conv1D`` (GPT-2's linear layers, weight stored ``(in, out)``) is checked like an
``nn.Linear``: a real GPT-2 from transformers, trained in a plain loop with ``attach``. Before, a
GPT-2 had one checked product, its head."""

from __future__ import annotations

import pytest
from installed import needs

torch = pytest.importorskip("torch")
needs("transformers")

from sdcwatch.core.vocabulary import GEMM_METRICS  # noqa: E402
from sdcwatch.telemetry.probes.gemm_canary import GemmCanary, known_input  # noqa: E402
from sdcwatch.telemetry.probes.linear_layout import is_linear, linear_weight, transposed  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.testbed.faults import flip_bit  # noqa: E402

torch.set_num_threads(1)
STEPS, OUTPUT_FLIP, WEIGHT_FLIP = 6, 2, 4
FC, PROJ = "transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_proj"
PRODUCTS = [f"transformer.h.{i}.{p}" for i in (0, 1) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


class Recorder:
    def __init__(self):
        self.records = []

    def emit(self, step, *, layers=None, fingerprints=None, time=None, **scalars):
        self.records.append({"step": step, "layers": layers or {}, "scalars": scalars})


def test_conv1d_is_a_linear_layer_with_its_weight_turned():
    from transformers.pytorch_utils import Conv1D

    conv, lin = Conv1D(12, 5), torch.nn.Linear(5, 12)
    assert is_linear(conv) and transposed(conv) and is_linear(lin) and not transposed(lin)
    assert not is_linear(torch.nn.Conv1d(5, 12, 1)) and not is_linear(torch.nn.LayerNorm(5))
    w, b = linear_weight(conv)
    assert w.shape == (12, 5) and w.data_ptr() == conv.weight.data_ptr() and b is conv.bias  # a view
    x = torch.randn(3, 5)
    torch.testing.assert_close(conv(x), torch.nn.functional.linear(x, w, b))


def _train(**settings):
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = Recorder()
    watch = attach(model, rec, optimizer=opt, **settings)

    def flip_output(module, args, out):  # the lowest exponent bit of the largest value: it doubles or halves
        out = out.clone()
        flat = out.detach().view(-1)
        flip_bit(flat, int(flat.abs().argmax()), 23)
        return out

    g = torch.Generator().manual_seed(1)
    for s in range(STEPS):
        handle = None
        if s == OUTPUT_FLIP:
            handle = model.get_submodule(FC).register_forward_hook(flip_output, prepend=True)
        if s == WEIGHT_FLIP:  # changed in memory after the optimizer wrote it
            w = model.get_submodule(PROJ).weight.data
            flip_bit(w, int(w.abs().argmax()), 23)
        x = torch.randint(0, 64, (2, 16), generator=g)
        loss = model(x, labels=x).loss
        if handle:
            handle.remove()
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(s, loss=loss)
    names = list(watch.checksums.names)
    watch.close()
    return rec.records, names


def test_every_conv1d_product_of_a_gpt2_is_checked_and_a_flip_named_at_its_step():
    records, names = _train(checksum_every=1)
    assert set(PRODUCTS) <= set(names) and "lm_head" in names
    fc, proj = names.index(FC), names.index(PROJ)
    checked = [names.index(p) for p in PRODUCTS]
    for r in records:
        s, layers = r["step"], r["layers"]
        assert set(GEMM_METRICS) <= set(layers), s
        fwd, bwd, weight = layers["gemm_fwd"], layers["gemm_bwd"], layers["gemm_weight"]
        # every Conv1D product is checked forward and backward: a real residual, under its bound
        assert all(0 < fwd[i] for i in checked), (s, fwd)
        assert all(0 <= bwd[i] < 1 for i in checked) and any(bwd[i] > 0 for i in checked), (s, bwd)
        bad_fwd = {names[i] for i in checked if fwd[i] > 1}
        bad_weight = {names[i] for i in checked if weight[i] > 1}
        assert bad_fwd == ({FC} if s == OUTPUT_FLIP else set()), (s, fwd)
        assert bad_weight == ({PROJ} if s == WEIGHT_FLIP else set()), (s, weight)
    assert records[OUTPUT_FLIP]["layers"]["gemm_fwd"][fc] > 10  # well above the rounding bound
    assert records[WEIGHT_FLIP]["layers"]["gemm_weight"][proj] > 1


def test_the_default_scans_every_conv1d_output_each_step():
    records, names = _train()  # the shipped default: checksums every 16th step, the scan every step
    for r in records:
        out = r["layers"]["gemm_out"]
        assert all(out[names.index(p)] > 0 for p in PRODUCTS), r["step"]


def test_the_per_product_canary_computes_a_conv1d_product_in_its_layout():
    model = _gpt2()
    canary = GemmCanary(model)
    assert [n for n, _ in canary.products][: len(PRODUCTS)] == PRODUCTS
    k = [n for n, _ in canary.products].index(FC)
    conv = model.get_submodule(FC)
    w, b = linear_weight(conv)
    expected = torch.addmm(b, known_input(w.shape[1], w.shape[0], w.dtype, w.device), conv.weight)
    from sdcwatch.telemetry.probes import fingerprint as fp

    assert torch.equal(canary.fingerprint(k), fp.fingerprint_device([expected]))
    assert not canary.failed


class _MHAModel(torch.nn.Module):
    """nn.MultiheadAttention multiplies by out_proj's weight without calling out_proj."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0])


def _steps(model, n=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = attach(model, Recorder(), optimizer=opt)
    for s in range(n):
        loss = model(torch.randn(2, 5, 16)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(s, loss=loss)
    watch.close()


def test_a_linear_layer_whose_forward_never_runs_is_named_in_one_warning():
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match=r"1 of 2 linear layers ran no forward.*: attn\.out_proj \(") as got:
        _steps(_MHAModel(), n=3)
    assert sum("ran no forward" in str(w.message) for w in got) == 1  # once, not every step


def test_no_coverage_warning_when_every_linear_layer_runs(recwarn):
    _train()
    assert not [w for w in recwarn if "ran no forward" in str(w.message)]
