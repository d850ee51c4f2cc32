"""Matrix checksums: the rounding bound holds on correct products in every dtype, a change above it
is caught in the forward, the weight gradient and the weights, and the record carries it."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from reference_loop import train_reference  # noqa: E402
from sdcwatch.core.vocabulary import GEMM_METRICS, STREAM_METRICS  # noqa: E402
from sdcwatch.telemetry.probes.checksum_bounds import (  # noqa: E402
    check_linear,
    check_matmul,
    check_weight_grad,
    rounding_coefficient,
)
from sdcwatch.telemetry.probes.config import ProbeConfig  # noqa: E402
from sdcwatch.telemetry.probes.residual_stream import ResidualStream, peak, repeated_blocks  # noqa: E402
from sdcwatch.telemetry.probes.gemm_checks import GemmChecks  # noqa: E402
from sdcwatch.telemetry.probes.gemm_state import observe_gemm  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.testbed.faults import flip_bit  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402

torch.set_num_threads(1)
CFG = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4)


class Recorder:
    def __init__(self):
        self.records = []

    def emit(self, step, *, layers=None, fingerprints=None, time=None, **scalars):
        self.records.append({"step": step, "layers": layers or {}, "scalars": scalars})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_correct_products_stay_under_the_bound_in_every_dtype(dtype, scale):
    g = torch.Generator().manual_seed(int(scale * 7) + 3)
    for n, m in ((16, 48), (256, 64), (1024, 512)):
        x = (torch.randn(4, 37, n, generator=g) * scale).to(dtype)
        w = (torch.randn(m, n, generator=g) / math.sqrt(n)).to(dtype)
        b = torch.randn(m, generator=g).to(dtype)
        y = torch.nn.functional.linear(x, w, b)
        ratio = float(check_linear(x, w, y, b))
        assert 0 <= ratio < 1, (n, m, ratio)
        dy = torch.randn(4, 37, m, generator=g).to(dtype)
        dw = dy.reshape(-1, m).t() @ x.reshape(-1, n)
        assert 0 <= float(check_weight_grad(x, dy, dw)) < 1


def test_the_bound_is_rigorous_yet_the_error_seen_sits_far_below_it():
    # float32 products against float64 truth: the rounding bound covers the real error with room
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(512, 768, generator=g), torch.randn(256, 768, generator=g)
    y = x @ w.t()
    err = (y.double().sum(-1) - x.double() @ w.double().sum(0)).abs().max()
    coef = rounding_coefficient(768, 256, torch.float32)
    bound = coef * (x.abs().max() * math.sqrt(768)) * torch.linalg.vector_norm(w, dim=1).sum()
    assert err < bound
    assert float(check_linear(x, w, y)) < 0.05  # two orders of magnitude of room, as the docstring says


def test_a_change_above_the_bound_is_caught_and_below_it_is_not():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(8, 64, 128, generator=g), torch.randn(96, 128, generator=g) / 12
    y = x @ w.t()
    assert float(check_linear(x, w, y)) < 1
    big = y.clone()
    flip_bit(big, 1234, 30)  # the top exponent bit: ~1e38
    assert float(check_linear(x, w, big)) > 1e6
    small = y.clone()
    flip_bit(small, 1234, 0)  # the last mantissa bit: far inside rounding
    assert float(check_linear(x, w, small)) < 1
    nan = y.clone()
    nan.view(-1)[5] = float("nan")
    assert math.isnan(float(check_linear(x, w, nan)))


def test_batched_products_of_any_kernel():
    g = torch.Generator().manual_seed(3)
    a, b = torch.softmax(torch.randn(2, 4, 32, 32, generator=g), -1), torch.randn(2, 4, 32, 16, generator=g)
    c = a @ b
    assert float(check_matmul(a, b, c)) < 1
    c[1, 2, 7, 3] += 0.5
    assert float(check_matmul(a, b, c)) > 1


def _train(model, steps, checks, hook=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    out = []
    for s in range(steps):
        batch = torch.randint(0, 256, (4, CFG.seq_len + 1), generator=g)
        if hook:
            hook(s)
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        checks.seal()
        out.append(checks.collect())
    return out


def test_model_hooks_check_every_linear_and_the_attention_product():
    torch.manual_seed(0)
    model = GPT(CFG)
    checks = GemmChecks(model)
    checks.keep_bounds = True
    steps = _train(model, 4, checks)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert checks.names[: len(linears)] == linears
    assert set(checks.names[len(linears) :]) == {"blocks.0.attn.mix", "blocks.1.attn.mix"}
    for s, got in enumerate(steps):
        assert set(got) == set(GEMM_METRICS)
        assert all(v.shape == (len(checks.names),) for v in got.values())
        assert float(got["gemm_fwd"].max()) < 1 and float(got["gemm_bwd"].max()) < 1
        assert float(got["gemm_weight"].max()) == 0.0  # the sealed sums match bit for bit
        assert float(got["gemm_in"].min()) > 0
    # every check ran (a residual can be exactly 0): each left its bound
    assert {n for kind, n in checks.bounds if kind == "gemm_bwd"} == {
        f"{n}.{p}" for n in linears for p in ("weight", "bias") if getattr(model.get_submodule(n), p) is not None
    }
    assert {n for kind, n in checks.bounds if kind == "gemm_fwd"} == set(checks.names)


def test_a_flip_in_a_weight_gradient_and_in_a_weight_is_named_by_layer():
    torch.manual_seed(0)
    model = GPT(CFG)
    fc = model.blocks[1].mlp.fc
    when = {"step": -1}

    def corrupt(grad):  # a faulty weight-gradient GEMM (registered first: the checks see what it returns)
        if when["step"] != 2:
            return None
        grad = grad.clone()
        grad.view(-1)[17] += 1.0  # far above rounding, small enough for training to go on
        return grad

    fc.weight.register_hook(corrupt)
    checks = GemmChecks(model)
    index = checks.names.index("blocks.1.mlp.fc")

    def hook(step):
        when["step"] = step
        if step == 3:
            with torch.no_grad():  # a memory flip between the optimizer step and the forward
                flip_bit(fc.weight.data, 40, 29)

    steps = _train(model, 5, checks, hook)
    bwd = steps[2]["gemm_bwd"]
    assert float(bwd[index]) > 1 and float(bwd.max()) == float(bwd[index])
    assert float(steps[1]["gemm_bwd"].max()) < 1 and float(steps[3]["gemm_bwd"].max()) < 1
    assert float(steps[3]["gemm_weight"][index]) > 1
    assert float(steps[3]["gemm_weight"].max()) == float(steps[3]["gemm_weight"][index])
    assert float(steps[4]["gemm_weight"].max()) == 0.0  # sealed again after the next update


def test_tied_weights_are_checked_forward_only():
    lin = torch.nn.Linear(8, 8, bias=False)
    emb = torch.nn.Embedding(8, 8)
    lin.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "lin": lin})
    checks = GemmChecks(model)
    out = lin(emb(torch.arange(8)))
    out.sum().backward()
    got = checks.collect()
    assert float(got["gemm_fwd"][0]) < 1 and float(got["gemm_bwd"][0]) == 0.0


def test_custom_kernels_report_through_observe_gemm():
    class Fused(torch.nn.Module):
        def forward(self, a, b):
            c = a @ b
            c[0, 0] += 1.0  # a faulty kernel
            observe_gemm(self, a, b, c)
            return c

    model = torch.nn.Sequential(Fused())
    checks = GemmChecks(model)
    model[0](torch.randn(16, 8), torch.randn(8, 4))
    got = checks.collect()
    assert checks.names == ["0"] and float(got["gemm_fwd"][0]) > 1
    observe_gemm(model[0], torch.randn(16, 8), torch.randn(8, 4), torch.zeros(16, 4))  # unwatched calls cost nothing
    checks.remove()


def test_peak_skips_masked_slots_and_keeps_nan_and_inf():
    t = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    assert float(peak(t)) == 0.0
    t[2, 0] = 5e11
    assert float(peak(t)) == float(torch.tensor(5e11))
    assert float(peak(torch.tensor([0.5, -3e12]))) == float(
        torch.tensor(3e12)
    )  # without a mask a negative extreme counts too
    t[1, 0] = float("nan")
    assert math.isnan(float(peak(t)))
    assert float(peak(torch.tensor([1.0, float("inf")]))) == math.inf


def test_residual_stream_records_block_outputs():
    torch.manual_seed(0)
    model = GPT(CFG)
    assert [n for n, _ in repeated_blocks(model)] == ["blocks.0", "blocks.1"]
    stream = ResidualStream(model, n_attention=2)
    handle = model.blocks[0].attn.register_forward_hook(
        lambda m, a, out: out.index_put((torch.tensor([0]),), torch.tensor(1e12))
    )
    model(torch.randint(0, 256, (2, CFG.seq_len)))
    handle.remove()
    got = stream.collect()
    assert float(got["stream_max"][0]) >= 1e11  # the LayerNorms downstream absorb it; the stream shows it


def test_watch_records_sampled_checksums_and_a_near_inf_in_the_residual_stream_every_step():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = Recorder()
    watch = attach(model, rec, optimizer=opt, checksum_every=2)
    assert ProbeConfig().stream_every == 1

    def flip_weight():  # a weight flipped in memory after the optimizer wrote it, before a checked step
        with torch.no_grad():
            flip_bit(model.blocks[0].mlp.fc.weight.data, 11, 29)

    def near_inf_block_output():  # the fault: 1e12 written into an attention block's output on one step
        return model.blocks[1].attn.register_forward_hook(
            lambda m, a, out: out.index_put((torch.tensor([0]), torch.tensor([3])), torch.tensor(1e12))
        )

    train_reference(model, opt, watch, 7, faults={4: flip_weight, 3: near_inf_block_output})
    watch.close()
    assert [r["step"] for r in rec.records] == list(range(7))
    fc = watch.checksums.names.index("blocks.0.mlp.fc")
    assert rec.records[4]["layers"]["gemm_weight"][fc] > 1  # sealed by the optimizer's hook before step 4
    assert max(rec.records[2]["layers"]["gemm_weight"]) == 0 and max(rec.records[6]["layers"]["gemm_weight"]) == 0
    for r in rec.records:
        assert set(STREAM_METRICS) <= set(r["layers"])  # every step
        assert (set(GEMM_METRICS) <= set(r["layers"])) == (r["step"] % 2 == 0)  # sampled
        if r["step"] % 2 == 0:
            assert len(r["layers"]["gemm_fwd"]) == len(watch.checksums.names)
        assert len(r["layers"]["stream_max"]) == 2 and len(r["layers"]["attn_logit_max"]) == 2
    assert rec.records[3]["layers"]["stream_max"][1] >= 1e11
    assert max(rec.records[2]["layers"]["stream_max"]) < 1e3
    assert all(max(r["layers"]["gemm_fwd"]) < 1 for r in rec.records if "gemm_fwd" in r["layers"])


def test_a_near_inf_in_any_product_output_shows_at_its_step_between_checksum_steps():
    # the shipped default checks the products every 16th step; every other step each product's
    # output is still scanned (gemm_out), so a one-step near-INF in an attention mix (probs @ v)
    # or an MLP output, which the LayerNorms downstream absorb, is seen at its step and product
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = Recorder()
    watch = attach(model, rec, optimizer=opt)
    assert ProbeConfig().checksum_every > 1
    names = watch.checksums.names
    faults = {3: "blocks.1.attn.mix", 5: "blocks.0.mlp.fc", 6: "blocks.0.attn.qkv"}

    def fault(name: str, value: float):  # before the probes' hooks, as a fault
        return lambda: model.get_submodule(name).register_forward_hook(
            lambda m, a, out: out.reshape(-1).index_put((torch.tensor([7]),), torch.tensor(value)).view_as(out),
            prepend=True,
        )

    # a NaN would poison the weights: its step is not taken
    train_reference(
        model,
        opt,
        watch,
        8,
        faults={s: fault(n, float("nan") if s == 6 else 3e10) for s, n in faults.items()},
        no_update={6},
    )
    watch.close()
    for r in rec.records:
        out = r["layers"]["gemm_out"]
        assert len(out) == len(names)
        if r["step"] in faults:
            hit = names.index(faults[r["step"]])
            assert not abs(out[hit]) < 1e10, (r["step"], out)  # near-INF, or NaN
        else:
            assert max(out) < 1e4  # row sums of a healthy model are small
        assert ("gemm_fwd" in r["layers"]) == (r["step"] == 0)  # checksums only on their step


def test_the_largest_logit_is_one_metric_measured_every_step():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = Recorder()
    watch = attach(model, rec, optimizer=opt, attention_every=4)
    tops = []
    hook = model.blocks[1].attn.scores.register_forward_hook(lambda m, a, out: tops.append(float(out.detach().amax())))

    def near_inf_logit():  # not an attention-sampled step: a near-INF logit still shows at its step
        return model.blocks[0].attn.scores.register_forward_hook(
            lambda m, a, out: out.index_put(
                (torch.tensor([0]), torch.tensor([1]), torch.tensor([5]), torch.tensor([2])), torch.tensor(4e11)
            )
        )

    train_reference(model, opt, watch, 6, faults={2: near_inf_logit})
    hook.remove()
    watch.close()
    from sdcwatch.core.vocabulary import LAYER_METRICS

    assert "logit_max" not in STREAM_METRICS + GEMM_METRICS + LAYER_METRICS
    for r, top in zip(rec.records, tops):
        layers = r["layers"]
        assert "logit_max" not in layers
        assert (set(LAYER_METRICS) <= set(layers)) == (r["step"] % 4 == 0)  # the statistics are sampled
        assert len(layers["attn_logit_max"]) == CFG.n_layer  # the largest logit is not
        assert layers["attn_logit_max"][1] == pytest.approx(top, rel=1e-6)  # over every logit
    assert rec.records[2]["layers"]["attn_logit_max"][0] >= 1e11


def test_a_near_inf_below_zero_in_the_logits_is_seen_and_a_mask_is_not():
    # -inf (a causal mask) and the dtype's lowest value (Hugging Face's additive mask) are masks,
    # never near-INF findings; a finite -5e10 acts like one downstream, yet it was written by a fault
    stream = ResidualStream(torch.nn.Module(), n_attention=2)
    mask = torch.ones(4, 4, dtype=torch.bool).triu(1)
    clean = torch.randn(2, 2, 4, 4).masked_fill(mask, float("-inf"))
    hf = torch.randn(2, 2, 4, 4).masked_fill(mask, torch.finfo(torch.float32).min)
    stream.observe_logits(0, clean)
    stream.observe_logits(1, hf)
    got = stream.collect()
    assert -10 < got["attn_logit_min"][0] < 0 and -10 < got["attn_logit_min"][1] <= 0
    bad = clean.clone()
    bad[1, 0, 2, 1] = -5e10
    stream.observe_logits(0, bad)
    stream.observe_logits(1, hf)
    got = stream.collect()
    assert float(got["attn_logit_min"][0]) == pytest.approx(-5e10) and float(got["attn_logit_min"][1]) > -10
    assert float(got["attn_logit_max"][0]) == float(clean.amax())  # the largest logit is unchanged
