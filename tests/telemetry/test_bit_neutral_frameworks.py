"""The Hugging Face and Lightning callbacks never change the training: a Trainer run with the
callback, clipping on, holds after every step bit for bit the parameters of the same run without
it, and two runs with it hold each other's; on one rank and on two gloo ranks (DDP, where the
callback installs the probes' communication hook). The tiny random Llama: nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from test_bit_neutral import digest, first_difference  # noqa: E402
from tiny_llama import BATCH, Recorder, TokenDataset, launch, lightning_llama, lightning_trainer, tiny_llama  # noqa: E402

STEPS = 5
CLIP = 0.05  # below every step's gradient norm: the frameworks' clipping scales every update
TWINS = ("unwatched", "watched", "watched-again")


def hf_run(how: str, out: str, world: int) -> list[str]:
    """``STEPS`` steps of a ``transformers.Trainer``; the parameters' digest after each."""
    from sdcwatch.telemetry.integrations.hf import SdcwatchCallback
    from transformers import Trainer, TrainerCallback, TrainingArguments

    digests: list[str] = []

    class Digests(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
            digests.append(digest(model.parameters()))

    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-2,
        max_grad_norm=CLIP,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **({"ddp_backend": "gloo"} if world > 1 else {}),
    )
    callbacks = [Digests()] + ([] if how == "unwatched" else [SdcwatchCallback(Recorder())])
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(BATCH * world * STEPS))
    for callback in callbacks:
        trainer.add_callback(callback)
    trainer.train()
    if how != "unwatched":
        assert callbacks[1].data_parallel == (world > 1)  # the probes found the Trainer's DDP wrapper
    return digests


def lightning_run(how: str, out: str, world: int) -> list[str]:
    """``STEPS`` steps of a ``lightning.Trainer``; the parameters' digest after each."""
    import lightning as L
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback

    digests: list[str] = []

    class Digests(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            digests.append(digest(pl_module.parameters()))

    watch = [] if how == "unwatched" else [SdcwatchCallback(Recorder())]
    settings = dict(max_steps=STEPS, gradient_clip_val=CLIP, default_root_dir=out)
    if world > 1:
        from lightning.pytorch.strategies import DDPStrategy

        settings.update(devices=world, strategy=DDPStrategy(process_group_backend="gloo"))
    trainer = lightning_trainer([Digests(), *watch], **settings)
    trainer.fit(lightning_llama(), torch.utils.data.DataLoader(TokenDataset(BATCH * world * STEPS), batch_size=BATCH))
    if watch:
        assert watch[0].data_parallel == (world > 1)  # the probes found the strategy's DDP wrapper
    return digests


RUNS = {"hf": hf_run, "lightning": lightning_run}


def twins(framework: str, out: str, world: int = 1) -> dict[str, list[str]]:
    run = RUNS[framework]
    return {name: run(name.removesuffix("-again"), f"{out}/{name}", world) for name in TWINS}


def _rank(rank: int, framework: str, out: str) -> None:
    runs = twins(framework, out, world=2)
    with open(f"{out}/digests.{rank}", "w") as f:
        json.dump(runs, f)


def _check(runs: dict[str, list[str]], where: str) -> None:
    assert len(set(runs["unwatched"])) == STEPS, where  # the parameters move at every step
    assert first_difference(runs) == "", f"{where}: {first_difference(runs)}"


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_one_rank_with_the_callback_is_bit_identical_to_without(framework, tmp_path):
    pytest.importorskip("transformers")
    if framework == "lightning":
        pytest.importorskip("lightning")
    _check(twins(framework, str(tmp_path)), framework)


@pytest.mark.integration
@pytest.mark.parametrize("framework", ["hf", "lightning"])
@pytest.mark.slow
def test_two_ranks_with_the_callback_are_bit_identical_to_without(framework, tmp_path):
    pytest.importorskip("transformers")
    if framework == "lightning":
        pytest.importorskip("lightning")
    launch(_rank, framework, str(tmp_path))
    ranks = [json.loads((tmp_path / f"digests.{rank}").read_text()) for rank in range(2)]
    assert ranks[0]["unwatched"] == ranks[1]["unwatched"]  # DDP keeps the replicas equal
    for rank, runs in enumerate(ranks):
        _check(runs, f"{framework}, rank {rank}")
