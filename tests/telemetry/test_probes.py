"""Probes against direct computations, and the record they hand to the emitter."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.core.vocabulary import (  # noqa: E402
    ATTENTION_STATS,  # noqa: E402
    GEMM_METRICS,
    STREAM_METRICS,
)
from sdcwatch.telemetry import LAYER_METRICS, Emitter, MemoryBus, MemoryTransport, is_end_marker  # noqa: E402
from sdcwatch.telemetry.probes.attention import attention_stats  # noqa: E402
from sdcwatch.telemetry.probes.fingerprint import fingerprint  # noqa: E402
from sdcwatch.telemetry.probes.gemm_canary import known_input  # noqa: E402
from sdcwatch.telemetry.probes.config import ProbeConfig  # noqa: E402
from sdcwatch.telemetry.probes.presets import probe_config  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.telemetry.wire.environment import RankEnvironment  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402

torch.set_num_threads(1)
CFG = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=4)


class Recorder:
    """A stand-in emitter that keeps what it is given."""

    def __init__(self):
        self.records = []
        self.dropped = 0

    def emit(self, step, *, layers=None, fingerprints=None, time=None, **scalars):
        self.records.append({"step": step, "layers": layers, "fingerprints": fingerprints, "scalars": scalars})


def _entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)


def test_attention_stat_names_are_the_record_names():
    assert ATTENTION_STATS == LAYER_METRICS


def test_uniform_attention_has_entropy_log_of_the_visible_keys():
    b, h, t, d = 2, 3, 20, 8
    q = torch.zeros(b, h, t, d)  # all logits 0: query i attends uniformly to keys 0..i
    k = torch.randn(b, h, t, d)
    stats = attention_stats(q, k, heads=0, queries=t)
    positions = range(t // 4, t)
    want = sum(math.log(i + 1) for i in positions) / len(positions)
    assert float(stats[0]) == pytest.approx(want, rel=1e-5)
    assert float(stats[1]) == pytest.approx(want, rel=1e-5)  # every head alike


def test_stats_match_a_direct_computation_on_random_attention():
    g = torch.Generator().manual_seed(0)
    b, h, t, d = 3, 6, 24, 16
    q, k = torch.randn(b, h, t, d, generator=g) * 2, torch.randn(b, h, t, d, generator=g)
    stats = attention_stats(q, k, heads=3, queries=5)
    heads = [0, 2, 4]  # 3 of 6: stride 2 from head 0
    queries = [6, 9, 12, 15, 18]  # 5 from t/4 = 6, stride (24 - 6) // 5 = 3
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    # entropy of every sequence, sampled heads and queries; mean over sequences and queries
    ent = _entropy(torch.softmax(logits, -1))[:, heads][:, :, queries].mean(dim=(0, 2))
    qn, kn = q.norm(dim=-1), k.norm(dim=-1)
    want = [ent.mean(), ent.min(), qn.mean(), qn.max(), kn.mean(), kn.max(), logits[:, heads][:, :, queries].max()]
    torch.testing.assert_close(stats, torch.stack(want), rtol=1e-5, atol=1e-5)


def test_given_logits_are_used_and_their_max_covers_the_whole_tensor():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, 8, 4, generator=g), torch.randn(2, 2, 8, 4, generator=g)
    logits = torch.randn(2, 2, 8, 8, generator=g)
    logits[1, 1, 0, 0] = 1e10  # outside the sampled sequence, head and queries
    stats = attention_stats(q, k, logits=logits, heads=1, queries=1)
    assert float(stats[6]) == pytest.approx(1e10)
    logits[1, 0, 1, 1] = float("nan")
    assert math.isnan(float(attention_stats(q, k, logits=logits)[6]))


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _train(model, emitter, steps, **settings):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    watch = attach(model, emitter, optimizer=opt, **settings)
    g = torch.Generator().manual_seed(3)
    snapshots = []
    for step in range(steps):
        batch = torch.randint(0, 256, (2, CFG.seq_len + 1), generator=g)
        opt.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        params = [p.detach().clone() for p in model.parameters()]
        opt.step()
        snapshots.append((float(loss.detach()), grads, params))
        watch.step(step, loss=loss)
    return watch, snapshots


def test_record_of_a_step_is_emitted_one_step_later_with_direct_values():
    torch.manual_seed(0)
    model = GPT(CFG)
    rec = Recorder()
    watch, snaps = _train(model, rec, 3, fingerprint_every=2, attention_every=1)
    watch.sender.join()  # the sender thread has emitted what it was handed
    assert [r["step"] for r in rec.records] == [0, 1]  # step 2 is read one step later
    watch.close()
    assert [r["step"] for r in rec.records] == [0, 1, 2]
    # parameters are fingerprinted when the step closes: after its update, before the next one
    after = [p for _, _, p in snaps[1:]] + [[p.detach() for p in model.parameters()]]
    for r, (loss, grads, params), updated in zip(rec.records, snaps, after):
        s = r["scalars"]
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        assert s["loss"] == pytest.approx(loss, rel=1e-6)
        assert s["grad_norm_local"] == pytest.approx(norm, rel=1e-5)
        assert s["grad_norm_global"] == pytest.approx(norm, rel=1e-5)
        assert s["grad_cosine"] == pytest.approx(1.0, abs=1e-5)
        assert s["nonfinite"] == 0 and s["lr"] == 0.05 and s["step_time"] > 0
        if r["step"] % 2 == 0:
            assert r["fingerprints"]["grad_fp"] == fingerprint(_flat(grads))
            assert r["fingerprints"]["param_fp"] == fingerprint(_flat(updated)) != fingerprint(_flat(params))
        else:
            assert set(r["fingerprints"]) == {"gemm_canary_fp"}
        # every step, one product in rotation on its known input, with the weights as updated
        name, module = watch.gemm_canary.product_at(r["step"])
        assert name == [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)][r["step"]]
        w, b = (updated[i] for i, p in enumerate(model.parameters()) if p is module.weight or p is module.bias)
        x = known_input(w.shape[1], w.shape[0], w.dtype, w.device)
        assert r["fingerprints"]["gemm_canary_fp"] == fingerprint(torch.nn.functional.linear(x, w, b))
        # attention statistics, the residual stream and the products' outputs every step, the
        # checksums on every 16th step
        assert set(r["layers"]) == set(LAYER_METRICS) | set(STREAM_METRICS) | {"gemm_out"} | (
            set(GEMM_METRICS) if r["step"] == 0 else set()
        )
        assert all(len(r["layers"][m]) == CFG.n_layer for m in LAYER_METRICS + STREAM_METRICS)


def test_every_and_attention_every_sample_steps():
    torch.manual_seed(0)
    rec = Recorder()
    watch, _ = _train(GPT(CFG), rec, 8, every=2, attention_every=2)
    watch.close()
    assert [r["step"] for r in rec.records] == [0, 2, 4, 6]
    assert [set(LAYER_METRICS) <= set(r["layers"] or {}) for r in rec.records] == [True, False, True, False]


def test_nonfinite_values_among_the_metrics_are_counted():
    torch.manual_seed(0)
    model = GPT(CFG)
    rec = Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    watch = attach(model, rec, optimizer=opt, attention_every=1)
    batch = torch.randint(0, 256, (2, CFG.seq_len + 1))
    loss = model.loss(batch)
    bias = model.blocks[0].mlp.fc.bias  # one Inf element in its gradient, as a fault in the backward leaves it
    handle = bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    loss.backward()
    handle.remove()
    watch.step(0, loss=loss * float("nan"))  # no optimizer step: the parameters stay finite
    loss = model.loss(batch)  # finite again: the count is per record, not cumulative
    opt.zero_grad()
    loss.backward()
    opt.step()
    watch.step(1, loss=loss)
    watch.close()
    s0 = rec.records[0]["scalars"]
    # the loss, and both gradient norms (one Inf element makes the norms Inf)
    assert math.isnan(s0["loss"]) and s0["grad_norm_local"] == math.inf
    assert s0["nonfinite"] == 3
    assert rec.records[1]["scalars"]["nonfinite"] == 0


def test_multihead_attention_is_probed_like_a_direct_computation():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    model = torch.nn.ModuleDict({"attn": mha})
    rec = Recorder()
    watch = attach(model, rec, heads=0, queries=100)
    x = torch.randn(2, 12, 16)
    mask = torch.ones(12, 12, dtype=torch.bool).triu(1)
    _, weights = mha(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
    watch.step(0, loss=torch.tensor(1.0))
    watch.close()
    ent = _entropy(weights[0].detach())[:, 3:].mean(-1)  # heads x sampled queries [t/4, t)
    layers = rec.records[0]["layers"]
    assert layers["attn_entropy"][0] == pytest.approx(float(ent.mean()), rel=1e-4)
    assert layers["attn_entropy_min"][0] == pytest.approx(float(ent.min()), rel=1e-4)
    e = 16
    k = (x[0] @ mha.in_proj_weight[e : 2 * e].T + mha.in_proj_bias[e : 2 * e]).view(12, 4, 4).transpose(0, 1)
    assert layers["k_norm_max"][0] == pytest.approx(float(k.detach().norm(dim=-1).max()), rel=1e-5)


def test_emitter_failures_never_reach_the_training_loop():
    class Broken:
        def emit(self, *a, **k):
            raise RuntimeError("bus on fire")

    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="bus on fire"):
        watch, _ = _train(GPT(CFG), Broken(), 3)
        watch.close()
    assert watch.errors == 3


def test_real_emitter_gets_valid_records_on_the_bus():
    torch.manual_seed(0)
    bus = MemoryBus()
    with Emitter(MemoryTransport(bus), run="probe-test", rank=0, world=1, host="h") as em:
        watch, _ = _train(GPT(CFG), em, 4)
        watch.close()
    recs = bus.records()
    assert [(r.step, is_end_marker(r)) for r in recs] == [(0, False), (1, False), (2, False), (3, False), (3, True)]
    assert {"loss", "grad_norm_local", "grad_norm_global", "grad_cosine", "nonfinite", "step_time"} <= set(
        recs[0].scalars
    )
    assert set(recs[0].fingerprints) == {"param_fp", "grad_fp", "gemm_canary_fp"}
    assert set(recs[1].fingerprints) == {"gemm_canary_fp"}


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="probes.colour"):
        attach(GPT(CFG), Recorder(), colour=1)
    with pytest.raises(ConfigError, match="probes.every"):
        attach(GPT(CFG), Recorder(), every=0)
    with pytest.raises(ConfigError, match="probes.emitter"):
        attach(GPT(CFG), object())


def test_bad_settings_name_the_known_ones_and_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"probes\.everyy: unknown setting \(did you mean every\?\) \(known: .*heads"):
        attach(GPT(CFG), Recorder(), everyy=2)
    bad = tmp_path / "probes.json"
    bad.write_text('{"checksum_evry": 1}')
    with pytest.raises(ConfigError, match=r"probes\.checksum_evry: unknown setting in .*probes\.json \(did you mean"):
        probe_config(str(bad))
    with pytest.raises(ConfigError, match="probes.grad_fingerprint: must be true or false"):
        ProbeConfig(grad_fingerprint=1)
    with pytest.raises(ConfigError, match="probes.heads: must be an integer >= 0, got -1"):
        ProbeConfig(heads=-1)


def test_the_rank_environment_decides_the_compiled_gradient_check():
    """The checks take what :class:`RankEnvironment` read (here a mapping of its own), not the process's."""
    on = attach(GPT(CFG), Recorder(), environment=RankEnvironment.read({"SDCWATCH_COMPILED_GRAD_CHECK": "1"}))
    off = attach(GPT(CFG), Recorder(), environment=RankEnvironment.read({"SDCWATCH_COMPILED_GRAD_CHECK": "0"}))
    assert on.checksums.traced_backward and not off.checksums.traced_backward
    on.close()
    off.close()


