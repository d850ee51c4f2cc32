"""Shared by the model and integration tests: a tiny randomly initialised Llama (nothing is
downloaded), its data, the NaN fault of the end-to-end tests, two real gloo ranks, and the
detector service as a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import torch
from sdcwatch.telemetry.faults import FaultSpec

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


@dataclass
class Topics:
    telemetry: str
    anomalies: str
    dead: str

    @classmethod
    def fresh(cls) -> "Topics":
        tag = uuid.uuid4().hex[:8]
        return cls(f"tel.{tag}", f"anom.{tag}", f"dead.{tag}")


class Service:
    """``sdcwatch serve`` as a subprocess on its own topics (stopped with SIGTERM)."""

    def __init__(self, bootstrap: str, topics: Topics, state_dir) -> None:
        self.bootstrap, self.topics = bootstrap, topics
        cmd = [
            sys.executable,
            "-m",
            "sdcwatch.cli",
            "serve",
            "--bus-bootstrap",
            bootstrap,
            "--bus-telemetry-topic",
            topics.telemetry,
            "--bus-anomalies-topic",
            topics.anomalies,
            "--bus-deadletter-topic",
            topics.dead,
            "--bus-group",
            f"g-{uuid.uuid4().hex[:8]}",
            "--metrics-port",
            str(free_port()),
            "--state-dir",
            str(state_dir),
            "--no-alerts-log",
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if line.startswith("sdcwatch serve: consuming"):
                self.metrics_url = re.search(r"metrics (http://\S+);", line).group(1)
                return
            if self.proc.poll() is not None:
                break
        raise AssertionError(f"serve did not start: {self.proc.stderr.read()[-2000:]}")

    def events(self) -> list[dict]:
        """What the anomalies topic holds now."""
        from kafka import KafkaConsumer

        consumer = KafkaConsumer(
            self.topics.anomalies,
            bootstrap_servers=[self.bootstrap],
            auto_offset_reset="earliest",
            group_id=None,
            consumer_timeout_ms=2000,
        )
        out = [json.loads(m.value) for m in consumer]
        consumer.close()
        return out

    def wait_incident(self, kind: str, timeout: float = 90.0) -> dict:
        """The first ``opened`` event of an incident of ``kind`` (generous bound: a shared machine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            opened = [e for e in self.events() if e["change"] == "opened" and e["kind"] == kind]
            if opened:
                return opened[0]
            time.sleep(0.5)
        raise AssertionError(f"no {kind} incident on {self.topics.anomalies} after {timeout:.0f}s: {self.events()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
