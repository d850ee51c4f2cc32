"""Offline replay: the real training logs beside the repository, JSON-lines records, bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from detector_synth import Fault, SyntheticRun
from sdcwatch.core.errors import ReplayError
from sdcwatch.core.record import to_json
from sdcwatch.service import replay
from sdcwatch.service.offline import format_table, replay_main

REAL_LOGS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "real-logs"


@pytest.fixture(scope="module")
def logs() -> Path:
    if not REAL_LOGS.is_dir():
        pytest.skip(f"real logs not found at {REAL_LOGS}: they ship beside the repo in CI")
    return REAL_LOGS


def alerting(incidents):
    return [i for i in incidents if i.severity.value in ("warning", "critical")]


def test_pythia_clean_run_raises_no_alert(logs):
    # how fast the 143k rows replay is bench/bench_ingest.py's
    incidents = replay(logs / "pythia160m_seed5_clean.csv")
    assert alerting(incidents) == []


def test_llmc_ok_grad_norm_spikes_are_gradient_spikes_not_loss_spikes(logs):
    incidents = replay(logs / "llmc_gpt2_124m_ok.csv")
    kinds = {i.kind for i in incidents}
    assert "loss_spike" not in kinds
    assert kinds == {"grad_spike"}
    spikes = [i for i in incidents if i.kind == "grad_spike"]

    def covered(step):
        return any(i.first_step <= step <= i.last_step for i in spikes)

    for step in (1017, 10822, 10868, 10950, 10959):
        assert covered(step), f"gradient spike at step {step} not reported"
    assert all(i.severity.value == "warning" for i in spikes)
    assert len(spikes) <= 8  # one incident per burst, not one per step


def test_llmc_nan_run_is_one_nonfinite_incident_at_the_first_step(logs):
    incidents = replay(logs / "llmc_gpt2_124m_nan.csv")
    (inc,) = incidents
    assert (inc.kind, inc.severity.value, inc.first_step) == ("nonfinite", "critical", 1)
    assert inc.ranks == ()


def test_modded_nanogpt_loss_spike_at_step_947(logs):
    incidents = replay(logs / "modded_nanogpt_muon_124m.csv")
    spikes = [i for i in incidents if i.kind == "loss_spike"]
    (at947,) = [i for i in spikes if i.first_step == 947]
    assert at947.evidence["peak_value"] == pytest.approx(5.2839)
    assert "5.284 vs baseline 3." in at947.message
    assert at947.ranks == ()
    assert {i.kind for i in incidents} == {"loss_spike"}
    assert len(spikes) <= 8  # the documented real jumps, not the micro-batch noise


def test_replay_main_json_has_the_promised_fields(logs, capsys):
    code = replay_main([str(logs / "modded_nanogpt_muon_124m.csv"), "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and lines
    for line in lines:
        d = json.loads(line)
        assert {"kind", "severity", "step", "last_step", "ranks", "metric", "message"} <= set(d)
        assert isinstance(d["ranks"], list)
    assert any(json.loads(line)["step"] == 947 for line in lines)


def test_replay_main_table(logs, capsys):
    replay_main([str(logs / "llmc_gpt2_124m_nan.csv")])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["SEVERITY", "KIND", "STEPS"]
    assert "nonfinite" in out and "1-16255" in out


def test_jsonl_records_replay_names_the_faulty_rank(tmp_path):
    path = tmp_path / "run.jsonl"
    synth = SyntheticRun(seed=2, faults=[Fault("nonfinite", 90, rank=6, layer=1)])
    with open(path, "w") as fh:
        for s in range(120):
            for r in synth.records(s):
                fh.write(to_json(r) + "\n")
    (inc,) = replay(path)
    assert (inc.kind, inc.first_step, inc.ranks, inc.hosts, inc.layer) == ("nonfinite", 90, (6,), ("node1",), 1)


@pytest.mark.parametrize(
    "content, line, problem",
    [
        ("step,loss\n1,2.0\n2,abc\n", 3, "'loss': 'abc' is not a number"),
        ("step,loss\n1,2.0\n2,2.1,7\n", 3, "3 fields"),
        ("step,value\n1,2.0\n", 1, "'step' and 'loss'"),
        ("step,loss\n2,2.0\n1,2.1\n", 3, "does not increase"),
        ("step,loss\nx,2.0\n", 2, "not a step number"),
        ("", 0, "empty file"),
    ],
)
def test_malformed_csv_names_line_and_problem(tmp_path, content, line, problem):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ReplayError) as exc:
        replay(path)
    assert exc.value.line == line and problem in str(exc.value)


def test_malformed_jsonl_names_the_line(tmp_path):
    rec = SyntheticRun(world=2).records(0)
    path = tmp_path / "bad.jsonl"
    path.write_text(to_json(rec[0]) + "\n" + '{"v": 1, "run": "x"}\n')
    with pytest.raises(ReplayError) as exc:
        replay(path)
    assert exc.value.line == 2 and "step" in str(exc.value)


def test_missing_file_and_exit_code(tmp_path, capsys):
    assert replay_main([str(tmp_path / "nope.csv")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_format_table_without_incidents():
    assert format_table([]) == "no incidents"


def test_a_jsonl_file_with_a_bad_first_line_is_a_bad_record_not_a_csv_header(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("garbage\n")
    with pytest.raises(ReplayError) as exc:
        replay(path)
    assert exc.value.line == 1 and "not valid JSON" in str(exc.value) and "header" not in str(exc.value)


def test_a_replay_of_several_runs_lists_its_incidents_in_the_same_order_whatever_the_hash_seed(tmp_path):
    """Before: the runs a poll touched were a set, so the runs' frames (and the incidents of a
    replay of several runs) came in the order of the string hash, which changes from one process to
    the next. They come in the order the runs' records came."""
    import os
    import subprocess
    import sys

    runs = [
        SyntheticRun(world=8, run=f"r{i}", seed=i, faults=[Fault("nonfinite", 30 + 7 * i, rank=i + 1)])
        for i in range(3)
    ]
    path = tmp_path / "three-runs.jsonl"
    path.write_text("".join(to_json(rec) + "\n" for step in range(60) for run in runs for rec in run.records(step)))
    listed = set()
    for seed in ("1", "2", "3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-m", "sdcwatch.cli", "replay", str(path), "--json"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=tmp_path,
        ).stdout
        listed.add(tuple((d["run"], d["first_step"], tuple(d["ranks"])) for d in map(json.loads, out.splitlines())))
    assert listed == {(("r0", 30, (1,)), ("r1", 37, (2,)), ("r2", 44, (3,)))}
