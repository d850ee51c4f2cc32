"""Exact 64-bit fingerprints of tensors that must be bit-identical across data-parallel replicas (docs/probes.md)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:  # torch is imported lazily: the emitter must not need it
    import torch

__all__ = [
    "tensor_parts",
    "combine_parts",
    "fingerprint_device",
    "flat_fingerprint_device",
    "finalize",
    "fingerprint",
    "splitmix64",
]

_MASK = (1 << 64) - 1
_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser: a bijection on u64 with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


@functools.cache
def _weights(n: int, device: "torch.device") -> "torch.Tensor":
    """2*n fixed odd constants (as signed int64) on ``device``, cached."""
    import torch

    return torch.tensor([_signed(splitmix64(i) | 1) for i in range(2 * n)], dtype=torch.int64, device=device)


def _bits(t: "torch.Tensor") -> "torch.Tensor":
    """The raw bit patterns of ``t`` as a flat integer tensor of the same element size."""
    import torch

    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    size = t.element_size()
    if size not in _INT_OF_SIZE:
        raise TypeError(f"cannot fingerprint dtype {t.dtype} (element size {size})")
    as_int = getattr(torch, _INT_OF_SIZE[size])
    if t.dtype == torch.bool:
        t = t.to(torch.int8)
    return t.reshape(-1).view(as_int)


def tensor_parts(t: "torch.Tensor") -> "torch.Tensor":
    """The two integer sums (s1, s2) of one tensor's bit patterns, as an int64 (2,) on its device."""
    import torch

    b = _bits(t)
    logical = (b >> 7) & ((1 << (8 * b.element_size() - 7)) - 1)  # no sign smear
    return torch.stack([b.sum(dtype=torch.int64), (b ^ logical).sum(dtype=torch.int64)])


def combine_parts(parts: Sequence["torch.Tensor"]) -> "torch.Tensor":
    """Combine per-tensor :func:`tensor_parts` (in order) into one raw 0-d int64 fingerprint."""
    import torch

    if not parts:
        return torch.zeros((), dtype=torch.int64)
    device = parts[0].device
    stacked = torch.stack([p.to(device) for p in parts]).reshape(-1)
    return (stacked * _weights(len(parts), device)).sum()


def fingerprint_device(tensors: Iterable["torch.Tensor"]) -> "torch.Tensor":
    """The raw (un-mixed) fingerprint of ``tensors``, in order, as a 0-d int64 on their device (no host
    sync; :func:`finalize` of its ``int()`` is the u64 fingerprint)."""
    tensors = list(tensors)
    if len(tensors) == 1:  # the same sums, without the per-tensor stack and transfer: a few ops fewer
        return (tensor_parts(tensors[0]) * _weights(1, tensors[0].device)).sum()
    return combine_parts([tensor_parts(t) for t in tensors])


#: Elements one pass of :func:`flat_fingerprint_device` reads at a time (bounds its temporaries).
FLAT_CHUNK = 1 << 25


def flat_fingerprint_device(tensors: Sequence["torch.Tensor"]) -> "torch.Tensor":
    """Raw device fingerprint of the concatenation of ``tensors`` (``param_fp``, ``grad_fp``): for one
    dtype ``fingerprint_device([torch.cat(...)])`` bit for bit, each tensor read in its own bits.
    No concatenation (the model's size, several GiB): wrap-around sums are associative, so each
    tensor is summed where it lies, in chunks of :data:`FLAT_CHUNK` elements.
    """
    import torch

    if not tensors:
        return torch.zeros((), dtype=torch.int64)
    if len(tensors) == 1 and tensors[0].numel() <= FLAT_CHUNK:
        return fingerprint_device([tensors[0].detach().reshape(-1)])
    device = tensors[0].device
    total = torch.zeros(2, dtype=torch.int64, device=device)
    for t in tensors:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), FLAT_CHUNK):
            total += tensor_parts(flat[start : start + FLAT_CHUNK]).to(device)
    return (total * _weights(1, device)).sum()


def finalize(raw: int) -> int:
    """Turn a raw device fingerprint (a signed int64 read back on the host) into the u64 value."""
    return splitmix64(int(raw) & _MASK)


def fingerprint(tensors: Iterable["torch.Tensor"] | "torch.Tensor") -> int:
    """The u64 fingerprint of one tensor or a sequence of tensors (synchronises: not per step)."""
    import torch

    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return finalize(int(fingerprint_device(tensors)))
