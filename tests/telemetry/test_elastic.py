"""Elastic eviction: the guard's ``on_evict = "leave"`` makes the evicted rank's replica group leave
the quorum at a step boundary while the others go on (torchft replica groups over gloo; the
simulated ranks' membership)."""

from __future__ import annotations

import pytest
from sdcwatch.core.errors import ConfigError
from sdcwatch.telemetry.guard.config import GuardConfig, GuardPlace


def test_leave_is_a_setting_that_needs_a_membership():
    torch = pytest.importorskip("torch")
    from sdcwatch.telemetry.guard import Guard

    assert GuardConfig().on_evict == "exit"  # the shipped default still restarts through the launcher
    with pytest.raises(ConfigError, match="guard.on_evict"):
        GuardConfig(on_evict="drop")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="elastic"):
        Guard(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            GuardConfig(on_evict="leave"),
            place=GuardPlace(distributed=False),
        )


def test_a_simulated_replica_leaves_and_the_others_average_without_it():
    pytest.importorskip("torch")
    from sdcwatch.core.control import Decision
    from sdcwatch.testbed.model import GPTConfig
    from sdcwatch.testbed.simulated import SimulatedRun

    class Once:
        def __init__(self):
            self.sent = False

        def poll(self):
            if self.sent:
                return []
            self.sent = True
            return [Decision(run="r", action="evict", reason="test", ranks=(1,))]

    small = GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16)
    run = SimulatedRun(world=3, model=small, batch_size=2, guard=GuardConfig(mode="act", on_evict="leave"))
    run.guard.control = Once()
    run.train(3)
    (act,) = run.guard.actions
    assert (act.step, act.action, act.ranks, act.applied) == (0, "leave", (1,), True)
    assert run.left == {1: 0} and run.step == 3 and len(run.history) == 3
    assert act.telemetry()["guard_action"] == 5.0  # the new code, after evict's 4
    run.close()


@pytest.mark.integration
@pytest.mark.slow
def test_torchft_replica_group_leaves_and_the_survivors_lose_no_step():
    pytest.importorskip("torch")
    pytest.importorskip("torchft", reason="torchft (the elastic engine) is not installed")
    from sdcwatch.testbed.elastic import ElasticSettings, run_elastic

    s = ElasticSettings(replicas=3, steps=14, fault_rank=2, fault_step=4, decide_at=7, eval_batches=2)
    reports = run_elastic(s)["replicas"]
    gone, *rest = [r for r in reports if r["replica"] == 2] + [r for r in reports if r["replica"] != 2]
    assert gone["left_at"] == 7 and gone["steps_run"] == 8  # it left at the boundary after the decision's step
    assert [a["action"] for a in gone["actions"]] == ["leave"]
    for r in rest:
        assert r["left_at"] is None and r["steps_run"] == 14 and all(r["commits"])  # no step lost
        assert r["quorum"][:8] == [3] * 8 and r["quorum"][8:] == [2] * 6  # the next step ran without it
        assert [(a["step"], a["action"], a["ranks"]) for a in r["actions"]] == [(7, "leave", [2])]
    assert rest[0]["param_sha256"] == rest[1]["param_sha256"]  # the survivors' replicas agree
