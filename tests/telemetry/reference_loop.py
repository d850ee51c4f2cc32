"""The probes' tests' training loop: the reference GPT on random byte batches, with faults at steps."""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

import torch


def train_reference(
    model: Any,
    opt: torch.optim.Optimizer,
    watch: Any,
    steps: int,
    *,
    seed: int = 0,
    faults: Mapping[int, Callable[[], Any]] | None = None,
    no_update: Collection[int] = (),
) -> None:
    """Train ``model`` (a :class:`~sdcwatch.testbed.model.GPT`) ``steps`` steps on batches of two
    random sequences drawn from ``seed``, calling ``watch.step(s, loss=loss)`` after each update.

    ``faults[s]()`` runs before step ``s``'s forward (flip a weight, register a fault hook); a hook
    handle it returns is removed after that forward. Steps in ``no_update`` take no backward and no
    optimizer step (a NaN loss would poison the weights)."""
    faults = faults or {}
    g = torch.Generator().manual_seed(seed)
    for s in range(steps):
        handle = faults[s]() if s in faults else None
        loss = model.loss(torch.randint(0, model.cfg.vocab, (2, model.cfg.seq_len + 1), generator=g))
        if handle is not None:
            handle.remove()
        opt.zero_grad()
        if s not in no_update:
            loss.backward()
            opt.step()
        watch.step(s, loss=loss)
