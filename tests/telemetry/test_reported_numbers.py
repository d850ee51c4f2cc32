"""The numbers a user reads are the framework's own: each record's gradient norm is the one before
clipping, and its loss is the loss the framework logs, on one rank and on two.

With clipping on (the Hugging Face Trainer clips at 1.0 by default) a world-size-1 job used to read
the gradient after clipping: every step read 1.0 while the Trainer logged more, and a x1000
gradient fault raised nothing, where the same job under DDP (whose communication hook reads each
bucket before clipping) saw it. Under the Trainer's DDP the loss was the model output's, which the
Trainer's token averaging divides by the world size: half the logged loss at two ranks.

Each run trains a tiny random Llama (clipping at 1.0: on one rank its gradient norm is above that
every step, on two the mean gradient's is below it but for the fault's step) with a x1000 gradient fault on one step of the last rank, records through a real emitter to a file, and
compares the records with what the framework logged: the Trainer's ``loss`` and ``grad_norm``,
Lightning's ``self.log`` and its ``grad_norm`` utility before the optimizer step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tiny_llama import BATCH, TokenDataset, launch, lightning_trainer, tiny_llama  # noqa: E402

STEPS, FAULT_STEP, CLIP = 4, 2, 1.0


def _fault(world: int):
    from sdcwatch.testbed.faultspec import FaultSpec

    return FaultSpec(
        kind="scale",
        rank=world - 1,
        step=FAULT_STEP,
        duration=1,
        target="*layers.0.mlp.down_proj",
        where="grad",
        magnitude=1000.0,
    )


def _emitter(out: Path, rank: int, world: int):
    from sdcwatch.telemetry import Emitter, FileTransport

    return Emitter(FileTransport(out / f"rank{rank}.jsonl"), run="numbers", rank=rank, world=world, host="h")


def _records(out: Path, world: int) -> list[dict[int, dict]]:
    """Each rank's records: {step: scalars}."""
    from sdcwatch.service.offline import read_records
    from sdcwatch.telemetry import is_end_marker

    return [
        {r.step: dict(r.scalars) for r in read_records(out / f"rank{rank}.jsonl") if not is_end_marker(r)}
        for rank in range(world)
    ]


def _check(ranks: list[dict[int, dict]], logged: dict[int, tuple[float, float]], *, loss_mean: bool) -> None:
    """``logged``: {step: (loss, pre-clip gradient norm)} as the framework logged them; ``loss_mean``:
    the framework logs the ranks' mean loss (else each rank's own, and ``logged`` is per rank)."""
    norms = {step: norm for step, (_, norm) in logged.items()}
    assert sorted(norms) == list(range(STEPS))
    clean = [n for step, n in norms.items() if step != FAULT_STEP]
    assert norms[FAULT_STEP] > 10 * max(clean)  # the framework saw the fault
    assert norms[FAULT_STEP] > CLIP  # and clipped it (on one rank every step is clipped)
    for records in ranks:
        assert sorted(records) == list(range(STEPS))
        reported = {step: s["grad_norm_global"] for step, s in records.items()}
        assert reported == pytest.approx(norms, rel=1e-4)
    losses = {step: loss for step, (loss, _) in logged.items()}
    if loss_mean:
        mean = {step: sum(r[step]["loss"] for r in ranks) / len(ranks) for step in losses}
        assert mean == pytest.approx(losses, rel=1e-5)
    else:
        assert {step: s["loss"] for step, s in ranks[0].items()} == pytest.approx(losses, rel=1e-5)


# -- a plain loop ----------------------------------------------------------------------------------


