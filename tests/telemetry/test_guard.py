"""The guard on the simulated ranks (one process, every rank): what each action does to the model."""

from __future__ import annotations

import logging
import math
import threading

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.control import Decision, decode_decision  # noqa: E402
from sdcwatch.core.errors import ConfigError, ControlError  # noqa: E402
from sdcwatch.telemetry.guard.config import EXIT_CODE_EVICT, GuardConfig, GuardEviction  # noqa: E402
from sdcwatch.telemetry.guard.control_topic import KafkaControl, MemoryControl  # noqa: E402
from guard_sim import TIGHT, flat, sim  # noqa: E402
from polling import wait_for  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_default_config_only_reports():
    with sim(
        [{"kind": "nan", "rank": 1, "step": 25, "target": "blocks.0.attn.scores", "seed": 3}], guard=GuardConfig()
    ) as run:
        run.train(27)
        act = run.guard.actions[0]
        assert (act.step, act.action, act.would, act.ranks) == (25, "none", "rerun", (1,))
        assert [a.step for a in run.guard.actions] == [25, 26]  # the NaN went on, and is reported on
        assert "report mode" in act.message
        assert run.skipped == [] and run.guard.reruns == 0
        assert not torch.isfinite(flat(run)).all()  # nothing was done: the NaN reached the weights


def test_transient_nan_is_rerun_and_the_run_equals_the_clean_one_bit_for_bit():
    with (
        sim([{"kind": "nan", "rank": 1, "step": 25, "target": "blocks.0.attn.scores", "seed": 3}]) as faulted,
        sim() as clean,
    ):
        faulted.train(30)
        clean.train(30)
        (act,) = faulted.guard.actions
        assert (act.step, act.action, act.reason, act.verdict, act.ranks, act.applied) == (
            25,
            "rerun",
            "nonfinite",
            "transient",
            (1,),
            True,
        )
        assert act.telemetry() == {"guard_action": 2.0, "guard_reason": 1.0, "guard_verdict": 1.0, "guard_rank": 1.0}
        assert clean.guard.actions == []
        assert torch.equal(flat(faulted), flat(clean))


def test_bad_data_on_one_rank_is_recomputed_elsewhere_and_skipped_not_blamed():
    # early in training the loss still falls fast (a wide baseline) and random bytes are not yet twice
    # the median: a tighter spike rule than the default
    cfg = GuardConfig(mode="act", **TIGHT)
    with sim([{"kind": "bad_batch", "rank": 2, "step": 70, "seed": 1}], world=3, guard=cfg) as run:
        run.train(70)
        before = flat(run)
        run.train(1)
        (act,) = run.guard.actions
        assert (act.step, act.action, act.verdict, act.ranks, act.applied) == (70, "skip", "data", (2,), False)
        assert torch.equal(flat(run), before)  # the update was skipped on every replica
        assert run.guard.reruns == 2  # in place, then on rank 0
        run.train(2)
        assert len(run.guard.actions) == 1


def test_persistent_fault_on_one_rank_evicts_it_with_the_documented_code_and_its_host(caplog):
    fault = {"kind": "scale", "rank": 1, "step": 40, "duration": 0, "target": "head", "magnitude": 30.0, "seed": 0}
    with sim([fault], hosts=["alpha", "beta", "gamma", "delta"]) as run:
        run.train(40)
        with caplog.at_level(logging.ERROR, "sdcwatch.guard"), pytest.raises(GuardEviction) as info:
            run.train(1)
    exc = info.value
    assert exc.code == EXIT_CODE_EVICT == 16
    assert (exc.step, exc.ranks, exc.hosts) == (40, (1,), ("beta",))
    assert "rank 1 (host beta)" in str(exc) and "code 16" in str(exc)
    assert run.guard.actions[-1].verdict == "persistent" and run.guard.actions[-1].action == "evict"
    assert "rank 1 (host beta)" in caplog.text


