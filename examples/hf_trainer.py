"""A Hugging Face ``Trainer`` run with sdcwatch's callback: a tiny GPT-2 built from a config
(randomly initialised, nothing downloaded) trained on random tokens.

The only sdcwatch line is ``callbacks=[SdcwatchCallback()]``: it opens the emitter (Kafka at
``$SDCWATCH_BOOTSTRAP``, run ``$SDCWATCH_RUN``), attaches the probes when training begins (and to
the Trainer's DDP wrapper under ``torchrun``), reports one record per optimizer step and closes at
the end. With the embedded broker and ``sdcwatch serve`` running (README, "Watch your own job on
one machine"; this needs the ``hf`` extra: ``.venv/bin/pip install -e '.[hf]' torch==2.13.0``):

    SDCWATCH_RUN=hf-nan .venv/bin/python examples/hf_trainer.py --nan-step 20

writes a NaN into block 1's attention input projection (``transformer.h.1.attn.c_attn``) at step
20, and ``sdcwatch serve`` logs a non-finite incident at step 20 naming layer 1 (the block,
``transformer.h.1``). Without ``--nan-step`` the run raises nothing.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
from sdcwatch.testbed import FaultInjector, FaultSpec
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(Dataset):
    """Random token sequences: a stand-in for a tokenised corpus."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.tokens = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}  # the model shifts the labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nan-step", type=int, default=None, help="write a NaN at this step (default: none)")
    parser.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary one)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="hf-trainer-"),  # nothing is saved
        per_device_train_batch_size=8,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    injector = None
    if args.nan_step is not None:  # test the alerting: sdcwatch's fault injector, stepped by the callback
        nan = FaultSpec(kind="nan", rank=0, step=args.nan_step, target="transformer.h.1.attn.c_attn")
        injector = FaultInjector([nan])
    callback = SdcwatchCallback(injector=injector)
    data = RandomTokens(n=8 * args.steps, length=32, vocab=config.vocab_size)
    Trainer(model=model, args=training, train_dataset=data, callbacks=[callback]).train()
    emitter = callback.emitter  # the callback's own, closed at the end of training
    print(f"{args.steps} steps, {emitter.sent} records sent, {emitter.dropped} dropped", flush=True)


if __name__ == "__main__":
    main()
