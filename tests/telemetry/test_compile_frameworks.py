"""The probes under torch.compile as the frameworks compile a model: DDP around the compiled model
(nanoGPT's order), the Hugging Face Trainer's ``torch_compile=True`` and a compiled
``LightningModule``; no graph break, the sampled variant only, the checks measured (``aot_eager``).
"""

from __future__ import annotations

import pytest
import torch
from compiled_training import Records, Sink, compiled_settings, counters, reference, run_steps
from sdcwatch.telemetry.probes.watch import attach


@pytest.fixture(autouse=True)
def _settings(monkeypatch):
    yield from compiled_settings(monkeypatch)


@pytest.mark.slow
def test_ddp_around_the_compiled_model(tmp_path):
    """nanoGPT's order, torch.compile and then DDP: attach(ddp) watches the model inside both wrappers
    and the job trains, an eval forward first (the watch held the compiled wrapper, and Dynamo
    refused to trace a hook that reached it: "already tracked for mutation")."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model, loss_of, batch = reference()
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
        run_steps(ddp, loss_of, batch, opt, w, range(2))
        assert "gemm_out" in records.by_step[0]["layers"]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_hugging_face_trainer_torch_compile(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the model, the callback
    attaches inside the compiled wrapper; no break, the sampled variant only, the probes measure."""
    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
    from tiny_llama import TokenDataset, tiny_llama
    from transformers import Trainer, TrainingArguments

    torch._dynamo.reset()
    count = counters()
    count.clear()
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
    assert not count["graph_break"] and count["stats"]["unique_graphs"] == 2
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
    count = counters()
    count.clear()
    sink = Sink()
    trainer = lightning_trainer([SdcwatchCallback(sink)], max_steps=20)
    trainer.fit(
        torch.compile(LitLlama(), backend="aot_eager"),
        torch.utils.data.DataLoader(TokenDataset(40), batch_size=2),
    )
    assert not count["graph_break"] and count["stats"]["unique_graphs"] == 2
    assert len(sink.by_step) == 20
    assert "gemm_out" in sink.by_step[3]["layers"] and max(sink.by_step[16]["layers"]["gemm_fwd"]) > 0
