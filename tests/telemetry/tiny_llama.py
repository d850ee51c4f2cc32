"""Shared by the model and integration tests: a tiny randomly initialised Llama (nothing is
downloaded), its data, the NaN fault of the end-to-end tests and two real gloo ranks (the detector
service they report to is tests/serve_process.py)."""

from __future__ import annotations

import os

import torch
from sdcwatch.testbed.faultspec import FaultSpec

from sdcwatch.broker import free_port

VOCAB, SEQ, BATCH = 64, 16, 2
WORLD = 2
#: The NaN of every end-to-end test: one element of layer 1's query projection on rank 1, at a
#: step the default sampling measures (attention and activations every 16 steps).
NAN_RANK, NAN_LAYER, NAN_STEP, STEPS = 1, 1, 16, 18


def nan_fault(target: str = "*layers.1.self_attn.q_proj") -> FaultSpec:
    return FaultSpec(kind="nan", rank=NAN_RANK, step=NAN_STEP, duration=1, target=target, where="output", seed=3)


def tiny_llama(impl: str = "sdpa", seed: int = 0, layers: int = 2):
    """LlamaForCausalLM with 2 layers, 4 query heads sharing 2 key/value heads (grouped-query), RoPE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ * 4,
    )
    cfg._attn_implementation = impl
    return LlamaForCausalLM(cfg)


def tokens(step: int, rank: int, micro: int = 0, batch: int = BATCH) -> torch.Tensor:
    """The deterministic batch of ``rank`` at ``step`` (micro-batch ``micro``)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences, as dicts the Hugging Face Trainer takes."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder:
    """An emitter that keeps what it is given: ``records``, (step, fields) in order."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict]] = []

    def emit(self, step: int, **fields) -> None:
        self.records.append((step, fields))

    def close(self, *args, **kwargs) -> None:
        pass


def lightning_llama():
    """The tiny Llama as a Lightning module: a batch is the model's keyword arguments, AdamW at 1e-3."""
    import lightning as L

    class LitLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return LitLlama()


def lightning_trainer(callbacks: list, **settings):
    """A Lightning trainer on the CPU, one device, that writes no log, progress bar, model summary or
    checkpoint; ``settings`` (Trainer arguments) say otherwise."""
    import lightning as L

    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**quiet, "enable_checkpointing": False, **settings}, callbacks=callbacks)


def launch(fn, *args, world: int = WORLD) -> None:
    """Run ``fn(rank, *args)`` in ``world`` real processes joined as torchrun would (env://)."""
    import torch.multiprocessing as mp

    rendezvous = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }
    saved = {k: os.environ.get(k) for k in rendezvous}
    os.environ.update(rendezvous)  # the children inherit it; the test process gets its own back
    try:
        mp.spawn(_rank_main, args=(fn, world, args), nprocs=world, join=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(rank: int, fn, world: int, args: tuple) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    fn(rank, *args)
