"""Attention without the model's cooperation: SDPA and eager attention seen from outside, named by
layer, on sampled steps only; gradient accumulation; hook order; where act_max came from."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.vocabulary import ATTENTION_STATS, LAYER_METRICS  # noqa: E402
from sdcwatch.telemetry.probes.attention import observe_attention  # noqa: E402
from sdcwatch.telemetry.probes.sdpa import sdpa_attention_stats  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.testbed.faults import FaultInjector  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


def _has_attention(record: dict) -> bool:
    """Whether a record carries attention statistics (its other layer metrics come every step)."""
    return "attn_entropy" in (record["layers"] or {})


torch.set_num_threads(1)


class Recorder:
    def __init__(self):
        self.records = []

    def emit(self, step, *, layers=None, fingerprints=None, time=None, **scalars):
        self.records.append({"step": step, "layers": layers, "scalars": scalars})


class SdpaAttention(nn.Module):
    """nanoGPT's attention: one fused q/k/v projection, then ``F.scaled_dot_product_attention``."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, 2))
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.attn, self.mlp = nn.LayerNorm(32), SdpaAttention(), nn.Linear(32, 32)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class SdpaGPT(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 32)
        self.h = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(32, 50)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


def _train(model, watch, steps, forward, opt=None):
    for step in range(steps):
        loss = forward(model, step)
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        watch.step(step, loss=loss)
    watch.close()


def _gpt_loss(model, step):
    idx = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(step))
    return F.cross_entropy(model(idx[:, :-1]).reshape(-1, 50), idx[:, 1:].reshape(-1))


