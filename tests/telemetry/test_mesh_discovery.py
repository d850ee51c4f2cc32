"""The framework callbacks find the job's device mesh themselves when the user passed none:
Lightning's ``ModelParallelStrategy`` (a real 2-process FSDP2 + tensor-parallel run on gloo) and
accelerate's ``ParallelismConfig`` mesh (which accelerate builds only for GPU or FSDP2/DeepSpeed
runs: its real mesh over torch's fake process group, the lookup on a Trainer-shaped object)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from sdcwatch.telemetry.integrations import CallbackCore, FrameworkMesh  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402


class _Records:
    """An emitter that keeps what it is given (the coordinates included)."""

    def __init__(self):
        self.records, self.coords = [], {}

    def emit(self, step, **kw):
        self.records.append((step, kw))

    def set_coords(self, coords):
        self.coords = dict(coords)


@pytest.fixture
def fake_world():
    """``fake_world(rank, world)``: this process as ``rank`` of a fake process group of ``world``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(rank, world):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def _start(core: CallbackCore, found: FrameworkMesh | None) -> None:
    model = GPT(GPTConfig(n_layer=1))
    core.start(model, torch.optim.SGD(model.parameters(), lr=0.1), None, 0, 1, found)


@pytest.mark.parametrize("rank", [1, 2])
def test_accelerate_parallelism_config_mesh_is_found_and_logged(fake_world, rank, caplog):
    pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate.parallelism_config")
    from sdcwatch.telemetry.integrations.hf import framework_mesh

    fake_world(rank, 4)
    mesh = accelerate.ParallelismConfig(dp_shard_size=2, tp_size=2).build_device_mesh("cpu")
    trainer = SimpleNamespace(accelerator=SimpleNamespace(torch_device_mesh=mesh))  # what the Trainer holds
    found = framework_mesh(trainer, GPT(GPTConfig(n_layer=1)))
    assert found is not None and found.where == "trainer.accelerator.torch_device_mesh"
    emitter = _Records()
    core = CallbackCore(emitter)
    with caplog.at_level(logging.INFO, logger="sdcwatch.telemetry"):
        _start(core, found)
    try:
        want = {"dp_shard": rank // 2, "tp": rank % 2}
        assert core.watch.coords == emitter.coords == want
        assert core.mesh_found is found
        line = f"at trainer.accelerator.torch_device_mesh: dims (dp_shard=2, tp=2); this rank is at dp_shard={rank // 2},tp={rank % 2}"
        assert any(line in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        core.close()


def test_a_model_loaded_with_a_distributed_config_gives_its_mesh(fake_world):
    pytest.importorskip("transformers")
    from sdcwatch.telemetry.integrations.hf import framework_mesh
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(5, 8)
    model = GPT(GPTConfig(n_layer=1))
    model._device_mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "fsdp", "tp"))  # transformers' dims
    found = framework_mesh(SimpleNamespace(accelerator=SimpleNamespace(torch_device_mesh=None)), model)
    core = CallbackCore(_Records())
    _start(core, found)
    try:
        assert core.watch.coords == {"pp": 1, "dp_shard": 0, "tp": 1}
    finally:
        core.close()
    assert framework_mesh(None, GPT(GPTConfig(n_layer=1))) is None  # no Trainer, no mesh: none


def test_the_users_mesh_wins_mesh_false_turns_discovery_off_and_an_unreadable_mesh_is_a_warning(fake_world, caplog):
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(3, 4)
    framework = FrameworkMesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp")), None, "somewhere")
    own = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    for mesh, want in ((own, {"dp_replicate": 3}), (False, {})):
        core = CallbackCore(_Records(), mesh=mesh)
        _start(core, framework)
        assert core.watch.coords == want and core.mesh_found is None
        core.close()
    odd = FrameworkMesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "heads")), None, "the strategy")
    core = CallbackCore(_Records())
    with caplog.at_level(logging.WARNING, logger="sdcwatch.telemetry"):
        _start(core, odd)  # training goes on, without coordinates
    assert core.watch.coords == {} and core.mesh_found is None
    core.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("the strategy (dp_shard=2, heads=2) but cannot read it" in m and "'heads'" in m for m in warned), warned
    core = CallbackCore(_Records(), mesh_names={"heads": "tp"})  # ... and mesh_names says what the dim is
    _start(core, odd)
    assert core.watch.coords == {"dp_shard": 1, "tp": 1}
    core.close()


def lightning_rank(rank: int, out: str) -> None:
    """A LightningModule whose ``configure_model`` applies tensor parallelism then FSDP2 on the
    strategy's mesh; the callback is given no mesh."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from sdcwatch.telemetry import Emitter, FileTransport
    from sdcwatch.telemetry.integrations.lightning import SdcwatchCallback
    from sdcwatch.testbed.fsdp_tp import parallelize, tp_gpt
    from sdcwatch.testbed.model import next_byte_loss
    from tiny_llama import lightning_trainer

    class LitTP(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = tp_gpt()

        def configure_model(self):
            parallelize(self.model, self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return next_byte_loss(self.model(batch[:, :-1]), batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    emitter = Emitter(FileTransport(f"{out}/rank{rank}.jsonl"), run="lit-tp", rank=rank, world=2)
    callback = SdcwatchCallback(emitter)
    tp = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    trainer = lightning_trainer([callback], devices=2, strategy=tp, max_steps=2, default_root_dir=out)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (GPTConfig().seq_len + 1,), generator=g) for _ in range(8)]
    trainer.fit(LitTP(), torch.utils.data.DataLoader(data, batch_size=4))
    emitter.close(timeout=30.0)
    assert callback.mesh_found is not None, "the strategy's mesh was not found"
    assert callback.mesh_found.where == "trainer.strategy.device_mesh (ModelParallelStrategy)"


@pytest.mark.integration
@pytest.mark.slow
def test_lightning_model_parallel_strategy_mesh_puts_coordinates_on_every_record(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    from sdcwatch.service.offline import read_records
    from sdcwatch.telemetry import is_end_marker
    from tiny_llama import launch

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "sdcwatch-test")  # Lightning: the ranks are launched already
    launch(lightning_rank, str(tmp_path), world=2)
    for rank in range(2):
        records = [r for r in read_records(tmp_path / f"rank{rank}.jsonl") if not is_end_marker(r)]
        assert [r.step for r in records] == [0, 1]
        # data_parallel holds FSDP2 shards here (configure_model shards on it): dp_shard; tensor_parallel: tp
        assert all(r.coords == {"dp_shard": 0, "tp": rank} for r in records), [r.coords for r in records]
        assert all(len(r.layers["attn_logit_max"]) == 2 for r in records)
        # a data-parallel mesh of one: no reduction, the gradient of the rank's piece is local and global
        for r in records:
            s = r.scalars
            assert math.isfinite(s["grad_norm_local"]) and s["grad_norm_local"] > 0, s
            assert s["grad_norm_global"] == s["grad_norm_local"] and s["grad_cosine"] == 1.0, s


def test_a_decision_reader_without_a_guard_is_refused_not_ignored():
    from sdcwatch.core.errors import ConfigError

    with pytest.raises(ConfigError, match="callback.control.*needs guard="):
        CallbackCore(_Records(), control=object())
