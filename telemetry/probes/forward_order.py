"""``nonfinite_first``: where in the forward pass a rank first saw a NaN, Inf or near-INF value (docs/probes.md)."""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from sdcwatch.telemetry.probes.compiled_calls import cached

__all__ = ["NEAR_INF", "ForwardOrder"]

#: ATTNChecker's near-INF threshold, the non-finite detector's default ``limit``.
NEAR_INF = 1e10


class ForwardOrder:
    """The forward-order ordinals of one watch's every-step observations, for one step at a time."""

    def __init__(self, limit: float = NEAR_INF) -> None:
        self.limit = float(limit)
        self._next = 0
        self._counter: torch.Tensor | None = None  # compiled code's ordinals (see traced_tick)
        self._ordinals: list[int | torch.Tensor] = []
        self._peaks: list[torch.Tensor] = []
        self._index: dict[tuple, torch.Tensor] = {}  # the ordinals as a device tensor: a step calls as the last did

    def tick(self) -> int:
        """The ordinal of the observation a hook makes now (0, 1, 2... within the step)."""
        n = self._next
        self._next = n + 1
        return n

    def place(self, device: torch.device) -> None:
        """Keep compiled code's counter on ``device`` (the model's): called before each step."""
        if self._counter is None or self._counter.device != device:
            self._counter = torch.zeros((), dtype=torch.float32, device=device)
            # its address fixed: CUDA graphs (mode="reduce-overhead") take its in-place count
            with contextlib.suppress(Exception):  # a torch without Dynamo
                torch._dynamo.mark_static_address(self._counter)

    def traced_tick(self) -> torch.Tensor:
        """:meth:`tick` for code torch.compile traces: the ordinal as a 0-d device tensor, counted on the
        device, so that the traced code holds no Python number that differs from call to call (blocks
        compiled one by one would each compile their own graph). The two counts are kept apart: one
        step's observations are numbered by one of them (all compiled, or all eager)."""
        if self._counter is None:  # never placed: the ordinal of a lone call
            return torch.zeros(())
        self._counter.add_(1)
        return self._counter - 1

    def note(self, ordinals: Sequence[int | torch.Tensor], peaks: torch.Tensor) -> None:
        """The (calls,) largest |value| of the observations numbered ``ordinals`` (NaN kept)."""
        if len(ordinals) and peaks.numel() == len(ordinals):
            self._ordinals.extend(o if isinstance(o, torch.Tensor) else int(o) for o in ordinals)
            self._peaks.append(peaks.detach().reshape(-1).float())

    def first(self) -> torch.Tensor | None:
        """The smallest ordinal whose peak is NaN, Inf or >= the limit, as a 0-d float device tensor,
        -1 when none is; None when nothing was observed. Starts the next step."""
        ordinals, peaks = self._ordinals, self._peaks
        self.reset()
        if not ordinals:
            return None
        with torch.no_grad():
            peak = torch.cat(peaks)
            if any(isinstance(o, torch.Tensor) for o in ordinals):  # counted on the device (compiled code)
                order = torch.stack(
                    [
                        o.reshape(()).float().to(peak.device)
                        if isinstance(o, torch.Tensor)
                        else torch.tensor(float(o), device=peak.device)
                        for o in ordinals
                    ]
                )
            else:
                key = (tuple(ordinals), peak.device)
                order = cached(self._index, key, lambda: torch.tensor(ordinals, dtype=torch.float32).to(peak.device))
            fine = peak.abs() < self.limit  # NaN fails the comparison: it is bad
            return torch.where(fine, float("inf"), order).amin().nan_to_num(posinf=-1.0)

    def reset(self) -> None:
        self._next = 0
        if self._counter is not None:
            self._counter.zero_()
        self._ordinals = []
        self._peaks = []
