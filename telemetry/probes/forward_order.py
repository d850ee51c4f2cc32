"""``nonfinite_first``: where in the forward pass a rank first saw a NaN, Inf or near-INF value.

Under tensor parallelism two ranks of one tensor-parallel group hold the same all-reduced residual
stream: once a rank's shard of a product goes bad, the row-parallel all-reduce hands the bad value
to its peers, and after that both report a non-finite value at the same layer. What tells them
apart is *when* in the forward pass each saw it: the culprit's own share of a product (or its
heads' attention logits) is bad before the collective, the peer's values only after it (or at the
next module reading the corrupted copy).

:class:`ForwardOrder` numbers the every-step observations of the finite-SDC probes in the order the
forward pass makes them (each product's output, ``gemm_out``; each block's output, ``stream_max``;
each attention layer's logits, ``attn_logit_max`` / ``attn_logit_min``): a hook takes the next
ordinal with :meth:`ForwardOrder.tick` (a host integer, no device work), the probe hands its
per-call peaks over with :meth:`ForwardOrder.note` when it reduces them at the step's end, and
:meth:`ForwardOrder.first` gives the smallest ordinal whose peak is NaN, Inf or at least
:data:`NEAR_INF` as one 0-d device tensor (-1 on a clean step). The watch sends it as the scalar
``nonfinite_first`` only when it is >= 0, so a clean step costs nothing on the wire.

Ranks that run the same model code make the same observations in the same order, so the ordinals
of a tensor-parallel group's ranks compare: the non-finite detector blames the rank(s) with the
smallest. Without tensor parallelism the value is sent all the same and changes nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

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
            try:  # its address fixed: CUDA graphs (mode="reduce-overhead") take its in-place count
                torch._dynamo.mark_static_address(self._counter)
            except Exception:  # a torch without Dynamo
                pass

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
                return torch.where(peak.abs() < self.limit, float("inf"), order).amin().nan_to_num(posinf=-1.0)
            key = (tuple(ordinals), peak.device)
            order = self._index.get(key)
            if order is None:
                if len(self._index) > 64:
                    self._index.clear()
                order = self._index[key] = torch.tensor(ordinals, dtype=torch.float32).to(peak.device)
            fine = peak.abs() < self.limit  # NaN fails the comparison: it is bad
            return torch.where(fine, float("inf"), order).amin().nan_to_num(posinf=-1.0)

    def reset(self) -> None:
        self._next = 0
        if self._counter is not None:
            self._counter.zero_()
        self._ordinals = []
        self._peaks = []