def _direct(q, k, mask, scale, queries):
    """Entropy per head (mean over ``queries`` rows) and the logits' max, computed in full."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.transpose(-2, -1)) * scale
    logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    p = logits.softmax(-1)[:, :, queries]
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    return ent.mean(dim=(0, 2)), logits[:, :, queries].amax()


@pytest.mark.parametrize("case", ["causal", "bool_mask", "additive_mask", "gqa_causal", "scale"])
def test_sdpa_stats_follow_the_kernels_semantics(case):
    g = torch.Generator().manual_seed(1)
    b, h, t, d = 2, 4, 12, 8
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, 2 if case == "gqa_causal" else h, t, d, generator=g)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    kw, mask, scale = {}, causal, 1 / math.sqrt(d)
    if case in ("causal", "gqa_causal"):
        kw["is_causal"] = True
    elif case == "bool_mask":
        mask = torch.rand(b, 1, t, t, generator=g) > 0.4
        mask[..., 0] = True  # every query sees at least one key
        kw["attn_mask"] = mask
    elif case == "additive_mask":
        mask = torch.where(causal, torch.randn(t, t, generator=g), torch.tensor(float("-inf")))
        kw["attn_mask"] = mask
    else:
        scale, kw["is_causal"] = 0.5, True
        kw["scale"] = scale
    stats = sdpa_attention_stats(q, k, heads=0, queries=t, **kw)
    ent, top = _direct(q, k, mask, scale, slice(t // 4, t))
    got = dict(zip(ATTENTION_STATS, stats.tolist()))
    assert got["attn_entropy"] == pytest.approx(float(ent.mean()), rel=1e-5)
    assert got["attn_entropy_min"] == pytest.approx(float(ent.min()), rel=1e-5)
    assert got["attn_logit_max"] == pytest.approx(float(top), rel=1e-5)
    assert got["q_norm_max"] == pytest.approx(float(q.norm(dim=-1).max()), rel=1e-6)
    assert got["k_norm_mean"] == pytest.approx(float(k.norm(dim=-1).mean()), rel=1e-6)


def test_a_query_row_with_every_key_masked_is_left_out_not_nan():
    q = torch.randn(1, 2, 8, 4)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    mask[..., 5, :] = False  # row 5 (padding) sees nothing
    stats = sdpa_attention_stats(q, q, attn_mask=mask, heads=0, queries=8)
    assert torch.isfinite(stats).all()


def test_plain_sdpa_gpt_every_layer_on_every_sampled_step_and_nothing_otherwise():
    torch.manual_seed(0)
    model = SdpaGPT(layers=3)
    rec = Recorder()
    seen_modes = []

    def spy(module, args):  # is a torch function mode active while this layer runs?
        seen_modes.append(torch._C._len_torch_function_stack())

    model.h[0].attn.register_forward_pre_hook(spy)
    watch = attach(model, rec, attention_every=2)
    _train(model, watch, 4, _gpt_loss)
    # attention statistics on sampled steps; the residual stream of the 3 blocks on every step
    assert [set(LAYER_METRICS) <= set(r["layers"] or {}) for r in rec.records] == [True, False, True, False]
    assert all(len(r["layers"]["stream_max"]) == 3 for r in rec.records)
    assert [n for n in watch.layer_names] == ["h.0.attn", "h.1.attn", "h.2.attn"]
    assert seen_modes == [1, 0, 1, 0]  # the tap is entered on sampled steps only
    for r in rec.records[::2]:
        assert all(len(r["layers"][m]) == 3 for m in LAYER_METRICS)
        assert all(math.isfinite(x) for v in r["layers"].values() for x in v)
    # the values are those of the q and k the kernel got
    torch.manual_seed(0)
    fresh = SdpaGPT(layers=3)
    got = {}
    fresh.h[1].attn.c_attn.register_forward_hook(lambda m, a, out: got.setdefault("qkv", out.detach()))
    fresh(torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(0))[:, :-1])
    q, k, _ = (z.view(2, 16, 4, 8).transpose(1, 2) for z in got["qkv"].split(32, 2))
    expected = sdpa_attention_stats(q, k, is_causal=True, heads=4, queries=16, sequences=2)
    assert rec.records[0]["layers"]["attn_entropy"][1] == pytest.approx(float(expected[0]), rel=1e-5)
    assert rec.records[0]["layers"]["q_norm_max"][1] == pytest.approx(float(expected[3]), rel=1e-6)


def _llama_steps(impl, steps=4, **settings):
    from tiny_llama import tiny_llama, tokens

    model = tiny_llama(impl)
    rec = Recorder()
    watch = attach(model, rec, attention_every=2, **settings)

    def forward(m, step):
        batch = tokens(step, 0)
        mask = torch.ones_like(batch)
        mask[0, :3] = 0  # left padding in the first sequence: a real mask reaches the kernel
        return m(input_ids=batch, attention_mask=mask, labels=batch).loss

    _train(model, watch, steps, forward)
    return rec, watch


def test_hugging_face_llama_sdpa_and_eager_give_the_same_statistics_for_every_layer():
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to warn about: attention is visible
        sdpa, w_sdpa = _llama_steps("sdpa")
        eager, w_eager = _llama_steps("eager")
    names = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert w_sdpa.layer_names == names and w_eager.layer_names == names
    for a, b in zip(sdpa.records, eager.records):
        # attention statistics on sampled steps (the residual stream comes every step)
        assert _has_attention(a) == _has_attention(b) == (a["step"] % 2 == 0)
        if not _has_attention(a):
            continue
        for name in ATTENTION_STATS:
            assert len(a["layers"][name]) == 2
            assert all(math.isfinite(x) for x in a["layers"][name])
            # eager hands over the real logits (q and k after RoPE, mask added); SDPA's are
            # recomputed from its q, k, grouped heads and mask: they must agree. Layer 1's input
            # differs a little at the padded positions (the two kernels treat a query that sees no
            # key differently), so only layer 0 is held to float precision
            assert a["layers"][name][0] == pytest.approx(b["layers"][name][0], rel=1e-5, abs=1e-7), name
            assert a["layers"][name][1] == pytest.approx(b["layers"][name][1], rel=1e-2), name


def test_multihead_attention_is_measured_once_through_its_own_hook():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.MultiheadAttention(16, 4, batch_first=True))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            h = self.inner[0](x)
            return self.inner[1](
                h,
                h,
                h,
                need_weights=False,
                is_causal=True,
                attn_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]),
            )[0]

    wrapper = Wrapper()
    rec = Recorder()
    watch = attach(wrapper, rec, attention_every=1)
    _train(wrapper, watch, 2, lambda m, s: m(torch.randn(2, 10, 16)).pow(2).mean())
    assert watch.n_layers == 1
    assert all(len(r["layers"]["attn_entropy"]) == 1 for r in rec.records)


class HiddenAttention(nn.Module):
    """Attention PyTorch cannot show: no SDPA, no softmax (as a fused kernel outside PyTorch)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def qk_heads(self, x):
        q, k = self.qk(x).view(x.shape[0], x.shape[1], 2, 8).unbind(2)
        return q.view(*q.shape[:2], 2, 4).transpose(1, 2), k.view(*k.shape[:2], 2, 4).transpose(1, 2)

    def forward(self, x):
        q, k = self.qk_heads(x)
        w = (q @ k.transpose(-2, -1)).exp()
        return (w / w.sum(-1, keepdim=True)).mean() * x


