"""A small byte-level GPT whose attention is written out, so probes and faults can reach inside it.

Module names are stable and are what fault targets glob over::

    embed, pos, blocks.{i}.ln1, blocks.{i}.attn.qkv, blocks.{i}.attn.scores (q k^T: the logits),
    blocks.{i}.attn.mix (softmax(logits) v), blocks.{i}.attn.proj, blocks.{i}.ln2,
    blocks.{i}.mlp.fc, blocks.{i}.mlp.act, blocks.{i}.mlp.proj, ln_f, head

With ``GPTConfig(fused_qkv=False)`` (the tensor-parallel drivers' model) ``blocks.{i}.attn.wq``,
``.wk`` and ``.wv`` stand in place of ``blocks.{i}.attn.qkv``.

Each attention layer hands its q, k and pre-softmax logits to
:func:`sdcwatch.telemetry.probes.watch.observe_attention`, which costs one dictionary look-up when no
probe is attached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from sdcwatch.core.errors import ConfigError
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPT", "CausalSelfAttention", "next_byte_loss"]


def next_byte_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` (batch, time, vocab) against the bytes that follow in ``batch``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the reference model."""

    vocab: int = 256
    """Byte-level: one token per byte."""
    seq_len: int = 64
    """Context length in tokens."""
    d_model: int = 64
    """Width of the residual stream (64-128 keeps a CPU step in milliseconds)."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""
    fused_qkv: bool = True
    """One q, k, v projection (``attn.qkv``); ``False``: three (``attn.wq``, ``attn.wk``, ``attn.wv``),
    which tensor parallelism can split by columns into heads, as it cannot split a fused one."""

    def __post_init__(self) -> None:
        for key in ("vocab", "seq_len", "d_model", "n_layer", "n_head", "mlp_ratio"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model.{key}", f"must be a positive integer, got {v!r}")
        if self.d_model % self.n_head:
            raise ConfigError("model.n_head", f"{self.n_head} does not divide d_model {self.d_model}")
        if not isinstance(self.fused_qkv, bool):
            raise ConfigError("model.fused_qkv", f"must be true or false, got {self.fused_qkv!r}")


class _Scores(nn.Module):
    """Causal q k^T / sqrt(d_head): the attention logits (masked slots -inf), a module so faults hit it."""

    def __init__(self, d_head: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(d_head)

    def forward(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ((q @ k.transpose(-2, -1)) * self.scale).masked_fill(mask, float("-inf"))


class _Mix(nn.Module):
    """probs v: the second attention GEMM. Marked as a product, so the checksums check it."""

    _sdcwatch_gemm = True  # forward(a, b) returns a @ b: checked like a linear layer

    def forward(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return probs @ v


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with explicit q, k, logits (no fused kernel)."""

    _sdcwatch_attention = True  # discovered by probes.attach()

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.d_head = cfg.d_model // cfg.n_head
        self.fused_qkv = cfg.fused_qkv
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        else:
            self.wq, self.wk, self.wv = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(3))
        self.scores = _Scores(self.d_head)
        self.mix = _Mix()
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1)  # True = future
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from sdcwatch.telemetry.probes.attention import observe_attention

        b, t, _ = x.shape
        if self.fused_qkv:
            q, k, v = self.qkv(x).view(b, t, 3, self.n_head, self.d_head).permute(2, 0, 3, 1, 4)
        else:  # under tensor parallelism each projection returns this rank's heads: count them from it
            q, k, v = (w(x).view(b, t, -1, self.d_head).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        logits = self.scores(q, k, self.mask[:t, :t])
        observe_attention(self, q, k, logits=logits)
        y = self.mix(F.softmax(logits, dim=-1), v)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The reference model: byte embeddings, ``n_layer`` pre-norm blocks, a linear head."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or GPTConfig()
        c = self.cfg
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, time, vocab) for int64 ``tokens`` of shape (batch, time)."""
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ConfigError("model.seq_len", f"input has {t} tokens, the model takes at most {self.cfg.seq_len}")
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-byte cross-entropy of a (batch, seq_len + 1) token chunk."""
        return next_byte_loss(self(batch[:, :-1]), batch)
