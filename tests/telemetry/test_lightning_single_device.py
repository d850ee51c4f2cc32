"""The Lightning callback on one device (no DDP wrapper): each record's gradient norm must be the
norm of that step's gradient.

Lightning's automatic optimisation calls ``optimizer.step(closure)``: the forward and backward run
inside the closure, after the optimizer's step pre-hooks. Reading ``p.grad`` in such a pre-hook
would read the previous step's gradient (the record of step N would carry step N-1's norm); the
probes read it when the closure's backward ends (and skip the pre-hook read when a closure is
passed). The same holds for ``optimizer.step(closure)`` in a plain loop (LBFGS).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tiny_llama import Recorder, lightning_trainer  # noqa: E402

STEPS = 4


def _regression():
    """A small regression as a LightningModule (lightning imported here, not at collection: seconds
    of every test worker's start)."""
    L = pytest.importorskip("lightning")

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.true_norms: dict[int, float] = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer) -> None:  # after this step's backward
            grads = [p.grad.reshape(-1) for p in self.parameters() if p.grad is not None]
            self.true_norms[self.global_step] = float(torch.cat(grads).norm())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regression()


def test_each_record_carries_its_own_steps_gradient_norm(tmp_path):
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * 4, 8), torch.randn(STEPS * 4, 1))
    module, recorder = _regression(), Recorder()
    trainer = lightning_trainer([SdcwatchCallback(recorder)], max_steps=STEPS, default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    reported = {step: fields["grad_norm_local"] for step, fields in recorder.records if "grad_norm_local" in fields}
    assert sorted(reported) == list(range(STEPS))
    # the steps' gradients differ (the weights move), so a norm one step late cannot match
    assert len({round(n, 6) for n in module.true_norms.values()}) == STEPS
    assert reported == pytest.approx(module.true_norms, rel=1e-5)
