"""``Watch.clip_grad_norm_``: torch's clipping bit for bit, with torch's own total norm (world size
one and DDP), after the watch read the gradient the record reports (before the clipping)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.telemetry.probes.watch import attach  # noqa: E402

torch.set_num_threads(1)


class Records:
    def __init__(self) -> None:
        self.by_step: dict[int, dict] = {}

    def emit(self, step: int, **fields) -> None:
        self.by_step[step] = fields


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _norm_passes(monkeypatch) -> list[int]:
    """Counts the calls of torch._foreach_norm (one per pass over the gradients)."""
    calls = [0]
    real = torch._foreach_norm

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counted)
    return calls


def test_clipping_through_the_watch_is_torchs_bit_for_bit(monkeypatch):
    torch.manual_seed(1)
    x, y = torch.randn(8, 16) * 30, torch.randn(8, 4)
    twin = _model()
    loss = torch.nn.functional.mse_loss(twin(x), y)
    loss.backward()
    torch_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    assert torch_norm > 0.5  # the clipping does clip

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = Records()
    w = attach(model, records, optimizer=opt)
    passes = _norm_passes(monkeypatch)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    norm = w.clip_grad_norm_(0.5)
    assert passes[0] == 2  # the watch's own read at the end of the backward, then torch's norm
    assert torch.equal(norm, torch_norm)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    opt.step()
    opt.zero_grad()
    w.step(0, loss=loss)
    w.close()
    assert records.by_step[0]["grad_norm_global"] == pytest.approx(float(torch_norm), rel=1e-6)  # before clipping


def test_another_parameter_list_or_a_closed_watch_clips_as_torch_does(monkeypatch):
    model = _model()
    w = attach(model, Records())
    x = torch.randn(4, 16) * 50
    model(x).square().sum().backward()
    first = list(model.parameters())[:2]
    expected = torch.nn.utils.get_total_norm([p.grad for p in first])
    norm = w.clip_grad_norm_(1.0, parameters=first)  # a subset: its own norm, not the model's
    assert torch.allclose(norm, expected)
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in first])) == pytest.approx(1.0, rel=1e-5)
    w.close()
    with pytest.raises(RuntimeError, match="non-finite"):
        model[0].weight.grad[0, 0] = float("nan")
        w2 = attach(model, Records())
        w2.clip_grad_norm_(1.0, error_if_nonfinite=True)


def _ddp_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model())
        w = attach(model, Records())
        torch.manual_seed(10 + rank)
        x, y = torch.randn(8, 16) * 30, torch.randn(8, 4)
        calls = [0]
        real = torch._foreach_norm

        def counted(*a, **k):
            calls[0] += 1
            return real(*a, **k)

        torch._foreach_norm = counted
        torch.nn.functional.mse_loss(model(x), y).backward()
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        calls[0] = 0
        norm = w.clip_grad_norm_(0.5)
        torch._foreach_norm = real
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.save({"norm": norm, "expected": expected, "passes": calls[0], "after": grads.norm()}, f"{out}.{rank}")
        w.close()
        dist.barrier()  # neither rank leaves the group while the other still talks to it
    finally:
        dist.destroy_process_group()


def test_ddp_clipping_takes_torchs_norm_of_the_all_reduced_gradient(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "r")
    mp.spawn(_ddp_rank, args=(2, port, out), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got["passes"] == 1  # torch's own norm, not the hook's sums per bucket (another order)
        assert torch.equal(got["norm"], got["expected"])
        assert got["after"] == pytest.approx(0.5, rel=1e-4)
    assert os.path.exists(f"{out}.1")
