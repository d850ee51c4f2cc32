"""The multi-process reference runs' command lines: the DDP, FSDP2/HSDP and FSDP2 + tensor-parallel
drivers build a run's settings from the options they share the same way, and each adds its own.
``launch`` is replaced by a recorder: no process is started."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from sdcwatch.core.errors import ConfigError  # noqa: E402
from sdcwatch.testbed import ddp, fsdp_run, fsdp_tp  # noqa: E402
from sdcwatch.testbed.faultspec import load_faults  # noqa: E402

FAULT = '{"kind": "nan", "rank": 1, "step": 3, "target": "blocks.0.attn.scores", "seed": 1}\n'
DRIVERS = [
    pytest.param(
        ddp,
        ddp.DDPSettings,
        ["--skip-nonfinite", "--guard", '{"mode": "act"}', "--save", "end.pt"],
        dict(skip_nonfinite=True, guard={"mode": "act"}, save="end.pt"),
        id="ddp",
    ),
    pytest.param(fsdp_run, fsdp_run.FSDPSettings, ["--replicate", "2"], dict(replicate=2), id="fsdp"),
    pytest.param(fsdp_tp, fsdp_tp.FSDPTPSettings, ["--tp", "2"], dict(tp=2), id="fsdp_tp"),
]


def _launched(module, monkeypatch, argv: list[str]) -> list:
    launched: list = []
    monkeypatch.setattr(module, "launch", launched.append)
    assert module.main(argv) == 0
    return launched


@pytest.mark.parametrize("module, settings, own_argv, own", DRIVERS)
def test_every_driver_builds_its_settings_from_the_shared_options_and_its_own(
    tmp_path, monkeypatch, module, settings, own_argv, own
):
    faults = tmp_path / "faults.jsonl"
    faults.write_text(FAULT)
    argv = ["--world", "4", "--steps", "3", "--seed", "7", "--run", "r1", "--topic", "t", "--jsonl", str(tmp_path)]
    argv += ["--faults", str(faults), "--ranks-per-host", "2", "--probes", '{"checksum_every": 1}', *own_argv]
    shared = dict(world=4, steps=3, seed=7, run="r1", topic="t", jsonl_dir=str(tmp_path), ranks_per_host=2)
    shared.update(faults=tuple(load_faults(str(faults))), probes={"checksum_every": 1})
    assert _launched(module, monkeypatch, argv) == [settings(**shared, **own)]


@pytest.mark.parametrize("module, settings, own_argv, own", DRIVERS)
def test_every_driver_defaults_to_its_own_run_name_and_names_itself_in_a_bad_option(
    tmp_path, monkeypatch, module, settings, own_argv, own
):
    run, key = {
        ddp: ("ddp-reference", "ddp"),
        fsdp_run: ("fsdp-reference", "fsdp"),
        fsdp_tp: ("fsdp-tp-reference", "fsdp_tp"),
    }[module]
    assert _launched(module, monkeypatch, ["--jsonl", str(tmp_path)]) == [settings(jsonl_dir=str(tmp_path), run=run)]
    with pytest.raises(ConfigError, match=f"{key}.probes"):
        module.main(["--jsonl", str(tmp_path), "--probes", "{checksum_every: 1}"])


@pytest.mark.parametrize(
    "settings, dim, driver", [(fsdp_run.FSDPSettings, "replicate", "fsdp"), (fsdp_tp.FSDPTPSettings, "tp", "fsdp_tp")]
)
def test_a_sharded_run_takes_a_divisor_of_the_world_and_neither_a_guard_nor_checkpoints(settings, dim, driver):
    assert settings(world=4, jsonl_dir="out", **{dim: 2}).mesh_shape == (2, 2)
    for bad in (3, 0, True, "2"):
        with pytest.raises(ConfigError, match=rf"{driver}\.{dim}.*positive divisor of world 4, got {bad!r}"):
            settings(world=4, jsonl_dir="out", **{dim: bad})
    for key, value in (("guard", {"mode": "act"}), ("load", "a.pt"), ("save", "b.pt")):
        with pytest.raises(ConfigError, match=rf"{driver}\.{key}.*is not supported .*\(use the DDP one\)"):
            settings(world=4, jsonl_dir="out", **{key: value})
