"""One spike rule in three places: the service's spike detector, the guard (host floats) and the device
skip (device tensors) call the same steps of a series spikes, with the same settings' names."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.core.spike_baseline import RobustBaseline, SeriesSettings  # noqa: E402
from sdcwatch.detectors import SpikeDetector, StepFrame  # noqa: E402
from sdcwatch.telemetry.guard import DeviceSkip, DeviceSkipConfig, GuardConfig, GuardState  # noqa: E402
from sdcwatch.telemetry.guard.checks import StepJudge, StepValues  # noqa: E402

RULE = SeriesSettings(z_on=6.0, min_ratio=1.5)
SPIKES = (60, 61, 95)


def _loss() -> np.ndarray:
    """A noisy loss falling slowly (a trend the baseline follows), with spikes of 2x and 4x."""
    rng = np.random.default_rng(3)
    loss = 4.0 * np.exp(-np.arange(140) / 400 + rng.normal(0, 0.02, 140))
    loss[[60, 61]] *= 4.0
    loss[95] *= 2.0
    return loss


def _host(loss: np.ndarray) -> list[int]:
    """The rule itself on host floats, learning only what it accepts (as the guard and the device skip do)."""
    b, out = RobustBaseline(9, 20), []
    for step, v in enumerate(loss):
        if RULE.spikes(*b.score(v)[:2]):
            out.append(step)
        else:
            b.update(v)
    return out


def test_the_detector_the_guard_and_the_device_skip_call_the_same_steps_spikes():
    loss = _loss()
    assert _host(loss) == list(SPIKES)
    # the service's detector: a spike opens at 60 (61 is its peak, not a new onset) and at 95
    det = SpikeDetector(loss=RULE, window=9, warmup=20)
    found = [f for s, v in enumerate(loss) for f in det.update(StepFrame.single("r", s, ("loss",), np.array([v])))]
    assert [f.step for f in found if f.evidence["phase"] == "onset"] == [60, 95]
    assert {f.step for f in found if f.evidence["phase"] == "ongoing"} >= {61}
    # the guard's deciding part
    cfg = GuardConfig(loss=RULE, window=9, warmup=20)
    judge = StepJudge(cfg, (0,), GuardState.new(cfg, 1))
    guard = []
    for step, v in enumerate(loss):
        values = StepValues(np.array([v]), 1.0, None)
        if judge.judge(values)[0]:
            guard.append(step)
        else:
            judge.learn(values)
    assert guard == list(SPIKES)
    # the device skip, on tensors (the gradient norm flat: never a spike)
    param = torch.zeros(1, requires_grad=True)
    skip = DeviceSkip(torch.optim.SGD([param], lr=0.1), DeviceSkipConfig(loss=RULE, window=9, warmup=20))
    device = [s for s, v in enumerate(loss) if int(skip.judge(torch.tensor(1.0), loss=torch.tensor(v))[1]) == 2]
    assert device == list(SPIKES)


def test_the_earlier_names_are_refused_naming_the_new_ones():
    with pytest.raises(ConfigError, match=r"guard.spike_rel: renamed: use loss.min_ratio \(= 1 \+ spike_rel\)"):
        GuardConfig.from_dict({"spike_rel": 1.0})
    with pytest.raises(ConfigError, match="device_skip.grad_rel: renamed: use grad_norm.min_ratio"):
        DeviceSkipConfig.from_dict({"grad_rel": 2.0})
    cfg = GuardConfig.from_dict({"loss": {"z_on": 4.0, "min_ratio": 1.5}, "window": 5})
    assert cfg.loss == SeriesSettings(z_on=4.0, min_ratio=1.5) and cfg.window == 5
    with pytest.raises(ConfigError, match="guard.loss.z_of"):
        GuardConfig.from_dict({"loss": {"z_of": 1.0}})