def test_importing_telemetry_does_not_import_torch():
    code = "import sys, sdcwatch.telemetry as t; t.FINGERPRINTS; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_explicit_observe_attention_for_a_custom_layer():
    from sdcwatch.telemetry.probes.attention import observe_attention

    class MyAttention(torch.nn.Module):
        def forward(self, x):
            q = k = x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
            observe_attention(self, q, k)
            return x

    model = torch.nn.Sequential(MyAttention(), MyAttention())
    rec = Recorder()
    watch = attach(model, rec, attention="0,1", attention_every=1)
    x = torch.randn(2, 10, 8)
    model(x)
    watch.step(0, loss=torch.tensor(0.5))
    watch.close()
    q = x.view(2, 10, 2, 4).transpose(1, 2)
    layers = rec.records[0]["layers"]
    assert len(layers["q_norm_max"]) == 2
    assert layers["q_norm_max"][1] == pytest.approx(float(q.norm(dim=-1).max()), rel=1e-6)
    assert layers["attn_entropy"][0] == pytest.approx(float(attention_stats(q, q)[0]), rel=1e-6)
    with pytest.raises(TypeError, match="attention module"):
        observe_attention(3, q, q)


def test_canary_fingerprints_the_model_output_on_the_fixed_input_without_recording_it():
    torch.manual_seed(0)
    model = GPT(CFG)
    canary = torch.randint(0, 256, (1, CFG.seq_len), generator=torch.Generator().manual_seed(9))
    rec = Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    watch = attach(model, rec, optimizer=opt, canary_input=canary, canary_every=2, attention_every=1)
    g = torch.Generator().manual_seed(3)
    expected = {}
    for step in range(4):
        batch = torch.randint(0, 256, (2, CFG.seq_len + 1), generator=g)
        opt.zero_grad()
        model.loss(batch).backward()
        opt.step()
        with torch.no_grad():
            expected[step] = fingerprint(model.eval()(canary))
        model.train()
        watch.step(step, loss=torch.tensor(1.0))
    watch.close()
    by_step = {r["step"]: r for r in rec.records}
    assert by_step[0]["fingerprints"]["canary_fp"] == expected[0]
    assert by_step[2]["fingerprints"]["canary_fp"] == expected[2]
    assert by_step[1]["fingerprints"] is None or "canary_fp" not in by_step[1]["fingerprints"]
    assert expected[0] != expected[2]  # the parameters moved: so did the canary output
    assert model.training  # the canary restores the training mode


