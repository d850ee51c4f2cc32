"""End to end through each way of adding sdcwatch to training: the README's plain DDP loop, the
Hugging Face Trainer callback and the Lightning callback.

Each runs a tiny randomly initialised Llama (SDPA attention, grouped-query heads, RoPE) on two
real gloo ranks with the default probe settings, records through the embedded broker to
``sdcwatch serve``; a NaN injected in layer 1's query projection on rank 1 must come out as one
non-finite incident naming rank 1 and layer 1 at its step, and keep naming them after the NaN has
reached every rank and layer.
"""

from __future__ import annotations

import uuid

import pytest

torch = pytest.importorskip("torch")

from serve_process import ServeProcess, Topics  # noqa: E402
from tiny_llama import (  # noqa: E402
    BATCH,
    NAN_LAYER,
    NAN_RANK,
    NAN_STEP,
    STEPS,
    TokenDataset,
    launch,
    lightning_llama,
    lightning_trainer,
    nan_fault,
    tiny_llama,
    tokens,
)

pytestmark = pytest.mark.integration


def _emitter(bootstrap: str, topic: str, run: str):
    from sdcwatch.telemetry import Emitter

    return Emitter(bootstrap=bootstrap, topic=topic, run=run)  # rank and world from the launcher's env


def plain_rank(rank: int, bootstrap: str, topic: str, run: str) -> None:
    """The README's loop under DDP; the injector is attached after the probes."""
    import torch.distributed as dist
    from sdcwatch.telemetry import attach
    from sdcwatch.testbed.faults import FaultInjector
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    model = tiny_llama()
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    emitter = _emitter(bootstrap, topic, run)
    watch = attach(model, emitter, optimizer=opt, ddp=ddp)
    injector = FaultInjector([nan_fault()], rank=rank).attach(model, opt)
    for step in range(STEPS):
        injector.begin_step(step)
        batch = tokens(step, rank)
        loss = ddp(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        watch.step(step, loss=loss)
    watch.close()
    emitter.close(timeout=30.0)
    dist.destroy_process_group()


def hf_rank(rank: int, bootstrap: str, topic: str, run: str, out: str) -> None:
    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
    from sdcwatch.testbed.faults import FaultInjector
    from transformers import Trainer, TrainingArguments

    emitter = _emitter(bootstrap, topic, run)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callback = SdcwatchCallback(emitter, injector=FaultInjector([nan_fault()]))
    Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(BATCH * 2 * STEPS), callbacks=[callback]).train()
    emitter.close(timeout=30.0)
    assert callback.data_parallel  # the probes found the Trainer's DDP wrapper


def lightning_rank(rank: int, bootstrap: str, topic: str, run: str, out: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback
    from sdcwatch.testbed.faults import FaultInjector

    emitter = _emitter(bootstrap, topic, run)
    callback = SdcwatchCallback(emitter, injector=FaultInjector([nan_fault()]))
    ddp = DDPStrategy(process_group_backend="gloo")
    trainer = lightning_trainer([callback], devices=2, strategy=ddp, max_steps=STEPS, default_root_dir=out)
    data = torch.utils.data.DataLoader(TokenDataset(BATCH * 2 * STEPS), batch_size=BATCH)
    trainer.fit(lightning_llama(), data)
    emitter.close(timeout=30.0)
    assert callback.data_parallel  # the probes found the strategy's DDP wrapper


@pytest.mark.parametrize("how", ["plain", "hf", "lightning"])
@pytest.mark.slow
def test_nan_in_layer_1_on_rank_1_is_an_incident_naming_both(how, bootstrap, tmp_path, monkeypatch):
    if how == "hf":
        pytest.importorskip("transformers")
        pytest.importorskip("accelerate")
    if how == "lightning":
        pytest.importorskip("lightning")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "sdcwatch-test")  # Lightning: the ranks are launched already
    topics = Topics.fresh()
    run = f"{how}-{uuid.uuid4().hex[:6]}"
    with ServeProcess(bootstrap, topics, tmp_path / "state") as service:
        service.wait_banner()
        fn = {"plain": plain_rank, "hf": hf_rank, "lightning": lightning_rank}[how]
        extra = () if how == "plain" else (str(tmp_path / "out"),)
        launch(fn, bootstrap, topics.telemetry, run, *extra)
        opened = service.wait_incident("nonfinite")
        events = [e for e in service.events() if e["kind"] == "nonfinite"]
    assert opened["run"] == run
    assert opened["first_step"] == NAN_STEP
    assert opened["ranks"] == [NAN_RANK]
    assert opened["layer"] == NAN_LAYER
    # the NaN reached every replica through the all-reduce and every layer after it: the incident
    # still names where it began
    assert all(e["ranks"] == [NAN_RANK] and e["layer"] == NAN_LAYER for e in events), events


def accumulation_rank(rank: int) -> None:
    """Two micro-batches a step under ``no_sync``: the comm hook runs once, on the sync step, and
    sees the whole accumulated gradient (checked against a twin model that never all-reduces)."""
    import contextlib

    import torch.distributed as dist
    from sdcwatch.telemetry import attach
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Recorder:
        records: list = []

        def emit(self, step, **kw):
            self.records.append((step, kw))

    dist.init_process_group("gloo")
    model, twin = tiny_llama(), tiny_llama()  # same seed: same weights
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put: the twin stays a twin
    rec = Recorder()
    watch = attach(model, rec, optimizer=opt, ddp=ddp, attention_every=1)
    expected = []
    for step in range(2):
        for micro in range(2):
            batch = tokens(step, rank, micro)
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                (ddp(input_ids=batch, labels=batch).loss / 2).backward()
            (twin(input_ids=batch, labels=batch).loss / 2).backward()
        local = torch.cat([p.grad.reshape(-1) for p in twin.parameters()])
        total = local.clone()
        dist.all_reduce(total)
        expected.append((float(local.norm()), float((total / dist.get_world_size()).norm())))
        opt.step()
        opt.zero_grad()
        twin.zero_grad()
        watch.step(step)
    watch.close()
    dist.destroy_process_group()
    assert [s for s, _ in rec.records] == [0, 1]
    for (_, kw), (local_norm, global_norm) in zip(rec.records, expected):
        assert kw["grad_norm_local"] == pytest.approx(local_norm, rel=1e-4)
        assert kw["grad_norm_global"] == pytest.approx(global_norm, rel=1e-4)
        assert len(kw["layers"]["attn_entropy"]) == 2


@pytest.mark.slow
def test_gradient_accumulation_under_ddp_reports_the_accumulated_gradient_on_the_sync_step():
    launch(accumulation_rank)
