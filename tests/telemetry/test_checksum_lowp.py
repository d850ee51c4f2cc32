"""bf16 and fp16 matrix checksums: the rounding bound covers a narrow product's own rounding and,
under autocast, the casts of its float32 inputs; clean narrow training raises no ratio above 1; a
flip above the bound in a product's output or in a weight held in memory is found at its step."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.telemetry.probes.checksum_bounds import (  # noqa: E402
    check_linear,
    check_weight_grad,
    gemm_input_roundoff,
    unit_roundoff,
)
from sdcwatch.telemetry.probes.gemm_checks import GemmChecks  # noqa: E402
from sdcwatch.testbed.fault_bounds import bias_grad_bound  # noqa: E402
from sdcwatch.testbed.faults import flip_bit  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402

torch.set_num_threads(1)
CFG = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4)
NARROW = [torch.bfloat16, torch.float16]
MODES = {  # parameter dtype, autocast dtype
    "bf16": (torch.bfloat16, None),
    "autocast-bf16": (torch.float32, torch.bfloat16),
    "fp16": (torch.float16, None),
    "autocast-fp16": (torch.float32, torch.float16),
}


def _just_above_one(dtype: torch.dtype) -> float:
    """A float32 value that ``dtype`` rounds down to 1, by almost its whole unit roundoff: every
    element of a tensor full of it is cast with the same error, so the errors add up coherently."""
    return 1.0 + 0.99 * unit_roundoff(dtype)


@pytest.mark.parametrize("dtype", NARROW)
def test_an_autocast_product_is_bounded_with_the_casts_of_its_inputs(dtype):
    n, m, tokens = 64, 48, 256
    x = torch.full((tokens, n), _just_above_one(dtype))
    w = torch.full((m, n), 0.5 * _just_above_one(dtype), requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = torch.nn.functional.linear(x, w)
    assert y.dtype == dtype and w.dtype == torch.float32
    # the product saw 1 and 0.5: its row sums sit 2 u below x (W^T 1), past u_out alone
    assert gemm_input_roundoff(x, w, compute=dtype) == unit_roundoff(dtype)
    assert 0.4 < float(check_linear(x, w, y)) < 1
    # the weight gradient: computed in the narrow dtype, cast up into w.grad (float32)
    dy = torch.ones(tokens, m, dtype=dtype)
    y.backward(dy)
    assert w.grad.dtype == torch.float32
    ratio = float(check_weight_grad(x, dy, w.grad))
    assert 0.2 < ratio < 1, ratio
    assert float(check_weight_grad(x, dy.float(), w.grad)) > 10  # float32 rounding alone: a false alarm


@pytest.mark.parametrize("dtype", NARROW)
def test_an_autocast_bias_gradient_rounded_to_the_narrow_dtype_stays_under_its_bound(dtype):
    # tokens such that each db_j = tokens (1 + 2u) falls between two values of dtype
    tokens, n, m = {torch.bfloat16: 511, torch.float16: 1365}[dtype], 16, 96
    x = torch.ones(tokens, n)
    w = torch.zeros(m, n, requires_grad=True)
    b = torch.zeros(m, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y = torch.nn.functional.linear(x, w, b)
    dy = torch.full((tokens, m), 1.0 + 2 * unit_roundoff(dtype), dtype=dtype)  # representable
    y.backward(dy)
    # each db_j summed in float32, rounded to dtype (all alike), cast up to float32
    assert b.grad.dtype == torch.float32
    residual = abs(float(b.grad.sum()) - float(dy.float().sum()))
    # float32 rounding alone (a float32 dY) would call it a fault
    assert bias_grad_bound(dy.float(), b.grad) < residual < bias_grad_bound(dy, b.grad)


def test_float16_outputs_in_the_subnormal_range_stay_under_the_bound():
    # values near 1e-4: products near 1e-7, below float16's smallest normal (6e-5), off by up to
    # 2^-25 each, absolute; the relative part of the bound alone is smaller than that
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(256, 64, generator=g) * 1e-4).half()
    w = (torch.randn(64, 64, generator=g) * 1e-4).half()
    y = x @ w.t()
    assert float(y.abs().max()) < torch.finfo(torch.float16).smallest_normal
    assert float(check_linear(x, w, y)) < 1
    dy = (torch.randn(256, 64, generator=g) * 1e-4).half()
    dw = dy.t() @ x
    assert float(check_weight_grad(x, dy, dw)) < 1


def _model(mode: str):
    param_dtype, autocast = MODES[mode]
    torch.manual_seed(0)
    model = GPT(CFG).to(param_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4 if param_dtype == torch.float16 else 1e-8)

    def ctx():
        return torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()

    return model, opt, ctx


@pytest.mark.parametrize(
    ("mode", "steps"), [("bf16", 300), ("autocast-bf16", 200), ("fp16", 100), ("autocast-fp16", 100)]
)
def test_clean_narrow_training_raises_no_ratio_above_one(mode, steps):
    model, opt, ctx = _model(mode)
    checks = GemmChecks(model)  # forward, weight and bias gradients, weights in memory: every step
    g = torch.Generator().manual_seed(1)
    top = {k: torch.zeros(len(checks.names)) for k in ("gemm_fwd", "gemm_bwd", "gemm_weight")}
    for _ in range(steps):
        with ctx():
            loss = model.loss(torch.randint(0, 256, (4, CFG.seq_len + 1), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        checks.seal()
        got = checks.collect()
        for k in top:
            top[k] = torch.fmax(top[k], got[k])
            assert not bool((got[k] > 1).any() or got[k].isnan().any()), (k, got[k])
    assert bool(torch.isfinite(loss))
    assert 0 < float(top["gemm_fwd"].max()) < 0.5 and 0 < float(top["gemm_bwd"].max()) < 0.5
    assert float(top["gemm_weight"].max()) == 0.0  # the sealed sums match bit for bit


MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _flip_exponent(t: torch.Tensor, top: bool, index: int | None = None) -> int:
    """Flip an exponent bit of element ``index`` of ``t`` (default: its median |value|, below 1):
    the top one (the value grows by 2^128, or 2^16 in float16) or the lowest (it doubles or halves)."""
    flat = t.detach().view(-1)
    if index is None:
        index = int(flat.float().abs().argsort()[flat.numel() // 2])
        assert 0 < abs(float(flat[index])) < 1
    flip_bit(flat, index, 8 * flat.element_size() - 2 if top else MANTISSA_BITS[t.dtype])
    return index


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_exponent_flip_in_an_output_or_a_weight_is_found_at_its_step(mode):
    model, opt, ctx = _model(mode)
    checks = GemmChecks(model, backward=lambda: False)  # the forward and the weights in memory
    out_name, weight_name = "blocks.0.mlp.fc", "blocks.1.attn.proj"
    out_layer, weight_layer = checks.names.index(out_name), checks.names.index(weight_name)

    def flip_output(module, args, out):
        out = out.clone()
        _flip_exponent(out, top=True)
        return out

    g = torch.Generator().manual_seed(2)
    for step in range(7):
        handle = model.get_submodule(out_name).register_forward_hook(flip_output, prepend=True) if step == 3 else None
        if step == 5:  # a weight changed in memory between the optimizer's write and the forward
            flipped = _flip_exponent(model.get_submodule(weight_name).weight.data, top=False)
        with ctx():
            loss = model.loss(torch.randint(0, 256, (4, CFG.seq_len + 1), generator=g))
        if handle is not None:
            handle.remove()
        if step not in (3, 5):  # a corrupted step is not trained on
            opt.zero_grad()
            loss.backward()
            opt.step()
            checks.seal()
        got = checks.collect()
        fwd, weight = got["gemm_fwd"], got["gemm_weight"]
        if step == 3:
            assert float(fwd[out_layer]) > 1 and [i for i, v in enumerate(fwd.tolist()) if v > 1] == [out_layer]
        else:
            assert float(fwd.max()) < 1, (step, fwd)
        if step == 5:
            assert float(weight[weight_layer]) > 1
            assert [i for i, v in enumerate(weight.tolist()) if v > 1] == [weight_layer]
            _flip_exponent(model.get_submodule(weight_name).weight.data, False, flipped)  # back: sealed again
        else:
            assert float(weight.max()) < 1, (step, weight)
