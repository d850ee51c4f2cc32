"""The training corpus: the Python standard library's own source files, read at run time.

They are on every machine that runs Python, so the reference run needs no download. Batches are
a pure function of ``(seed, step, rank)``: a faulted run and its clean twin, or a run restarted
from a checkpoint, see exactly the same data.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from sdcwatch.core.errors import ConfigError

__all__ = ["Corpus", "stdlib_sources"]

_DEFAULT_BYTES = 4 << 20


def stdlib_sources(root: str | Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by path (site-packages excluded)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ConfigError("corpus.root", f"{base} is not a directory")
    return sorted(p for p in base.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


class Corpus:
    """A byte tensor of concatenated stdlib sources, with deterministic batch sampling."""

    def __init__(self, max_bytes: int = _DEFAULT_BYTES, *, root: str | Path | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1024:
            raise ConfigError("corpus.max_bytes", f"must be an integer >= 1024, got {max_bytes!r}")
        chunks: list[bytes] = []
        total = 0
        for path in stdlib_sources(root):
            try:
                data = path.read_bytes()
            except OSError:
                continue  # an unreadable file is skipped, not fatal: the corpus is just text
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        blob = b"".join(chunks)[:max_bytes]
        if len(blob) < 1024:
            raise ConfigError("corpus.root", f"found only {len(blob)} bytes of Python source")
        self.data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.int64)

    def __len__(self) -> int:
        return self.data.numel()

    def batch(self, *, seed: int, step: int, rank: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """A (batch_size, seq_len + 1) int64 chunk for this rank and step (inputs plus next byte)."""
        gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + rank)
        starts = torch.randint(0, len(self) - seq_len - 1, (batch_size,), generator=gen)
        offsets = torch.arange(seq_len + 1)
        return self.data[starts[:, None] + offsets]
