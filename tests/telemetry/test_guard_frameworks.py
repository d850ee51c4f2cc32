"""The guard in a Hugging Face and a Lightning ``Trainer`` through their callbacks
(``SdcwatchCallback(guard=...)``), with gradient accumulation over two micro-batches and clipping, the
frameworks' loops untouched: in report mode the parameters are bit for bit an unguarded run's; a NaN
of one step is rerun from the step's micro-batches as the transient fault it is and the run ends bit
for bit where the clean one does; a lasting NaN is repeated by the rerun and its steps are skipped.
The tiny random Llama, one process.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_bit_neutral import digest  # noqa: E402
from tiny_llama import BATCH, Recorder, TokenDataset, lightning_llama, lightning_trainer, tiny_llama  # noqa: E402

STEPS, ACCUM, FAULT_STEP = 8, 2, 5


def outcomes_of(callback) -> list:
    return (
        []
        if callback is None
        else [(o.step, o.action or o.would, o.verdict, o.applied) for o in callback.guard.actions]
    )


def hf_run(out: str, guard=None, faults=()) -> tuple[str, list]:
    """A Trainer run; the parameters' digest at the end and the guard's outcomes."""
    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
    from sdcwatch.testbed import FaultInjector
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(BATCH * ACCUM * STEPS))
    callback = None
    if guard is not None:
        callback = SdcwatchCallback(Recorder(), injector=FaultInjector(list(faults)), guard=guard)
        trainer.add_callback(callback)
    trainer.train()
    return digest(trainer.model.parameters()), outcomes_of(callback)


def lightning_run(out: str, guard=None, faults=()) -> tuple[str, list]:
    """A Lightning run; the parameters' digest at the end and the guard's outcomes."""
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback
    from sdcwatch.testbed import FaultInjector

    callback = None
    if guard is not None:
        callback = SdcwatchCallback(Recorder(), injector=FaultInjector(list(faults)), guard=guard)
    settings = dict(max_steps=STEPS, accumulate_grad_batches=ACCUM, gradient_clip_val=0.5, default_root_dir=out)
    trainer = lightning_trainer([] if callback is None else [callback], **settings)
    module = lightning_llama()
    data = torch.utils.data.DataLoader(TokenDataset(BATCH * ACCUM * STEPS), batch_size=BATCH)
    trainer.fit(module, data)
    return digest(module.parameters()), outcomes_of(callback)


RUNS = {"hf": (hf_run, "model."), "lightning": (lightning_run, "model.model.")}


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_guarded_through_the_callback_a_transient_fault_is_recovered_and_a_lasting_one_skipped(framework, tmp_path):
    pytest.importorskip("transformers")
    if framework == "lightning":
        pytest.importorskip("lightning")
    from sdcwatch.telemetry import GuardConfig
    from sdcwatch.testbed import FaultSpec

    run, prefix = RUNS[framework]
    nan = dict(kind="nan", rank=0, step=FAULT_STEP, target=f"{prefix}layers.1.self_attn.o_proj")
    clean, _ = run(str(tmp_path / "clean"))
    assert run(str(tmp_path / "report"), GuardConfig()) == (clean, [])
    act = GuardConfig(mode="act")
    transient = run(str(tmp_path / "transient"), act, [FaultSpec(**nan)])
    assert transient == (clean, [(FAULT_STEP, "rerun", "transient", True)])
    lasting, outcomes = run(str(tmp_path / "lasting"), act, [FaultSpec(**nan, duration=0)])
    assert lasting != clean
    assert outcomes[:3] == [(s, "skip", "reproducible", False) for s in range(FAULT_STEP, FAULT_STEP + 3)]
