"""The Hugging Face and Lightning callbacks tell the service of every checkpoint their trainer saves,
and the plain loop's ``Emitter.checkpoint`` never raises into training."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.rank_notes import CKPT_MAGIC, decode_note  # noqa: E402
from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport  # noqa: E402
from tiny_llama import BATCH, TokenDataset, lightning_llama, lightning_trainer, tiny_llama  # noqa: E402

STEPS = 4


def _notes(bus: MemoryBus) -> list:
    return [decode_note(v) for _, v in bus.messages("sdcwatch.telemetry") if v[:4] == CKPT_MAGIC]


def test_hf_on_save_sends_the_checkpoint_folder_the_trainer_wrote(tmp_path):
    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    bus = MemoryBus()
    emitter = Emitter(MemoryTransport(bus), run="hf", rank=0, world=1)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=2,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callback = SdcwatchCallback(emitter)
    Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(BATCH * STEPS), callbacks=[callback]).train()
    emitter.close()
    notes = _notes(bus)
    assert [(n.step, n.path) for n in notes] == [
        (1, str(tmp_path / "checkpoint-2")),
        (3, str(tmp_path / "checkpoint-4")),
    ]
    assert all(os.path.isdir(n.path) for n in notes)  # the folders the Trainer wrote


def test_lightning_on_save_checkpoint_sends_the_file_being_written(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback

    torch.manual_seed(0)
    bus = MemoryBus()
    emitter = Emitter(MemoryTransport(bus), run="pl", rank=0, world=1)
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="s{step}")
    trainer = lightning_trainer(
        [SdcwatchCallback(emitter), saves], max_steps=STEPS, enable_checkpointing=True, default_root_dir=tmp_path
    )
    trainer.fit(lightning_llama(), torch.utils.data.DataLoader(TokenDataset(BATCH * STEPS), batch_size=BATCH))
    emitter.close()
    notes = _notes(bus)
    assert [n.step for n in notes] == [1, 3]
    assert [os.path.basename(n.path) for n in notes] == ["sstep=2.ckpt", "sstep=4.ckpt"]
    assert all(os.path.isfile(n.path) for n in notes)


def test_checkpoint_never_raises_and_a_bad_step_is_counted():
    bus = MemoryBus()
    emitter = Emitter(MemoryTransport(bus), run="p", rank=0, world=1)
    emitter.emit(0, loss=1.0)
    emitter.checkpoint(-1, "/x")  # invalid: dropped on the sender, counted
    emitter.checkpoint(0, object())  # any path: sent as its text
    emitter.close()
    assert emitter.notes.sent == 1 and emitter.notes.dropped == 1
    emitter.checkpoint(1, "/late")  # after close: counted, never raised
    assert emitter.notes.dropped == 2
