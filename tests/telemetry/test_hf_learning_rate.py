"""The Hugging Face callback reports the learning rate each optimizer step used.

The Trainer steps its scheduler after the optimizer and before ``on_step_end``, where the callback
closes the step: read there, the record of step N carried step N+1's rate, and a learning-rate
jump was reported a step before it happened.
"""

from __future__ import annotations

import pytest
from installed import needs

torch = pytest.importorskip("torch")
needs("transformers", "accelerate")

from tiny_llama import Recorder  # noqa: E402

STEPS, LR = 4, 1e-2


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.head(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))}


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return STEPS * 2

    def __getitem__(self, i: int) -> dict:
        ids = torch.arange(8) % 16
        return {"input_ids": ids, "labels": ids}


def test_each_record_carries_the_learning_rate_its_step_used(tmp_path):
    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="linear",  # no warm-up: step s runs at LR * (STEPS - s) / STEPS
        warmup_steps=0,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    recorder = Recorder()
    Trainer(model=TinyLM(), args=args, train_dataset=Tokens(), callbacks=[SdcwatchCallback(recorder)]).train()
    reported = {step: fields["lr"] for step, fields in recorder.records if "lr" in fields}
    assert reported == pytest.approx({s: LR * (STEPS - s) / STEPS for s in range(STEPS)})
