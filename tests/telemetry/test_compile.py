"""The probes under torch.compile: no graph break from sdcwatch, at most one extra graph per
compiled frame (the sampled step's), and the records still measured.

Counted with ``torch._dynamo.utils.counters`` over 18 steps (two sampled steps, 0 and 16, the plain
ones between and one after: each switch between the variants happens) on the reference model, a
Hugging Face Llama (sdpa and eager attention), GPT-2, and a model compiled before ``attach()``.
Most runs use the ``aot_eager`` backend (Dynamo's capture and AOTAutograd's functionalization, the
parts that break graphs and recompile, without code generation); one runs inductor end to end.
"""

from __future__ import annotations

import math

import pytest
import torch
from sdcwatch.telemetry.probes.presets import PROBE_PRESETS
from sdcwatch.telemetry.probes.watch import attach

# sampled steps 0 and 16 (attention, activations, checksums every 16th), plain ones between and step 17
# after: sampled -> plain, plain -> sampled and sampled -> plain again, each compiled variant reused
STEPS = 18


class Records:
    def __init__(self) -> None:
        self.by_step: dict[int, dict] = {}

    def emit(self, step: int, **fields) -> None:
        self.by_step[step] = fields


def _reference():
    from sdcwatch.testbed.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    return model, lambda m, x: m(x).float().logsumexp(-1).mean(), lambda s: _tokens(s, 256, (4, 32))


def _llama(impl: str):
    from tiny_llama import tiny_llama

    model = tiny_llama(impl)
    model.config.use_cache = False  # training: the docs say why (the weight-gradient check)
    return model, lambda m, x: m(input_ids=x, labels=x).loss, lambda s: _tokens(s, 64, (2, 16))


def _llama_cache():
    """A Llama left with use_cache on (its config's default): the checks stay compile-clean, the
    weight-gradient one runs only eagerly."""
    from tiny_llama import tiny_llama

    model = tiny_llama("sdpa")
    return model, lambda m, x: m(input_ids=x, labels=x).loss, lambda s: _tokens(s, 64, (2, 16))


def _gpt2(impl: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = impl
    cfg.use_cache = False
    model = GPT2LMHeadModel(cfg)
    return model, lambda m, x: m(input_ids=x, labels=x).loss, lambda s: _tokens(s, 64, (2, 16))


def _counters():
    """torch.compile's counters (torch._dynamo imported here, not at collection: seconds of every test worker's start)."""
    from torch._dynamo.utils import counters

    return counters


def _tokens(step: int, vocab: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(step))


def _steps(model, loss_of, batch, opt, w, steps) -> None:
    """Train ``model`` over ``steps`` with the watch ``w`` closing each step, then close it."""
    for step in steps:
        loss = loss_of(model, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        w.step(step, loss=loss)
    w.close()


def _train(build, *, watch: bool, backend: str = "aot_eager", compile_first: bool = False, preset: str = "default"):
    """(graphs, graph breaks, records) of STEPS compiled training steps."""
    torch._dynamo.reset()
    counters = _counters()
    counters.clear()
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
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    return graphs, breaks, dict(counters["graph_break"]), records.by_step


_BARE: dict = {}


def _bare(build, backend: str = "aot_eager"):
    """(graphs, graph break reasons) of ``build`` compiled without sdcwatch: the baseline does not
    change from test to test, so each model and backend is trained bare once per module."""
    if (build, backend) not in _BARE:
        graphs, _, reasons, _ = _train(build, watch=False, backend=backend)
        _BARE[build, backend] = graphs, reasons
    return _BARE[build, backend]


MODELS = {
    "reference": _reference,
    "llama-sdpa": lambda: _llama("sdpa"),
    "llama-eager": lambda: _llama("eager"),
    "llama-use-cache": _llama_cache,
    "gpt2-sdpa": lambda: _gpt2("sdpa"),
    "gpt2-eager": lambda: _gpt2("eager"),
}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    # the weight-gradient check in compiled backwards is opt-in (it failed inductor on torch 2.11 CUDA)
    monkeypatch.setenv("SDCWATCH_COMPILED_GRAD_CHECK", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.bench) if n == "gpt2-eager" else n for n in MODELS])