def test_skip_budget_is_bounded_then_updates_go_through():
    cfg = GuardConfig(mode="act", on_nonfinite="skip", max_skips=1, budget_window=100)
    faults = [{"kind": "nan", "rank": 0, "step": s, "target": "blocks.1.attn.scores", "seed": 0} for s in (22, 24)]
    with sim(faults, guard=cfg) as run:
        run.train(25)
        first, second = run.guard.actions
        assert (first.step, first.action, first.applied) == (22, "skip", False)
        assert (second.step, second.action, second.would, second.applied) == (24, "none", "skip", True)
        assert "budget" in second.message
        assert run.skipped == [22]


def test_rollback_decision_restores_the_snapshot_cuts_the_lr_and_is_bounded():
    control = MemoryControl()
    cfg = GuardConfig(mode="act", snapshot_every=5, lr_cut_steps=3, max_rollbacks=1)
    with sim(guard=cfg, control=control) as run:
        run.train(20)
        at20 = flat(run)  # the snapshot before step 20 holds exactly this
        run.train(3)
        control.put(
            Decision(run="r", action="rollback", reason="replica divergence", ranks=(2,), since_step=21, lr_factor=0.25)
        )
        lr = [g["lr"] for g in run.optimizer.param_groups]
        run.train(1)  # step 23
        act = run.guard.actions[-1]
        assert (act.step, act.action, act.reason, act.ranks, act.resume_from, act.lr_factor) == (
            23,
            "rollback",
            "control",
            (2,),
            20,
            0.25,
        )
        assert torch.equal(flat(run), at20)
        assert run.data_pos == 20 and run.step == 24  # the data of steps 20-23 is replayed at steps 24-27
        assert run.guard.steps_rolled_back == 4
        seen = []
        run.optimizer.step, real = (
            lambda *a, **k: (seen.append(run.optimizer.param_groups[0]["lr"]), real())[1],
            run.optimizer.step,
        )
        run.train(4)
        assert seen == pytest.approx([lr[0] * 0.25] * 3 + [lr[0]])  # cut for lr_cut_steps, then restored
        assert [g["lr"] for g in run.optimizer.param_groups] == lr
        # the second rollback in the window is past the budget: it names a rank, so that rank is evicted
        control.put(Decision(run="r", action="rollback", reason="again", ranks=(2,), since_step=26))
        with pytest.raises(GuardEviction) as info:
            run.train(1)
        assert info.value.ranks == (2,) and "budget" in str(info.value)


def test_clean_run_takes_no_action():
    with sim(world=4) as run:
        run.train(80)
        assert run.guard.actions == [] and run.skipped == [] and run.guard.reruns == 0
        assert all(math.isfinite(x) for x in run.history)


def test_guard_state_travels_with_the_checkpoint(tmp_path):
    with sim() as run:
        run.train(25)
        run.save_checkpoint(tmp_path / "c.pt")
        state = run.guard.state_dict()
    with sim() as again:
        again.load_checkpoint(tmp_path / "c.pt")
        assert again.guard.state_dict() == state
        # 25 clean losses per rank: the window of 9 filled, then 16 learnt past it
        assert len(state["loss"]) == 4 and len(state["loss"][0]["buf"]) == 9 and state["loss"][0]["n"] == 16


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="guard.mode"):
        GuardConfig(mode="yes")
    with pytest.raises(ConfigError, match="guard.on_spike"):
        GuardConfig(on_spike="evict")
    with pytest.raises(ConfigError, match="guard.lr_factor"):
        GuardConfig(lr_factor=2.0)
    with pytest.raises(ConfigError, match="guard.snapshot_evry"):
        GuardConfig.from_dict({"snapshot_evry": 5})
    assert GuardConfig.from_dict({"mode": "act", "max_skips": 5}).max_skips == 5


def test_decisions_round_trip_and_malformed_ones_name_the_field():
    d = Decision(run="r", action="evict", reason="silent drift", ranks=(5,), hosts=("h2",), since_step=40)
    assert decode_decision(d.encode()) == d
    for bad, key in (
        (b"not json", "message"),
        (b"[1]", "message"),
        (b'{"run": "r"}', "action"),
        (b'{"run": "r", "action": "reboot"}', "action"),
        (b'{"run": "r", "action": "evict"}', "ranks"),
        (b'{"run": "r", "action": "skip", "lr_factor": 3}', "lr_factor"),
        (b'{"run": "r", "action": "skip", "colour": 1}', "colour"),
        (b'{"run": "r", "action": "rollback", "since_step": -1}', "since_step"),
    ):
        with pytest.raises(ControlError) as info:
            decode_decision(bad)
        assert info.value.key == key


