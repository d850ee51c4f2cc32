"""`sdcwatch hosts`: the listing and its JSON, the drain lines (printed, never run; a label that is
not a host name never inside a command), an operator's clear recorded once and applied once."""

from __future__ import annotations

import argparse
import json

import pytest
from sdcwatch.cli import main
from sdcwatch.hosts import drain_lines, host_line, hosts_main, parse_duration
from sdcwatch.service.host_files import (
    CARRIED_KEY,
    CLEARS_FILE,
    apply_clears,
    read_clears,
    read_hosts,
    record_clear,
    write_host_files,
)
from sdcwatch.service.hosts import HostVerdict
from sdcwatch.service.pipeline import DetectionPipeline

NOW = 1.8e9
FLEET = [
    HostVerdict("node17", "quarantine", 3.4, ("a", "b", "c"), ("checksum", "nonfinite"), 7, NOW - 7200, ("GPU-9",)),
    HostVerdict("node09", "suspect", 1.62, ("a", "d"), ("checksum",), 2, NOW - 172800, ()),
    HostVerdict("node11", "cleared", 0.0, (), (), 0, NOW - 600, (), "ops", "GPU replaced"),
    HostVerdict("node03", "clean", 0.25, ("e",), ("rank_outlier",), 1, 0.0, ()),
]


@pytest.fixture
def state(tmp_path):
    write_host_files(tmp_path, FLEET, wall=NOW, clears_through=0.0)
    return tmp_path


def test_the_files_hold_every_verdict_and_one_quarantined_host_a_line(state):
    body = read_hosts(state)
    assert body["hosts"] == [v.to_dict() for v in FLEET]
    assert (body["written"], body["clears_through"]) == (NOW, 0.0)
    assert (state / "quarantine.txt").read_text() == "node17\n"
    assert not list(state.glob("*.tmp"))


def test_a_host_line_says_verdict_score_runs_kinds_since_and_who_cleared_it():
    lines = [host_line(h.to_dict(), NOW) for h in FLEET]
    assert lines == [
        "node17               quarantine   3.40     3  checksum,nonfinite        2027-01-15 06:00:00Z (2.0h ago)",
        "node09               suspect      1.62     2  checksum                  2027-01-13 08:00:00Z (2.0d ago)",
        "node11               cleared      0.00     0  -                         2027-01-15 07:50:00Z (10m ago)"
        "  cleared by ops: GPU replaced",
        "node03               clean        0.25     1  rank_outlier              -",
    ]