@pytest.mark.slow
def test_no_graph_break_and_one_extra_graph(name):
    build = MODELS[name]
    bare_graphs, bare_reasons = _bare(build)
    graphs, _, reasons, records = _train(build, watch=True)
    # a break the model has anyway (GPT-2 logs a warning) recurs in the sampled graph: not sdcwatch's
    new = set(reasons) - set(bare_reasons)
    assert not new, f"sdcwatch broke the graph: {new}"
    assert graphs <= 2 * bare_graphs, f"{graphs} graphs with sdcwatch against {bare_graphs} without"
    assert sorted(records) == list(range(STEPS))
    gemm = records[16]["layers"]
    assert "gemm_fwd" in gemm and "gemm_out" in gemm and "stream_max" in records[3]["layers"]
    assert all(0 <= r <= 1 for r in gemm["gemm_fwd"]), gemm["gemm_fwd"]  # clean: every product within its bound
    assert any(r > 0 for r in gemm["gemm_fwd"])  # and measured
    if name != "llama-use-cache":
        assert any(r > 0 for r in gemm["gemm_bwd"])  # the weight-gradient check ran in the compiled backward
    assert all(r == 0 for r in gemm["gemm_weight"]) or max(gemm["gemm_weight"]) <= 1


@pytest.mark.slow
def test_compiled_before_attach():
    bare_graphs, _ = _bare(_reference)
    graphs, breaks, reasons, records = _train(_reference, watch=True, compile_first=True)
    assert breaks == 0, reasons
    assert graphs <= 2 * bare_graphs
    assert "gemm_out" in records[5]["layers"]
    # the names are the model's, not the compiled wrapper's
    layers = records[16]["layers"]
    assert len(layers["gemm_fwd"]) == len(layers["gemm_out"])