def test_a_plain_loop_reports_the_norm_clip_grad_norm_returns_before_it_clips():
    """One rank, two micro-batches a step, clip_grad_norm_ before opt.step(): the record carries
    the accumulated gradient's norm as clip_grad_norm_ measured it, the fault's step included."""
    pytest.importorskip("transformers")
    from sdcwatch.telemetry import attach
    from sdcwatch.testbed.faults import FaultInjector
    from tiny_llama import tokens

    class Recorder:
        def __init__(self) -> None:
            self.records: dict[int, dict] = {}

        def emit(self, step: int, **fields) -> None:
            self.records[step] = fields

    model, rec = tiny_llama(), Recorder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = attach(model, rec, optimizer=opt)
    injector = FaultInjector([_fault(1)], rank=0).attach(model, opt)
    norms = {}
    for step in range(STEPS):
        injector.begin_step(step)
        for micro in range(2):
            batch = tokens(step, 0, micro)
            (model(input_ids=batch, labels=batch).loss / 2).backward()
        norms[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        opt.zero_grad()
        watch.step(step, loss=torch.zeros(()))
    watch.close()
    assert watch.errors == 0
    _check([rec.records], {s: (0.0, n) for s, n in norms.items()}, loss_mean=False)


# -- the Hugging Face Trainer ----------------------------------------------------------------------


def hf_run(rank: int, out: Path, world: int) -> None:
    """Two micro-batches a step, the Trainer's default clipping (1.0), a log line every step."""
    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
    from sdcwatch.testbed.faults import FaultInjector
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo" if world > 1 else None,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    assert args.max_grad_norm == CLIP and args.average_tokens_across_devices
    emitter = _emitter(out, rank, world)
    callback = SdcwatchCallback(emitter, injector=FaultInjector([_fault(world)]))
    data = TokenDataset(BATCH * 2 * world * STEPS)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    emitter.close(timeout=30.0)
    assert callback.data_parallel == (world > 1)
    logged = {h["step"] - 1: (h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h}
    (out / f"logged{rank}.json").write_text(json.dumps(logged))


def _hf_logged(out: Path) -> dict[int, tuple[float, float]]:
    return {int(k): tuple(v) for k, v in json.loads((out / "logged0.json").read_text()).items()}


def test_hf_trainer_on_one_rank_reports_the_logged_loss_and_pre_clip_gradient_norm(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    hf_run(0, tmp_path, 1)
    _check(_records(tmp_path, 1), _hf_logged(tmp_path), loss_mean=True)


@pytest.mark.integration
def test_hf_trainer_on_two_ranks_reports_the_logged_loss_and_pre_clip_gradient_norm(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    launch(hf_run, tmp_path, 2)
    # the Trainer logs the mean of the ranks' losses: each rank's share is on the logged scale
    _check(_records(tmp_path, 2), _hf_logged(tmp_path), loss_mean=True)


# -- Lightning ---------------------------------------------------------------------------------------


def lightning_run(rank: int, out: Path, world: int) -> None:
    """Lightning's clipping at 1.0; the module logs its loss every step (a logger keeps it) and
    measures the gradient with Lightning's ``grad_norm`` where Lightning says to, before clipping."""
    import lightning as L
    from lightning.pytorch.loggers.logger import Logger
    from lightning.pytorch.utilities import grad_norm
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback
    from sdcwatch.testbed.faults import FaultInjector

    class Kept(Logger):
        name, version = "kept", 0

        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def log_metrics(self, metrics, step=None) -> None:
            if "train_loss" in metrics:
                self.losses.append(float(metrics["train_loss"]))

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

    class LitLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama()
            self.norms: dict[int, float] = {}

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.log("train_loss", loss)
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:
            self.norms[self.global_step] = float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    strategy = "auto"
    if world > 1:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend="gloo")
    emitter, kept, module = _emitter(out, rank, world), Kept(), LitLlama()
    callback = SdcwatchCallback(emitter, injector=FaultInjector([_fault(world)]))
    trainer = lightning_trainer(
        [callback],
        devices=world,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        logger=kept,
        log_every_n_steps=1,
        default_root_dir=str(out / "lightning"),
    )
    trainer.fit(module, torch.utils.data.DataLoader(TokenDataset(BATCH * world * STEPS), batch_size=BATCH))
    emitter.close(timeout=30.0)
    assert callback.data_parallel == (world > 1)
    logged = {step: (kept.losses[step], norm) for step, norm in module.norms.items()}
    (out / f"logged{rank}.json").write_text(json.dumps(logged))


def _lightning_check(out: Path, world: int) -> None:
    ranks = _records(out, world)
    for rank in range(world):  # each rank logs its own loss (no sync_dist)
        logged = {int(k): tuple(v) for k, v in json.loads((out / f"logged{rank}.json").read_text()).items()}
        _check([ranks[rank]], logged, loss_mean=False)


def test_lightning_on_one_device_reports_the_logged_loss_and_pre_clip_gradient_norm(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    lightning_run(0, tmp_path, 1)
    _lightning_check(tmp_path, 1)


@pytest.mark.integration
def test_lightning_on_two_ranks_reports_the_logged_loss_and_pre_clip_gradient_norm(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "sdcwatch-test")  # Lightning: the ranks are launched already
    launch(lightning_run, tmp_path, 2)
    _lightning_check(tmp_path, 2)