def test_unreachable_control_bus_never_blocks_and_leaves_the_local_checks(caplog, monkeypatch):
    import sdcwatch.telemetry.guard.control_topic as control_topic

    connecting = []  # the threads that reach for the bus: never the training loop's
    consumer = control_topic.new_consumer

    def new_consumer(*args, **kwargs):
        connecting.append(threading.current_thread())
        return consumer(*args, **kwargs)

    monkeypatch.setattr(control_topic, "new_consumer", new_consumer)
    with caplog.at_level(logging.WARNING, "sdcwatch.telemetry.guard.control_topic"):
        reader = KafkaControl("127.0.0.1:1", run="r")
        assert reader.poll() == []
        with sim(
            [{"kind": "nan", "rank": 1, "step": 22, "target": "blocks.0.attn.scores", "seed": 3}], control=reader
        ) as run:
            run.train(23)
            assert [a.action for a in run.guard.actions] == ["rerun"]
        wait_for(lambda: connecting, 30, "the reader to reach for the bus")
        reader.close()
    assert threading.current_thread() not in connecting


def test_a_finite_flip_a_checksum_sees_is_rerun_like_a_non_finite_value():
    # one exponent bit of one element of an MLP product's output: finite, and well above the
    # checksum's rounding bound; the guard reruns the step and takes the clean result
    from sdcwatch.telemetry.probes.config import ProbeConfig

    probes = ProbeConfig(checksum_every=1)
    flip = {"kind": "bitflip", "rank": 1, "step": 25, "target": "blocks.0.mlp.fc", "bit": 27, "seed": 3}
    with sim([flip], probes=probes) as faulted, sim(probes=probes) as clean:
        faulted.train(30)
        clean.train(30)
        assert math.isfinite(faulted.history[25])
        (act,) = faulted.guard.actions
        assert (act.step, act.action, act.reason, act.verdict, act.ranks, act.applied) == (
            25,
            "rerun",
            "checksum",
            "transient",
            (1,),
            True,
        )
        assert act.telemetry()["guard_reason"] == 4.0  # the wire code of "checksum"
        assert clean.guard.actions == []  # correct products never pass their bound
        assert torch.equal(flat(faulted), flat(clean))


def test_on_checksum_is_checked():
    with pytest.raises(ConfigError, match="guard.on_checksum"):
        GuardConfig(on_checksum="evict")


def test_the_guard_takes_its_place_from_the_environment_it_is_given():
    from sdcwatch.telemetry.guard import Guard, GuardPlace
    from sdcwatch.telemetry.wire.environment import RankEnvironment

    env = RankEnvironment.read({"RANK": "3", "WORLD_SIZE": "8", "SDCWATCH_HOST": "h3"})
    model = torch.nn.Linear(2, 2)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), place=GuardPlace(environment=env))
    assert (guard.place.rank, guard.place.world, guard.place.host) == (3, 8, "h3")
    assert guard.place.local_ranks == (3,) and guard.state.loss[0].window == GuardConfig().window


def test_given_the_ddp_wrapper_the_guard_keeps_and_restores_the_module_itself(tmp_path):
    import torch.distributed as dist
    from sdcwatch.telemetry import Guard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 2)
        ddp = DistributedDataParallel(model)
        guard = Guard(ddp, torch.optim.SGD(model.parameters(), lr=0.1), GuardConfig(mode="act"))
        assert guard.model is model
        before = {k: v.clone() for k, v in model.state_dict().items()}

        def compute() -> torch.Tensor:
            loss = ddp(torch.ones(3, 4)).sum()
            loss.backward()
            return loss.detach()

        assert guard.step(0, compute).applied
        assert not torch.equal(model.weight, before["weight"])
        assert set(guard.snapshots.before(None).model) == {"weight", "bias"}  # the module's keys, as its checkpoint's
        assert guard.restore() == 0
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    finally:
        dist.destroy_process_group()
