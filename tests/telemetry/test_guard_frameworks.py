"""The guard in a Hugging Face and a Lightning ``Trainer`` through their callbacks
(``SdcwatchCallback(guard=...)``), with gradient accumulation over two micro-batches and clipping, the
frameworks' loops untouched: in report mode the parameters are bit for bit an unguarded run's; a NaN
of one step is rerun from the step's micro-batches as the transient fault it is and the run ends bit
for bit where the clean one does; a lasting NaN is repeated by the rerun and its steps are skipped;
a skipped step leaves the weights, the optimizer state and the learning-rate schedule as they were;
Hugging Face's guard judges the gradient norm before the Trainer clips it; the service's decisions
(``control=``) roll back (with the learning-rate cut in the framework's optimizer step) and evict;
and on two gloo ranks both ranks rerun the transient NaN of one and end bit for bit where the clean
run does. The tiny random Llama.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")

from test_bit_neutral import digest  # noqa: E402
from tiny_llama import (  # noqa: E402
    BATCH,
    Recorder,
    TokenDataset,
    launch,
    lightning_llama,
    lightning_trainer,
    tiny_llama,
)

STEPS, ACCUM, FAULT_STEP, LR = 8, 2, 5, 1e-2


def outcomes_of(callback) -> list:
    return (
        []
        if callback is None
        else [(o.step, o.action or o.would, o.verdict, o.applied) for o in callback.guard.actions]
    )


def optimizer_state(optimizer) -> str:
    """The digest of the optimizer's per-parameter state (Adam's moments and step counts)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return digest(t for p in params for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t))


class StepLog:
    """What a run holds after each optimizer step (parameters, optimizer state, the rate the next
    step will use, the scheduler's count), and the rate each optimizer step ran with (a post-step hook
    registered before the guard's: it sees the rate in force during the step)."""

    def __init__(self) -> None:
        self.after: list[tuple] = []
        self.rates: list[float] = []

    def watch(self, optimizer) -> None:
        optimizer.register_step_post_hook(lambda opt, *_: self.rates.append(opt.param_groups[0]["lr"]))

    def take(self, model, optimizer, scheduler) -> None:
        count = None if scheduler is None else scheduler.state_dict()["last_epoch"]
        rate = optimizer.param_groups[0]["lr"]
        self.after.append((digest(model.parameters()), optimizer_state(optimizer), rate, count))


def hf_run(out: str, guard=None, faults=(), control=None, world: int = 1, schedule: str = "linear", steps=STEPS):
    """A Trainer run; the parameters' digest at the end, the guard's outcomes, the step log and the
    norms the Trainer logged (before its clipping)."""
    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
    from sdcwatch.testbed import FaultInjector
    from transformers import Trainer, TrainerCallback, TrainingArguments

    log = StepLog()

    class Logging(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs) -> None:
            log.watch(getattr(optimizer, "optimizer", optimizer))

        def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            log.take(model, getattr(optimizer, "optimizer", optimizer), lr_scheduler)

    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type=schedule,
        max_grad_norm=0.5,
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **({"ddp_backend": "gloo"} if world > 1 else {}),
    )
    data = TokenDataset(BATCH * ACCUM * world * steps)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=data)
    callback = None
    if guard is not None:
        callback = SdcwatchCallback(Recorder(), injector=FaultInjector(list(faults)), guard=guard, control=control)
        trainer.add_callback(callback)
    trainer.add_callback(Logging())  # after the guard's callback: it sees the step as the guard left it
    try:
        trainer.train()
    finally:
        run = digest(trainer.model.parameters()), outcomes_of(callback)
        hf_run.last = (log, [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h], callback)
    return run