def test_the_listing_prints_a_table_and_json_filtered_by_since(state, capsys, monkeypatch):
    monkeypatch.setattr("sdcwatch.hosts.time.time", lambda: NOW)
    assert hosts_main(["--state-dir", str(state)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["HOST", "VERDICT", "SCORE", "RUNS", "KINDS", "SINCE"]
    assert [line.split()[0] for line in out[1:5]] == ["node17", "node09", "node11", "node03"]
    assert out[5] == "4 hosts tracked, 2 suspect or quarantined; written 2027-01-15 08:00:00Z (0m ago)"
    assert hosts_main(["list", "--json", "--since", "1d", "--state-dir", str(state)]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [h["host"] for h in body["hosts"]] == ["node17", "node11"]  # node09's began 2 days ago; clean has none
    assert body["written"] == NOW


def test_no_hosts_file_is_an_error_naming_the_folder(tmp_path, capsys):
    assert main(["hosts", "--state-dir", str(tmp_path)]) == 2
    assert f"no {tmp_path / 'hosts.json'}" in capsys.readouterr().err


def test_drain_lines_for_slurm_and_kubernetes_are_printed_for_quarantined_hosts(state, capsys):
    assert hosts_main(["drain-commands", "--state-dir", str(state)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "# sdcwatch: 1 host(s) quarantine; printed for review, not run",
        'scontrol update nodename=node17 state=drain reason="sdcwatch: quarantine, score 3.40, 3 runs '
        '(checksum,nonfinite)"',
        "kubectl cordon node17",
        "kubectl taint nodes node17 sdcwatch=quarantine:NoSchedule",
    ]
    assert hosts_main(["drain-commands", "--suspects", "--scheduler", "kubernetes", "--state-dir", str(state)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "kubectl cordon node17",
        "kubectl taint nodes node17 sdcwatch=quarantine:NoSchedule",
        "kubectl cordon node09",
        "kubectl taint nodes node09 sdcwatch=suspect:NoSchedule",
    ]


@pytest.mark.parametrize("label", ["node1; reboot", "$(touch x)", "-h", "a b", "node`id`", 'n"1'])
def test_a_label_that_is_not_a_host_name_never_reaches_a_command(label):
    bad = {"host": label, "verdict": "quarantine", "score": 9.0, "runs": ["x"], "kinds": ['k";rm']}
    good = {"host": "node2", "verdict": "quarantine", "score": 9.0, "runs": ["x"], "kinds": ['k";$(rm)']}
    lines = drain_lines([bad, good])
    assert lines[0] == f"# skipped {label!r}: not a host name"
    assert (
        lines[1]
        == 'scontrol update nodename=node2 state=drain reason="sdcwatch: quarantine, score 9.00, 1 runs (k___(rm))"'
    )


def test_a_clear_is_recorded_then_applied_once_and_kept_with_the_state(tmp_path, capsys):
    write_host_files(tmp_path, [], wall=NOW, clears_through=0.0)
    assert hosts_main(["clear", "node0", "--reason", "GPU replaced", "--by", "ops", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "recorded: node0 cleared by ops: GPU replaced (the service's last hosts.json does not list it)" in out
    second = record_clear(tmp_path, "node1", by="ops", reason="board swap", wall=1.0)  # a clock behind the first
    (tmp_path / CLEARS_FILE).open("a").write("not json\n")
    clears, bad = read_clears(tmp_path)
    assert [c.host for c in clears] == ["node0", "node1"] and bad == 1
    assert second.wall > clears[0].wall  # after every clear recorded: the service takes each once

    clock = [NOW]
    pipe = DetectionPipeline(wall=lambda: clock[0])
    for run in ("a", "b", "c"):
        for step in (10, 20):
            pipe.hosts.credit(run=run, step=step, host="node0", kind="checksum", weight=0.6, wall=NOW)
    assert pipe.hosts.verdict("node0", NOW).verdict in ("suspect", "quarantine")
    assert apply_clears(pipe, tmp_path) == second.wall
    assert pipe.hosts.verdict("node0", NOW).verdict == "cleared"
    pipe.hosts.credit(run="d", step=5, host="node0", kind="checksum", weight=0.6, wall=NOW + 1)
    restored = DetectionPipeline(wall=lambda: clock[0])
    restored.restore(json.loads(json.dumps(pipe.snapshot())))
    assert restored.carried[CARRIED_KEY] == second.wall
    apply_clears(restored, tmp_path)  # after a restart: the evidence since the clear stays
    assert restored.hosts.verdict("node0", NOW + 1).steps == 1


@pytest.mark.parametrize("args", [["clear", "node0", "--reason", " "], ["clear", "node\n0", "--reason", "r"]])
def test_a_clear_without_a_reason_or_with_a_bad_name_is_refused(tmp_path, capsys, args):
    assert main(["hosts", *args, "--by", "ops", "--state-dir", str(tmp_path)]) == 2
    assert "clear." in capsys.readouterr().err
    assert not (tmp_path / CLEARS_FILE).exists()


def test_durations():
    assert [parse_duration(t) for t in ("90", "90s", "30m", "12h", "7d", "2w", "1.5h")] == [
        90.0,
        90.0,
        1800.0,
        43200.0,
        604800.0,
        1209600.0,
        5400.0,
    ]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("soon")
