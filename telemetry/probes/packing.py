"""The watch's device-to-host hand-off: one step's metrics packed into one tensor, copied to the host
asynchronously, read back a step later off the training thread (:class:`RecordSender`).
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable, NamedTuple

import numpy
import torch
from sdcwatch.core.vocabulary import ATTENTION_STATS
from sdcwatch.telemetry.probes import fingerprint as fp

__all__ = ["PackedStep", "RecordSender", "pack_step", "unpack_step"]

_EXTRA = "_nonfinite_extra"  # the slot of the non-finite count measured elsewhere (the DDP hook)


class PackedStep(NamedTuple):
    """One step on its way to the host: the packed tensor, its arrival event (CUDA), what is where."""

    step: int
    packed: torch.Tensor
    event: Any
    names: list[str]
    n_attn: int
    fp_names: list[str]
    host: dict[str, float]
    extra_sizes: list[tuple[str, int]] = []  # per-layer vectors of other probes, after the attention grid


def pack_step(
    step: int,
    device_scalars: dict[str, torch.Tensor],
    attn: torch.Tensor | None,
    fingerprints: dict[str, torch.Tensor],
    host: dict[str, float],
    *,
    nonfinite_extra: torch.Tensor | None = None,
    layers: dict[str, torch.Tensor] | None = None,
) -> PackedStep:
    """One device tensor (float64 values bit-cast to int64, then fingerprints) and its async copy."""
    names = list(device_scalars)
    values = [t if t.dtype == torch.float32 else t.float() for t in device_scalars.values()]  # all 0-d
    if nonfinite_extra is not None:
        names.append(_EXTRA)
        values.append(nonfinite_extra)
    if len({v.device for v in values}) > 1:
        values = [v.to(values[0].device) for v in values]
    parts = [torch.stack(values)] if values else []
    n_attn = 0
    if attn is not None:
        parts.append(attn.reshape(-1))
        n_attn = attn.shape[0]
    extra_sizes = []  # per-layer vectors of other probes (checksums, residual stream)
    for name, vec in (layers or {}).items():
        parts.append(vec.reshape(-1))
        extra_sizes.append((name, parts[-1].numel()))
    floats = None
    if parts:  # one concatenation (float32, on the first part's device), not one per part
        dev = parts[0].device
        parts = [p if p.dtype == torch.float32 and p.device == dev else p.float().to(dev) for p in parts]
        floats = torch.cat(parts) if len(parts) > 1 else parts[0]
    fp_names = list(fingerprints)
    pieces = [floats.double().view(torch.int64)] if floats is not None else []
    if fp_names:
        pieces.append(torch.stack([fingerprints[n].reshape(()) for n in fp_names]))
    if not pieces:
        packed = torch.zeros(0, dtype=torch.int64)
    else:
        device = pieces[0].device
        packed = torch.cat([pc.to(device) for pc in pieces]) if len(pieces) > 1 else pieces[0]
    event = None
    if packed.device.type == "cuda":
        host_buf = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host_buf.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        packed = host_buf
    elif packed.device.type != "cpu":
        packed = packed.to("cpu", non_blocking=True)
    return PackedStep(step, packed, event, names, n_attn, fp_names, host, extra_sizes)


def unpack_step(pending: PackedStep) -> tuple[int, dict[str, float], dict[str, list] | None, dict[str, int] | None]:
    """(step, scalars, layers, fingerprints) of a packed step, read on the host (waits for its copy)."""
    step, packed, event, names, n_attn, fp_names, host, extra_sizes = pending
    if event is not None:
        event.synchronize()
    values = packed.numpy()
    at = len(names) + n_attn * len(ATTENTION_STATS)
    n_float = at + sum(n for _, n in extra_sizes)
    floats = values[:n_float].view("float64")
    scalars = dict(host)
    scalars.update(zip(names, floats[: len(names)].tolist()))
    # non-finite values among the metrics themselves: the loss, the gradient norms (a NaN or
    # Inf anywhere in the gradient makes them so), the attention statistics (q, k, logits)
    extra = scalars.pop(_EXTRA, 0.0)
    seen = numpy.count_nonzero(~numpy.isfinite(floats))
    scalars["nonfinite"] = float(seen) + (extra if math.isfinite(extra) else 0.0)
    layers = {}
    if n_attn:
        grid = floats[len(names) : at].reshape(n_attn, len(ATTENTION_STATS))
        layers.update(zip(ATTENTION_STATS, grid.T.tolist()))
    for name, n in extra_sizes:
        layers[name] = floats[at : at + n].tolist()
        at += n
    fingerprints = {n: fp.finalize(v) for n, v in zip(fp_names, values[n_float:].tolist())} or None
    return step, scalars, layers or None, fingerprints


class RecordSender:
    """Hands each packed step to ``emit`` a step after its copy started, on a thread of its own
    (``background``; else on the caller's), once the copy is surely done."""

    def __init__(self, emit: Callable[[PackedStep], None], *, background: bool = True) -> None:
        self._emit = emit
        self._background = background
        self._pending: PackedStep | None = None
        self._outbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def put(self, packed: PackedStep) -> None:
        """Keep ``packed`` (its copy just started); the previous one goes to ``emit``."""
        self.handoff()
        self._pending = packed

    def handoff(self) -> None:
        """Pass the step whose copy was started a step ago to ``emit``."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not self._background:
            self._emit(pending)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="sdcwatch-probes", daemon=True)
            self._thread.start()
        self._outbox.put(pending)

    def _send_loop(self) -> None:
        while True:
            pending = self._outbox.get()
            try:
                if pending is None:
                    return
                self._emit(pending)
            finally:
                self._outbox.task_done()

    def join(self) -> None:
        """Wait until every step handed off so far is emitted (the one kept stays kept)."""
        if self._thread is not None:
            self._outbox.join()

    def flush(self) -> None:
        """Emit every step kept so far, and wait until they are."""
        self.handoff()
        self.join()

    def close(self) -> None:
        """Flush, then stop the thread."""
        self.flush()
        if self._thread is not None:
            self._outbox.put(None)
            self._thread.join(timeout=10.0)
