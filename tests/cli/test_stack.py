"""``sdcwatch stack export DIR``: the monitoring stack of the package written out, its next commands
printed and runnable (promtool and amtool pass on the written files), a folder in use refused unless
--force. From a wheel install: tests/cli/test_wheel.py."""

from __future__ import annotations

import shutil

import pytest
from stack_checks import DASHBOARDS, exported, next_commands, repo_stack_files, run_next_commands

from sdcwatch.cli import main
from sdcwatch.stack import describe, stack_files


def test_export_writes_the_stack_and_says_what_and_what_next(tmp_path, capsys):
    dest = tmp_path / "stack"
    assert main(["stack", "export", str(dest)]) == 0
    out = capsys.readouterr().out
    files = exported(dest)
    assert files == repo_stack_files()
    for must in ("sdcwatch.json", "prometheus.yml", "alertmanager.yml", "rules/sdcwatch.rules.yml"):
        assert must in files
    assert any(p.startswith("provisioning/datasources/") for p in files)
    assert any(p.startswith("provisioning/dashboards/") for p in files)
    lines = out.splitlines()
    assert lines[0] == f"sdcwatch stack: wrote {len(files)} files to {dest}"
    for rel in files:  # each file on a line of its own, with what it is
        assert any(ln.split()[:1] == [rel] and describe(rel) and ln.endswith(describe(rel)) for ln in lines)
    steps = next_commands(out)
    assert f"promtool check config {dest / 'prometheus.yml'}" in steps
    assert f"promtool check rules {dest / 'rules/sdcwatch.rules.yml'}" in steps
    assert f"promtool test rules {dest / 'rules/sdcwatch.rules.test.yml'}" in steps
    assert f"amtool check-config {dest / 'alertmanager.yml'}" in steps
    assert any(s.startswith("Grafana: ") and s.endswith(str(dest / "sdcwatch.json")) for s in steps)


def test_a_folder_in_use_is_refused_unless_forced(tmp_path, capsys):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    (dest / "prometheus.yml").write_text("my own\n")
    assert main(["stack", "export", str(dest)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"sdcwatch stack: error: DIR: {dest} is not empty: name a new or empty folder, or pass --force to overwrite"
    ]
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt", "prometheus.yml"]
    assert (dest / "prometheus.yml").read_text() == "my own\n"

    assert main(["stack", "export", str(dest), "--force"]) == 0
    assert (dest / "prometheus.yml").read_bytes() == (DASHBOARDS / "prometheus.yml").read_bytes()
    assert (dest / "notes.txt").read_text() == "mine"  # the folder's other files are left alone

    (tmp_path / "a-file").write_text("x")
    assert main(["stack", "export", str(tmp_path / "a-file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_the_package_data_leaves_out_the_generator_and_caches():
    names = [rel for rel, _ in stack_files()]
    assert names == sorted(repo_stack_files())
    assert not [n for n in names if n.endswith(".py") or "__pycache__" in n]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_the_printed_checks_pass_on_the_written_files(tmp_path, capsys):
    dest = tmp_path / "with space"  # the printed commands quote their paths
    assert main(["stack", "export", str(dest)]) == 0
    ran = run_next_commands(capsys.readouterr().out)
    assert {"promtool check config", "promtool check rules", "promtool test rules"} <= set(ran)
    if shutil.which("amtool"):
        assert "amtool check-config" in ran
