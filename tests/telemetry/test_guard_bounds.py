"""The guard's bounds and escapes, its spike mitigation, and a resume from a checkpoint mid-incident."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.telemetry.guard.config import GuardConfig, GuardEviction  # noqa: E402
from sdcwatch.telemetry.probes.config import ProbeConfig  # noqa: E402
from guard_sim import TIGHT, flat, sim  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_reruns_that_keep_finding_a_fault_are_bounded_then_skipped_then_the_rank_evicted():
    # a NaN on rank 1 at every step from 22, gone on each rerun: Megatron's endless-rerun case
    cfg = GuardConfig(mode="act", max_reruns=2, max_skips=1, budget_window=100)
    nans = [{"kind": "nan", "rank": 1, "step": s, "target": "blocks.0.attn.scores", "seed": 3} for s in range(22, 40)]
    with sim(nans, guard=cfg) as run:
        run.train(22)
        with pytest.raises(GuardEviction) as info:
            run.train(10)
    acts = [(a.step, a.action, a.verdict) for a in run.guard.actions]
    assert acts == [(22, "rerun", "transient"), (23, "rerun", "transient"), (24, "skip", ""), (25, "evict", "")]
    assert info.value.ranks == (1,) and "rerun budget spent" in str(info.value) and "skip budget" in str(info.value)
    assert run.guard.reruns == 2


def test_a_checksum_mismatch_that_repeats_on_the_rerun_is_persistent_and_evicts():
    probes = ProbeConfig(checksum_every=1)
    fault = {"kind": "scale", "rank": 1, "step": 25, "duration": 0, "target": "blocks.0.mlp.fc", "magnitude": 3.0}
    with sim([fault], probes=probes, hosts=["a", "b", "c", "d"]) as run:
        run.guard.peer = None  # no rank can recompute another's micro-batch: the checksums judge alone
        run.train(25)
        with pytest.raises(GuardEviction) as info:
            run.train(1)
    act = run.guard.actions[-1]
    assert (act.step, act.action, act.reason, act.verdict) == (25, "evict", "checksum", "persistent")
    assert info.value.ranks == (1,) and info.value.hosts == ("b",)


def _lrs(run, steps):
    seen = []
    real = run.optimizer.step
    run.optimizer.step = lambda *a, **k: (seen.append(run.optimizer.param_groups[0]["lr"]), real(*a, **k))[1]
    try:
        run.train(steps)
    finally:
        run.optimizer.step = real
    return seen


MITIGATE = GuardConfig(mode="act", **TIGHT, spike_mitigation="lr+clip", mitigation_steps=3, max_mitigations=1)
BAD = [{"kind": "bad_batch", "step": s, "seed": 1} for s in (70, 80)]  # every rank: the data, not a rank


def test_a_spike_is_mitigated_with_a_bounded_reversible_lr_cut():
    with sim(BAD, guard=MITIGATE, world=3) as run:
        run.train(70)
        lr = run.optimizer.param_groups[0]["lr"]
        seen = _lrs(run, 15)  # steps 70-84: 70 skipped, 71-72 cut, then restored; 80 past the budget
        first, second = [a for a in run.guard.actions if a.reason == "spike"]
        assert (first.step, first.action, first.mitigation, first.lr_factor) == (70, "skip", "lr+clip", 0.5)
        assert "mitigated" in first.message and first.to_dict()["mitigation"] == "lr+clip"
        assert (second.step, second.action, second.mitigation) == (80, "skip", "")
        assert "mitigation budget spent" in second.message
        assert seen == pytest.approx([lr * 0.5] * 2 + [lr] * 11)
        assert [g["lr"] for g in run.optimizer.param_groups] == [lr] * len(run.optimizer.param_groups)


def test_a_job_restarted_mid_mitigation_resumes_exactly_like_the_uninterrupted_one(tmp_path):
    cfg = GuardConfig(mode="act", **TIGHT, spike_mitigation="lr+clip", mitigation_steps=6, max_mitigations=1)
    bad = [{"kind": "bad_batch", "step": 70, "seed": 1}]
    with sim(bad, guard=cfg, world=3) as whole:
        whole.train(72)  # the mitigation runs steps 70-75
        whole.save_checkpoint(tmp_path / "mid.pt")
        saved = whole.guard.state_dict()
        whole.train(8)
        end = flat(whole)
    assert saved["mitigation"] == ["lr+clip", 0.5, 75] and saved["mitigations"] == [70]
    with sim(bad, guard=cfg, world=3) as resumed:
        resumed.load_checkpoint(tmp_path / "mid.pt")
        assert resumed.step == 72 and resumed.guard.state_dict() == saved
        resumed.train(8)
        assert torch.equal(flat(resumed), end)  # no cut lost, none doubled, no rerun state carried
    # a state from steps the job will run again is not carried
    with sim(guard=cfg, world=3) as older:
        older.guard.load_state_dict(saved, resume_step=70)
        state = older.guard.state_dict()
        assert state["mitigation"] == ["none", 1.0, -1] and state["mitigations"] == [] and state["skips"] == []


def test_a_malformed_guard_state_is_refused_naming_the_key():
    with sim(world=2) as run:
        run.train(3)
        good = run.guard.state_dict()
        for key, bad in (("lr_scale", 3.0), ("skips", ["x"]), ("grad", [float("nan")]), ("version", 9)):
            with pytest.raises(ConfigError, match=f"guard.state.{key}"):
                run.guard.load_state_dict({**good, key: bad})
        with pytest.raises(ConfigError, match="guard.state.lr_until"):
            run.guard.load_state_dict({k: v for k, v in good.items() if k != "lr_until"})
        assert run.guard.state_dict() == good  # nothing changed by a refused state
        # the layouts before the shared spike rule (raw clean values, versions 1 and 2) were never released
        old = {k: good[k] for k in ("skips", "rollbacks", "lr_scale", "lr_until")}
        with pytest.raises(ConfigError, match="guard.state.version"):
            run.guard.load_state_dict({**old, "loss": [[2.0]] * 2, "local_grad": [], "grad": [1.0]})


def test_new_settings_are_checked():
    with pytest.raises(ConfigError, match="guard.spike_mitigation"):
        GuardConfig(spike_mitigation="qk-norm")
    with pytest.raises(ConfigError, match="guard.mitigation_lr_factor"):
        GuardConfig(mitigation_lr_factor=0)
    with pytest.raises(ConfigError, match="guard.max_reruns"):
        GuardConfig(max_reruns=-1)