def test_canary_without_an_input_is_a_config_error():
    with pytest.raises(ConfigError, match="canary_every"):
        attach(GPT(CFG), Recorder(), canary_every=10)


@pytest.mark.parametrize("closure", [False, True])
def test_the_gradient_norm_is_the_steps_own_with_or_without_an_optimizer_closure(closure):
    """Without a closure the norm is read just before ``opt.step()`` (a loop may zero the gradient
    before ``watch.step``); with ``opt.step(closure)`` (Lightning, LBFGS) the closure runs this
    step's backward after the step pre-hooks, so the norm is read at ``watch.step``."""
    torch.manual_seed(0)
    model, rec = GPT(CFG), Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    watch = attach(model, rec, optimizer=opt, attention_every=1000, checksum_every=0)
    g = torch.Generator().manual_seed(3)
    norms = []
    for step in range(3):
        batch = torch.randint(0, 256, (2, CFG.seq_len + 1), generator=g)

        def forward_backward():
            opt.zero_grad()
            loss = model.loss(batch)
            loss.backward()
            norms.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters())))
            return loss

        if closure:
            loss = opt.step(forward_backward)
        else:
            loss = forward_backward()
            opt.step()
            opt.zero_grad()  # before watch.step: the norm must already have been read
        watch.step(step, loss=loss)
    watch.close()
    got = [r["scalars"]["grad_norm_local"] for r in rec.records]
    assert got == pytest.approx(norms, rel=1e-5)
