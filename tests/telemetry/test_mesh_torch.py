"""A torch DeviceMesh read as a rank's parallel coordinates (a real mesh over torch's fake process
group: any rank of any world in one process)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.core.mesh import DIMS  # noqa: E402
from sdcwatch.telemetry.probes.mesh_torch import coords_from_mesh  # noqa: E402


@pytest.fixture
def mesh_of():
    """``mesh_of(rank, shape, names)``: the DeviceMesh as ``rank`` of a world of prod(shape) sees it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(rank, shape, names):
        if dist.is_initialized():
            dist.destroy_process_group()
        world = 1
        for s in shape:
            world *= s
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        return init_device_mesh("cpu", shape, mesh_dim_names=names)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def test_torchtitan_names_are_the_canonical_dims_and_every_rank_gets_its_own_coordinates(mesh_of):
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # torchtitan's world mesh, in its order
    shape = (2, 2, 2, 1, 2)
    seen = set()
    for rank in range(16):
        coords = coords_from_mesh(mesh_of(rank, shape, names))
        assert list(coords) == [d for d in DIMS if d in names]  # canonical order, whatever the mesh's
        # row-major rank layout: pp outermost, tp innermost
        assert coords == {
            "pp": rank // 8,
            "dp_replicate": rank // 4 % 2,
            "dp_shard": rank // 2 % 2,
            "cp": 0,
            "tp": rank % 2,
        }
        seen.add(tuple(coords.values()))
    assert len(seen) == 16


@pytest.mark.parametrize("sharded,dim", [(False, "dp_replicate"), (True, "dp_shard")])
def test_a_plain_dp_dim_is_replicas_under_ddp_and_shards_under_fsdp(mesh_of, sharded, dim):
    assert coords_from_mesh(mesh_of(3, (4,), ("dp",)), sharded=sharded) == {dim: 3}


def test_a_dp_dim_beside_a_shard_dim_is_the_replicas_of_hsdp(mesh_of):
    mesh = mesh_of(5, (2, 4), ("dp", "fsdp"))
    assert coords_from_mesh(mesh, sharded=True) == {"dp_replicate": 1, "dp_shard": 1}


def test_aliases_and_user_names(mesh_of):
    mesh = mesh_of(5, (2, 2, 2), ("fsdp", "model", "stage"))
    with pytest.raises(ConfigError, match=r"mesh\.model.*'model' is not a parallel dimension.*names=\{'model': 'tp'\}"):
        coords_from_mesh(mesh)
    assert coords_from_mesh(mesh, {"model": "tp", "stage": "pp"}) == {"dp_shard": 1, "tp": 0, "pp": 1}
    assert coords_from_mesh(mesh, ["dp_shard", "tensor", "pipeline"]) == {"dp_shard": 1, "tp": 0, "pp": 1}


def test_two_dims_named_alike_combine_row_major(mesh_of):
    # torchtitan's MoE meshes split dp_shard in two; the index is the flattened one
    mesh = mesh_of(6, (2, 2, 2), ("dp_shard_mod_ep", "dp_shard_in_ep", "tp"))
    names = {"dp_shard_mod_ep": "dp_shard", "dp_shard_in_ep": "dp_shard"}
    assert coords_from_mesh(mesh, names) == {"dp_shard": 3, "tp": 0}


def test_bad_names_are_clear_errors(mesh_of):
    mesh = mesh_of(0, (2, 2), ("dp_shard", "tp"))
    with pytest.raises(ConfigError, match=r"mesh\.names.*'cp' is not a dim of the mesh \(dp_shard=2, tp=2\)"):
        coords_from_mesh(mesh, {"cp": "cp"})
    with pytest.raises(ConfigError, match=r"mesh\.tp.*maps to 'heads', which is none of pp, dp_replicate"):
        coords_from_mesh(mesh, {"tp": "heads"})
    with pytest.raises(ConfigError, match=r"one canonical name per mesh dim \(2\)"):
        coords_from_mesh(mesh, ["tp"])
    with pytest.raises(ConfigError, match=r"needs a torch DeviceMesh, got dict"):
        coords_from_mesh({"tp": 2})


def test_attach_puts_the_mesh_coordinates_on_every_record(mesh_of, tmp_path):
    from sdcwatch.service.offline import read_records
    from sdcwatch.telemetry import Emitter, FileTransport, is_end_marker
    from sdcwatch.telemetry.probes.watch import attach
    from sdcwatch.testbed.model import GPT, GPTConfig

    mesh = mesh_of(3, (2, 2), ("dp", "tp"))
    emitter = Emitter(FileTransport(tmp_path / "rank3.jsonl"), run="mesh", rank=3, world=4)
    watch = attach(GPT(GPTConfig(n_layer=1)), emitter, mesh=mesh)
    assert watch.coords == {"dp_replicate": 1, "tp": 1}  # not sharded: dp holds replicas
    for step in range(2):
        watch.step(step, loss=1.0)
    watch.close()
    emitter.close()
    records = [r for r in read_records(tmp_path / "rank3.jsonl") if not is_end_marker(r)]
    assert [r.step for r in records] == [0, 1]
    assert all(r.coords == {"dp_replicate": 1, "tp": 1} for r in records)
    with pytest.raises(ConfigError, match=r"mesh\.x"):
        attach(GPT(GPTConfig(n_layer=1)), emitter, mesh=mesh_of(0, (2,), ("x",)))


def test_framework_callbacks_pass_the_mesh_to_the_probes(mesh_of, tmp_path):
    from sdcwatch.telemetry import Emitter, FileTransport
    from sdcwatch.telemetry.integrations import CallbackCore
    from sdcwatch.testbed.model import GPT, GPTConfig

    mesh = mesh_of(2, (2, 2), ("pp", "tp"))
    emitter = Emitter(FileTransport(tmp_path / "rank2.jsonl"), run="cb", rank=2, world=4)
    core = CallbackCore(emitter, mesh=mesh, attention_every=4)
    model = GPT(GPTConfig(n_layer=1))
    core.start(model, torch.optim.SGD(model.parameters(), lr=0.1), None, 2, 4)
    try:
        assert core.watch.coords == emitter.coords == {"pp": 1, "tp": 0}
        assert core.watch.config.attention_every == 4
    finally:
        core.close()
        emitter.close()
    with pytest.raises(ConfigError, match=r"probes\.mesh_size"):
        CallbackCore(emitter, mesh_size=4)  # anything else is still a probe setting, checked