def lightning_run(out: str, guard=None, faults=(), control=None, world: int = 1, schedule: str = "linear", steps=STEPS):
    """A Lightning run (a per-step scheduler unless ``schedule`` is "constant"); the parameters' digest
    at the end and the guard's outcomes (the step log in ``lightning_run.last``)."""
    import lightning as L
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback
    from sdcwatch.testbed import FaultInjector

    log = StepLog()
    module = lightning_llama()

    def configure_optimizers():
        opt = torch.optim.AdamW(module.parameters(), lr=LR)
        if schedule == "constant":
            return opt
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

    module.configure_optimizers = configure_optimizers

    class Logging(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            log.watch(trainer.optimizers[0])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if (batch_idx + 1) % ACCUM == 0:
                configs = trainer.lr_scheduler_configs
                log.take(pl_module, trainer.optimizers[0], configs[0].scheduler if configs else None)

    callback = None
    if guard is not None:
        callback = SdcwatchCallback(Recorder(), injector=FaultInjector(list(faults)), guard=guard, control=control)
    settings = dict(max_steps=steps, accumulate_grad_batches=ACCUM, gradient_clip_val=0.5, default_root_dir=out)
    if world > 1:
        from lightning.pytorch.strategies import DDPStrategy

        settings.update(devices=world, strategy=DDPStrategy(process_group_backend="gloo"))
    trainer = lightning_trainer([*([] if callback is None else [callback]), Logging()], **settings)
    data = torch.utils.data.DataLoader(TokenDataset(BATCH * ACCUM * world * steps), batch_size=BATCH)
    lightning_run.last = (log, [], callback)
    trainer.fit(module, data)
    return digest(module.parameters()), outcomes_of(callback)


RUNS = {"hf": (hf_run, "model."), "lightning": (lightning_run, "model.model.")}


def needs(framework: str) -> None:
    pytest.importorskip("transformers")
    if framework == "lightning":
        pytest.importorskip("lightning")


def nan_at(prefix: str, rank: int = 0, step: int = FAULT_STEP, **more):
    from sdcwatch.testbed import FaultSpec

    return FaultSpec(kind="nan", rank=rank, step=step, target=f"{prefix}layers.1.self_attn.o_proj", **more)


class DecisionAt:
    """A control reader that hands the guard ``decision`` at step ``step`` (the guard polls once a step)."""

    def __init__(self, step: int, decision) -> None:
        self.step, self.decision, self.polls = step, decision, 0

    def poll(self) -> list:
        self.polls += 1
        return [self.decision] if self.polls == self.step + 1 else []


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_guarded_through_the_callback_a_transient_fault_is_recovered_and_a_lasting_one_skipped(framework, tmp_path):
    needs(framework)
    from sdcwatch.telemetry import GuardConfig

    run, prefix = RUNS[framework]
    clean, _ = run(str(tmp_path / "clean"))
    assert run(str(tmp_path / "report"), GuardConfig()) == (clean, [])
    act = GuardConfig(mode="act")
    transient = run(str(tmp_path / "transient"), act, [nan_at(prefix)])
    assert transient == (clean, [(FAULT_STEP, "rerun", "transient", True)])
    lasting, outcomes = run(str(tmp_path / "lasting"), act, [nan_at(prefix, duration=0)])
    assert lasting != clean
    assert outcomes[:3] == [(s, "skip", "reproducible", False) for s in range(FAULT_STEP, FAULT_STEP + 3)]


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_a_skipped_step_leaves_weights_optimizer_state_and_schedule_as_they_were(framework, tmp_path):
    needs(framework)
    from sdcwatch.telemetry import GuardConfig

    run, prefix = RUNS[framework]
    skip = GuardConfig(mode="act", on_nonfinite="skip")
    _, outcomes = run(str(tmp_path), skip, [nan_at(prefix)])
    assert outcomes == [(FAULT_STEP, "skip", "", False)]
    log = run.last[0]
    assert len(log.after) == STEPS
    counts = [entry[3] for entry in log.after]
    assert counts == [1, 2, 3, 4, 5, 5, 6, 7]  # the schedule did not advance at the skipped step
    assert len({entry[2] for entry in log.after}) == STEPS - 1  # the rate moves at every other step
    assert log.after[FAULT_STEP] == log.after[FAULT_STEP - 1]  # weights, moments, rate, count: as before
    assert len({entry[:2] for entry in log.after}) == STEPS - 1  # every applied step changed them


def test_hugging_face_guard_judges_the_gradient_norm_before_the_trainer_clips_it(tmp_path):
    needs("hf")
    from sdcwatch.telemetry import GuardConfig

    hf_run(str(tmp_path), GuardConfig())
    _, logged, callback = hf_run.last
    learnt = callback.guard.state.grad.snapshot()["buf"]  # the logarithms of the norms the guard judged
    assert len(logged) == STEPS and min(logged) > 0.5  # every step's norm is above the clipping's
    assert learnt == [math.log(x) for x in logged]  # what the Trainer logs: the norm its clipping returned


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_the_services_rollback_and_eviction_are_acted_on_in_the_framework(framework, tmp_path):
    needs(framework)
    from sdcwatch.core.control import Decision
    from sdcwatch.telemetry import GuardConfig, GuardEviction

    run = RUNS[framework][0]
    act = GuardConfig(mode="act", snapshot_every=2)
    since, at = 4, FAULT_STEP
    rollback = Decision(run="r", action="rollback", reason="replica divergence", since_step=since, lr_factor=0.5)
    _, outcomes = run(str(tmp_path / "rollback"), act, control=DecisionAt(at, rollback), schedule="constant")
    assert outcomes == [(at, "rollback", "", False)]
    log, _, callback = run.last
    assert callback.guard.actions[0].resume_from == 2  # the snapshot before step 4: taken before step 2
    assert log.after[at][:2] == log.after[1][:2]  # weights and moments as after step 1
    assert log.rates == [LR] * (at + 1) + [LR * 0.5] * (STEPS - at - 1)  # the cut in force from the next step
    assert {entry[2] for entry in log.after} == {LR}  # and never left in the optimizer

    evict = Decision(run="r", action="evict", reason="sdc suspected", ranks=(0,), since_step=1)
    with pytest.raises(GuardEviction) as raised:
        run(str(tmp_path / "evict"), act, control=DecisionAt(2, evict), schedule="constant")
    assert (raised.value.code, raised.value.step, raised.value.ranks) == (16, 2, (0,))
    assert len(run.last[0].after) == 2  # no update after the eviction's step


TWO_RANK_STEPS, TWO_RANK_FAULT = 4, 2


def _two_ranks(rank: int, framework: str, out: str) -> None:
    from sdcwatch.telemetry import GuardConfig

    run, prefix = RUNS[framework]
    runs = {
        name: run(f"{out}/{name}", guard, faults, world=2, steps=TWO_RANK_STEPS)
        for name, guard, faults in [
            ("unguarded", None, ()),
            ("report", GuardConfig(), ()),
            ("transient", GuardConfig(mode="act"), [nan_at(prefix, rank=1, step=TWO_RANK_FAULT)]),
        ]
    }
    with open(f"{out}/runs.{rank}", "w") as f:
        json.dump(runs, f)


@pytest.mark.integration
@pytest.mark.parametrize("framework", ["hf", "lightning"])
@pytest.mark.slow
def test_two_ranks_report_is_bit_neutral_and_a_transient_nan_of_one_rank_is_rerun_on_both(framework, tmp_path):
    needs(framework)
    launch(_two_ranks, framework, str(tmp_path))
    ranks = [json.loads((tmp_path / f"runs.{rank}").read_text()) for rank in range(2)]
    clean = ranks[0]["unguarded"][0]
    for rank, runs in enumerate(ranks):
        assert runs["unguarded"] == [clean, []], rank  # DDP keeps the replicas equal
        assert runs["report"] == [clean, []], rank
        assert runs["transient"] == [clean, [[TWO_RANK_FAULT, "rerun", "transient", True]]], rank