@pytest.mark.slow
def test_ddp_around_the_compiled_model(tmp_path):
    """nanoGPT's order, torch.compile and then DDP: attach(ddp) watches the model inside both wrappers
    and the job trains, an eval forward first (the watch held the compiled wrapper, and Dynamo
    refused to trace a hook that reached it: "already tracked for mutation")."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, loss_of, batch = _reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = Records()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.compile(model, backend="aot_eager"))
        w = attach(ddp, records, optimizer=opt)
        assert w.model is model
        ddp.eval()
        with torch.no_grad():
            loss_of(ddp, batch(0))
        ddp.train()
        for step in range(2):
            loss = loss_of(ddp, batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(step, loss=loss)
        w.close()
        assert "gemm_out" in records.by_step[0]["layers"]
    finally:
        dist.destroy_process_group()


def test_compiled_records_match_eager():
    """The every-step and sampled probes measure the same values compiled (aot_eager) as eagerly."""
    _, _, _, compiled = _train(_reference, watch=True, backend="eager")  # Dynamo traces the hooks
    torch._dynamo.reset()
    counters = _counters()
    counters.clear()
    model, loss_of, batch = _reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = Records()
    w = attach(model, records, optimizer=opt)
    _steps(model, loss_of, batch, opt, w, range(18))
    for step in (0, 1, 16, 17):
        a, b = records.by_step[step]["layers"], compiled[step]["layers"]
        assert sorted(a) == sorted(b)
        for key in a:
            if step == 0 and key == "gemm_fwd":
                # compiled code checks a linear layer against its seal, provisional before the
                # optimizer's first step (it may predate a checkpoint load): measured, never judged;
                # the products reported with observe_gemm are checked as eagerly
                unjudged = [j for j, y in enumerate(b[key]) if y == 0 and a[key][j] > 0]
                assert len(unjudged) >= len(b[key]) // 2, (a[key], b[key])
                continue
            if key == "gemm_fwd":
                # compiled code sums x (W^T 1) as a row reduction inductor fuses, eager code as a
                # matrix-vector product: the rounding residual differs, both far under the bound
                assert max(a[key]) < 1e-2 and max(b[key]) < 1e-2, (step, a[key], b[key])
                continue
            for x, y in zip(a[key], b[key]):
                assert (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-12), (step, key)


@pytest.mark.slow
def test_inductor_reference_model():
    bare_graphs, _ = _bare(_reference, "inductor")
    graphs, breaks, reasons, records = _train(_reference, watch=True, backend="inductor")
    assert breaks == 0, reasons
    assert graphs <= 2 * bare_graphs
    assert max(records[16]["layers"]["gemm_fwd"]) <= 1
    assert max(records[16]["layers"]["gemm_bwd"]) > 0


def test_compiled_weight_gradient_check_is_opt_in(monkeypatch):
    """By default the compiled backward carries no probe: gemm_bwd is 0 on a compiled checked step
    (the forward and weight checks still run); SDCWATCH_COMPILED_GRAD_CHECK=1 turns it on."""
    monkeypatch.delenv("SDCWATCH_COMPILED_GRAD_CHECK")
    graphs, _, reasons, records = _train(_reference, watch=True)
    assert not reasons
    layers = records[16]["layers"]
    assert all(r == 0 for r in layers["gemm_bwd"]) and any(r > 0 for r in layers["gemm_fwd"])


@pytest.mark.slow
def test_attached_after_the_model_ran_compiled():
    """Dynamo does not guard on module hooks by default: a graph compiled before attach() would run
    on without the probes. attach() says so, and compiled code runs the hooks from then on."""
    torch._dynamo.reset()
    model, loss_of, batch = _reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="aot_eager")
    loss_of(compiled, batch(0)).backward()  # a step before the probes (Lightning's sanity check, say)
    opt.zero_grad()
    records = Records()
    with pytest.warns(RuntimeWarning, match="already compiled code for this model"):
        w = attach(model, records, optimizer=opt)
    _steps(compiled, loss_of, batch, opt, w, range(1, 18))
    assert all("gemm_out" in records.by_step[s]["layers"] for s in range(1, 17))
    assert max(records.by_step[16]["layers"]["gemm_fwd"]) > 0


class Sink(Records):
    def close(self, timeout: float | None = None) -> None:
        pass


@pytest.mark.slow
def test_hugging_face_trainer_torch_compile(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the model, the callback
    attaches inside the compiled wrapper; no break, the sampled variant only, the probes measure."""
    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
    from tiny_llama import TokenDataset, tiny_llama
    from transformers import Trainer, TrainingArguments

    torch._dynamo.reset()
    counters = _counters()
    counters.clear()
    model = tiny_llama()
    model.config.use_cache = False
    sink = Sink()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=20,
        learning_rate=1e-3,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    Trainer(model=model, args=args, train_dataset=TokenDataset(40), callbacks=[SdcwatchCallback(sink)]).train()
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 2
    assert sorted(sink.by_step) == list(range(20))
    assert "gemm_out" in sink.by_step[3]["layers"] and max(sink.by_step[16]["layers"]["gemm_fwd"]) > 0


@pytest.mark.slow
def test_lightning_compiled_module():
    """A ``LightningModule`` compiled before ``trainer.fit``, as Lightning documents."""
    import lightning as L
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback
    from tiny_llama import TokenDataset, lightning_trainer, tiny_llama

    class LitLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()
            self.model.config.use_cache = False

        def forward(self, **batch):
            return self.model(**batch).loss

        def training_step(self, batch, batch_idx):
            return self(**batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch._dynamo.reset()
    counters = _counters()
    counters.clear()
    sink = Sink()
    trainer = lightning_trainer([SdcwatchCallback(sink)], max_steps=20)
    trainer.fit(
        torch.compile(LitLlama(), backend="aot_eager"),
        torch.utils.data.DataLoader(TokenDataset(40), batch_size=2),
    )
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 2
    assert len(sink.by_step) == 20
    assert "gemm_out" in sink.by_step[3]["layers"] and max(sink.by_step[16]["layers"]["gemm_fwd"]) > 0


def _gpt6():
    from sdcwatch.testbed.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6))
    return model, model.blocks, lambda m, x: m(x).float().logsumexp(-1).mean(), lambda s: _tokens(s, 256, (4, 32))