class ReportedAttention(HiddenAttention):
    """The same layer reporting its q and k itself."""

    def forward(self, x):
        observe_attention(self, *self.qk_heads(x))
        return super().forward(x)


def test_attention_that_cannot_be_seen_warns_once_and_observe_attention_then_works_without_settings():
    model = nn.Sequential(HiddenAttention(), HiddenAttention())
    rec = Recorder()
    with pytest.warns(RuntimeWarning, match=r"0 \(HiddenAttention\).*observe_attention\(self, q, k\)") as caught:
        watch = attach(model, rec, attention_every=1)
        _train(model, watch, 2, lambda m, s: m(torch.randn(2, 6, 8)).sum())
    assert len([w for w in caught if "sdcwatch" in str(w.message)]) == 1
    assert not any(_has_attention(r) for r in rec.records)

    reporting = nn.Sequential(ReportedAttention(), ReportedAttention())
    rec = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        watch = attach(reporting, rec, attention_every=1)  # no attention= setting
        _train(reporting, watch, 2, lambda m, s: m(torch.randn(2, 6, 8)).sum())
    assert watch.layer_names == ["0", "1"]
    assert all(len(r["layers"]["q_norm_max"]) == 2 for r in rec.records)


def test_a_hugging_face_attention_kernel_outside_pytorch_is_named_in_the_warning():
    pytest.importorskip("transformers")
    from tiny_llama import tiny_llama

    model = tiny_llama("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.warns(RuntimeWarning, match="flash_attention_2.*observe_attention"):
        attach(model, Recorder()).close()


def test_a_model_whose_forward_shows_no_attention_is_warned_about_at_the_first_sampled_step():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.warns(RuntimeWarning, match="no attention call was seen"):
        watch = attach(model, Recorder())
        _train(model, watch, 1, lambda m, s: m(torch.randn(4, 8)).sum())


def test_gradient_accumulation_statistics_cover_every_micro_batch():
    torch.manual_seed(0)
    model = SdpaGPT(layers=2)
    micro = [torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    single = Recorder()
    watch = attach(model, single, attention_every=1)
    for i, idx in enumerate(micro):  # each micro-batch as a step of its own, same weights
        model(idx)
        watch.step(i)
    watch.close()
    accumulated = Recorder()
    watch = attach(model, accumulated, attention_every=1)
    for idx in micro:
        model(idx)
    watch.step(0)
    watch.close()
    a, b = (r["layers"] for r in single.records)
    got = accumulated.records[0]["layers"]
    for layer in range(2):
        assert got["q_norm_max"][layer] == pytest.approx(max(a["q_norm_max"][layer], b["q_norm_max"][layer]))
        assert got["attn_entropy_min"][layer] == pytest.approx(
            min(a["attn_entropy_min"][layer], b["attn_entropy_min"][layer])
        )
        assert got["q_norm_mean"][layer] == pytest.approx((a["q_norm_mean"][layer] + b["q_norm_mean"][layer]) / 2)
        assert got["attn_entropy"][layer] == pytest.approx((a["attn_entropy"][layer] + b["attn_entropy"][layer]) / 2)

    # a NaN in the first micro-batch only still shows in the step's record
    injector = FaultInjector([FaultSpec(kind="nan", rank=0, step=0, target="h.1.attn.c_attn", seed=1)])
    injector.attach(model)
    rec = Recorder()
    watch = attach(model, rec, attention_every=1)
    injector.begin_step(0)
    for idx in micro:
        model(idx)
    watch.step(0)
    watch.close()
    assert len(injector.injections) == 1
    assert not math.isfinite(rec.records[0]["layers"]["q_norm_max"][1]) or not math.isfinite(
        rec.records[0]["layers"]["k_norm_max"][1]
    )
    assert math.isfinite(rec.records[0]["layers"]["q_norm_max"][0])


@pytest.mark.parametrize("injector_first", [True, False], ids=["injector-then-probes", "probes-then-injector"])
def test_a_fault_is_seen_whatever_order_the_injector_and_probes_were_attached(injector_first):
    torch.manual_seed(0)
    model = SdpaGPT(layers=2)
    injector = FaultInjector([FaultSpec(kind="near_inf", rank=0, step=0, target="h.0.mlp", seed=2)])
    rec = Recorder()
    if injector_first:
        injector.attach(model)
        watch = attach(model, rec)
    else:
        watch = attach(model, rec)
        injector.attach(model)
    injector.begin_step(0)
    _train(model, watch, 1, _gpt_loss)
    s = rec.records[0]["scalars"]
    assert s["act_max"] >= 1e10
    assert watch.leaf_names[int(s["act_max_module"])] == "h.0.mlp" == watch.act_max_module
    assert s["act_max_layer"] == 0


def test_act_max_names_the_module_and_layer_where_a_nan_appeared_not_where_it_spread():
    pytest.importorskip("transformers")
    from tiny_llama import tiny_llama, tokens

    model = tiny_llama()
    rec = Recorder()
    watch = attach(model, rec)
    injector = FaultInjector([FaultSpec(kind="nan", rank=0, step=0, target="model.layers.1.self_attn.q_proj")])
    injector.attach(model)
    injector.begin_step(0)
    batch = tokens(0, 0)
    _train(model, watch, 1, lambda m, s: m(input_ids=batch, labels=batch).loss)
    s = rec.records[0]["scalars"]
    assert math.isnan(s["act_max"])
    assert watch.act_max_module == "model.layers.1.self_attn.q_proj"  # o_proj, the MLP, lm_head: NaN too, later
    assert s["act_max_layer"] == 1


@pytest.mark.slow
def test_torch_compile_gives_the_same_records_and_stops_recompiling():
    """With ``attention_compiled=True`` the tap and hooks still run under torch.compile (Dynamo
    breaks the graph at the observed attention call on sampled steps); after the sampled and the
    unsampled variant are compiled, no step recompiles. (Off by default: tests/telemetry/test_compile.py.)"""
    pytest.importorskip("transformers")
    from tiny_llama import tiny_llama, tokens

    def run(compiled):
        model = tiny_llama()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        rec = Recorder()
        watch = attach(model, rec, optimizer=opt, attention_every=2, activations_every=2, attention_compiled=True)
        fn = torch.compile(model, backend="eager") if compiled else model
        counts = []
        for step in range(6):
            batch = tokens(step, 0)
            loss = fn(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            watch.step(step, loss=loss)
            counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        watch.close()
        return rec, counts

    torch._dynamo.reset()
    plain, _ = run(False)
    compiled, graphs = run(True)
    assert graphs[0] > 0  # it did compile
    assert graphs[3:] == [graphs[2]] * 3  # steady after the first sampled and unsampled steps
    for a, b in zip(plain.records, compiled.records):
        assert a["scalars"]["loss"] == pytest.approx(b["scalars"]["loss"], rel=1e-5)
        assert _has_attention(a) == _has_attention(b)
        assert a["layers"]["stream_max"] == pytest.approx(b["layers"]["stream_max"], rel=1e-5)  # hooks run compiled
        if _has_attention(a):
            assert a["layers"]["attn_entropy"] == pytest.approx(b["layers"]["attn_entropy"], rel=1e-4)
            assert a["scalars"]["act_max"] == pytest.approx(b["scalars"]["act_max"], rel=1e-5)


def test_an_evaluation_forward_inside_a_sampled_step_is_not_the_steps_attention():
    torch.manual_seed(0)
    model = SdpaGPT(layers=2)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    other = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    records = []
    for evaluate in (False, True):
        rec = Recorder()
        watch = attach(model, rec, attention_every=1)
        model(idx)
        if evaluate:
            model.eval()
            with torch.no_grad():
                model(other)
            model.train()
        watch.step(0)
        watch.close()
        records.append(rec.records[0]["layers"])
    assert records[0] == records[1]


def test_the_tap_steps_aside_for_a_model_whose_layers_all_report_themselves():
    # the reference GPT hands its q, k and logits over itself (its attention modules are marked, so
    # this is known when attaching): no sampled step runs under a torch function mode, and the
    # statistics come all the same
    from sdcwatch.testbed.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4)
    model = GPT(cfg)
    rec = Recorder()
    seen_modes = []
    model.blocks[0].attn.register_forward_pre_hook(lambda m, a: seen_modes.append(torch._C._len_torch_function_stack()))
    watch = attach(model, rec, attention_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for s in range(5):
        loss = model.loss(torch.randint(0, 256, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(s)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(s, loss=loss)
    watch.close()
    assert seen_modes == [0, 0, 0, 0, 0]
    assert [set(LAYER_METRICS) <= set(r["layers"]) for r in rec.records] == [True, False, True, False, True]
