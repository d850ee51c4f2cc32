"""The skip decided on the device (DeviceSkip): no host read during the step, a non-finite step leaves
the parameters bit for bit as they were, spikes are skipped, a clean run takes none."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

import sdcwatch.core  # noqa: E402
import sdcwatch.telemetry  # noqa: E402
from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.telemetry.guard import DeviceSkip, DeviceSkipConfig  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402

_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
_PRODUCT = tuple(os.path.dirname(m.__file__) + os.sep for m in (sdcwatch.telemetry, sdcwatch.core))
_OPTIM = os.path.dirname(torch.optim.__file__) + os.sep


class HostRead(AssertionError):
    pass


def _ours() -> bool:
    """A read our code makes (the optimizer's own read of its CPU step counter is the job's)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_OPTIM):
            return False
        if name.startswith(_PRODUCT):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def no_host_reads():
    thread = threading.current_thread()
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def patched(name):
        original = saved[name]

        def read(self, *args, **kwargs):
            if threading.current_thread() is thread and _ours():
                raise HostRead(f"Tensor.{name}() during the step")
            return original(self, *args, **kwargs)

        return read

    for name in _READS:
        setattr(torch.Tensor, name, patched(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _model(fused: bool):
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, d_model=32, n_layer=1, n_head=4))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused)


def _train(model, opt, skip, steps, nan_at=(), spike_at=()):
    g = torch.Generator().manual_seed(1)
    flat = []
    for step in range(steps):
        x = torch.randint(0, 256, (4, 17), generator=g)
        loss = model.loss(x)
        if step in spike_at:
            loss = loss * 50.0
        loss.backward()
        if step in nan_at:
            next(model.parameters()).grad[0, 0] = float("nan")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        skip.step(norm, loss=loss.detach())
        opt.zero_grad(set_to_none=True)
        flat.append((before, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()))
    return flat


@pytest.mark.parametrize("fused", [False, True])
def test_the_device_skip_reads_nothing_on_the_host_during_the_step(fused):
    model, opt = _model(fused)
    skip = DeviceSkip(opt)
    assert skip.how == ("found_inf" if fused else "restore")
    with no_host_reads():
        _train(model, opt, skip, 40, nan_at=(35,))
        tele = skip.telemetry()
        with pytest.raises(HostRead):  # the patch works: a read the product makes is caught
            skip.skipped()
    assert skip.skipped() == {"skips": 1, "nonfinite": 1, "spike": 0}
    assert set(tele) == {"guard_action", "guard_reason"}


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_gradient_leaves_parameters_and_optimizer_state_bit_for_bit_and_training_goes_on(fused):
    model, opt = _model(fused)
    skip = DeviceSkip(opt)
    flat = _train(model, opt, skip, 12)
    state = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    flat += _train(model, opt, skip, 1, nan_at=(0,))
    before, after = flat[-1]
    assert torch.equal(before, after)  # the step with the NaN changed nothing
    assert all(torch.equal(v, opt.state[next(model.parameters())][k]) for k, v in state.items())
    assert skip.telemetry()["guard_action"].item() == 1.0 and skip.telemetry()["guard_reason"].item() == 1.0
    flat += _train(model, opt, skip, 3)
    assert all(not torch.equal(b, a) for b, a in flat[-3:])  # training goes on
    assert torch.isfinite(flat[-1][1]).all()
    assert skip.skipped() == {"skips": 1, "nonfinite": 1, "spike": 0}


def test_a_loss_spike_is_skipped_after_warm_up_and_a_clean_run_takes_none():
    model, opt = _model(False)
    skip = DeviceSkip(opt, DeviceSkipConfig(warmup=20))
    flat = _train(model, opt, skip, 60, spike_at=(10, 45))
    assert skip.skipped() == {"skips": 1, "nonfinite": 0, "spike": 1}  # step 10 is in the warm-up
    assert torch.equal(*flat[45]) and not torch.equal(*flat[10])
    clean_model, clean_opt = _model(False)
    clean = DeviceSkip(clean_opt)
    _train(clean_model, clean_opt, clean, 300)
    assert clean.skipped()["skips"] == 0


def test_a_lasting_change_of_level_is_taken_after_max_spike_skips():
    model, opt = _model(False)
    skip = DeviceSkip(opt, DeviceSkipConfig(warmup=10, max_spike_skips=2))
    _train(model, opt, skip, 30, spike_at=tuple(range(20, 30)))
    assert skip.skipped()["spike"] == 2  # 20, 21 skipped; 22 taken as the new level, warm-up again


def test_state_round_trips_and_bad_settings_name_the_key():
    model, opt = _model(False)
    skip = DeviceSkip(opt)
    _train(model, opt, skip, 5)
    again = DeviceSkip(opt)
    again.load_state_dict(skip.state_dict())
    assert all(torch.equal(again.state_dict()[k], skip.state_dict()[k]) for k in ("base", "run", "count"))
    bad = {**skip.state_dict(), "base": torch.full((2, 12), float("nan"))}
    with pytest.raises(ConfigError, match="device_skip.state.base"):
        again.load_state_dict(bad)
    with pytest.raises(ConfigError, match="device_skip.how"):
        DeviceSkip(opt, DeviceSkipConfig(how="found_inf"))  # not fused
    with pytest.raises(ConfigError, match="device_skip.warmup"):
        DeviceSkipConfig(warmup=0)
    with pytest.raises(ConfigError, match="device_skip.z: renamed: use loss.z_on"):
        DeviceSkipConfig.from_dict({"z": 6.0})
    assert DeviceSkipConfig.from_dict({"loss": {"min_ratio": 2.0}}).loss.min_ratio == 2.0
