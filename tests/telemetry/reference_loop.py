"""The probes' tests' training loop: the reference GPT on random byte batches, with faults at steps;
and the brute-force gradients a distributed run is checked against."""

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


def step0_gradients(settings: Any, world: int) -> list[list[torch.Tensor]]:
    """Each rank's gradients at step 0 by brute force, the truth a distributed run's statistics are
    checked against: the reference GPT of ``settings.seed``, unsharded, on each rank's batch of the
    shared corpus in turn."""
    from sdcwatch.testbed.model import GPT
    from sdcwatch.testbed.simulated import shared_corpus

    torch.manual_seed(settings.seed)
    model = GPT()
    corpus = shared_corpus(settings.corpus_bytes)
    local = []
    for r in range(world):
        model.zero_grad()
        batch = corpus.batch(
            seed=settings.seed, step=0, rank=r, batch_size=settings.batch_size, seq_len=model.cfg.seq_len
        )
        model.loss(batch).backward()
        local.append([p.grad.clone() for p in model.parameters()])
    return local