def _llama6():
    from tiny_llama import tiny_llama

    model = tiny_llama("sdpa", layers=6)
    model.config.use_cache = False
    return model, model.model.layers, lambda m, x: m(input_ids=x, labels=x).loss, lambda s: _tokens(s, 64, (2, 16))


@pytest.mark.parametrize("build", [_gpt6, _llama6], ids=["reference", "hf-llama"])
def test_blocks_compiled_one_by_one_share_their_graphs(build, monkeypatch):
    """Compiled block by block (as torchtitan does), the blocks share their graphs with the probes
    attached, as they do without: the hooks hold no block's or product's index (each call is kept on
    its module, its forward-order ordinal counted on the device), so 6 blocks compile the block's
    plain and sampled variants once, plus those of the block-output hook (a frame of its own under
    per-block compile), however many blocks there are. Before, each block compiled its own (16
    graphs for 4 blocks on the GPU bench). The records are measured as when the whole model is
    compiled. At the default configuration: the opt-in weight-gradient check in compiled backwards
    still holds each product's index."""
    monkeypatch.delenv("SDCWATCH_COMPILED_GRAD_CHECK")
    torch._dynamo.reset()
    counters = _counters()
    counters.clear()
    model, blocks, loss_of, batch = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = Records()
    w = attach(model, records, optimizer=opt)
    assert torch._dynamo.config.recompile_limit >= 4 * 6  # kept: other configurations still specialise
    for block in blocks:
        block.compile(backend="aot_eager")
    _steps(model, loss_of, batch, opt, w, range(18))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 4, counters["stats"]["unique_graphs"]
    assert len(records.by_step[16]["layers"]["stream_max"]) == 6
    assert all(v > 0 for v in records.by_step[5]["layers"]["stream_max"])
    out = records.by_step[5]["layers"]["gemm_out"]
    assert sum(v > 0 for v in out) >= 6 * 4  # every block's products scanned on a plain step
    assert 0 < max(records.by_step[16]["layers"]["gemm_fwd"]) <= 1


@pytest.mark.slow
def test_compiled_forward_checksums_find_flips_at_their_step():
    """Compiled by inductor, ``forward-checksums`` (the sums of each weight taken by the seal after
    the optimizer step, the row reductions fused by inductor) names a product whose output had an
    exponent flipped at that step, and a weight flipped in memory after its seal at the next forward,
    with no violation on the clean steps around them."""
    from sdcwatch.telemetry.probes.output_faults import output_faults
    from sdcwatch.testbed.faults import FaultInjector
    from sdcwatch.testbed.faultspec import FaultSpec

    torch._dynamo.reset()
    model, loss_of, batch = _reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = Records()
    compiled = torch.compile(model)
    w = attach(model, records, optimizer=opt, config=PROBE_PRESETS["forward-checksums"])
    flip_out, flip_weight = 5, 9  # neither a multiple of 16: forward-only steps
    injector = FaultInjector([FaultSpec(kind="bitflip", step=flip_out, rank=0, target="blocks.1.mlp.fc", bit=29)])
    injector.attach(model, opt)
    for m in model.modules():
        for hook in output_faults(m):
            hook.hook = torch.compiler.disable(hook.hook)  # a faulty device is not traced
    names = w.checksums.names
    for step in range(12):
        injector.begin_step(step)
        loss = loss_of(compiled, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == flip_weight - 1:  # after the seal: the weight the next forward reads is not the sealed one
            with torch.no_grad():
                model.blocks[0].mlp.proj.weight.view(torch.int32)[3, 5] ^= 1 << 30  # the top exponent bit
        w.step(step, loss=loss)
        injector.end_step()
    w.close()
    assert injector.injections and injector.injections[0].step == flip_out
    fwd = {s: records.by_step[s]["layers"]["gemm_fwd"] for s in range(1, 12)}
    bad = {s: [names[i] for i, r in enumerate(v) if not r <= 1] for s, v in fwd.items()}
    assert bad[flip_out] == ["blocks.1.mlp.fc"], bad
    assert "blocks.0.mlp.proj" in bad[flip_weight], bad
    assert all(not bad[s] for s in range(1, flip_weight) if s != flip_out), bad
