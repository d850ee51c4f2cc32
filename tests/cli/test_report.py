"""The run report: plots and incident rows in one self-contained HTML file, clear input errors,
and a page that really renders in headless Chromium."""

from __future__ import annotations

import base64
import csv
import doctest
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from sdcwatch.core.errors import ReplayError
from sdcwatch.core.incident import Incident, Severity
from sdcwatch.core.record import to_json
from sdcwatch.core.record_type import Record

import sdcwatch.report as report
from sdcwatch.report import (
    load_incidents,
    load_records,
    rank_deviation,
    report_main,
    write_report,
)
from sdcwatch.report.deviation import global_series
from sdcwatch.report.plots import _robust_limits

REAL_LOGS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "real-logs"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IMG = re.compile(r"""<img [^>]*src=["']data:image/png;base64,([A-Za-z0-9+/=]+)["']""")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def make_records(
    path: Path,
    *,
    world: int = 8,
    steps: int = 120,
    layers: int = 3,
    bad_rank: int | None = None,
    start: int = 60,
    nan_at: tuple[int, int] | None = None,
    run: str = "run-a",
    seed: int = 0,
) -> Path:
    """A data-parallel run: ranks agree in distribution; ``bad_rank`` deviates from ``start`` on
    (larger local gradient, lower cosine, collapsed entropy in layer 1); ``nan_at`` = (step, rank)."""
    rng = np.random.default_rng(seed)
    with open(path, "a") as fh:
        for step in range(steps):
            loss0 = 2.0 + 6.0 * math.exp(-step / 40)
            losses = loss0 + rng.normal(0, 0.05, world)
            for rank in range(world):
                loss, grad, cos = float(losses[rank]), 1.0 + rng.normal(0, 0.03), 0.9 + rng.normal(0, 0.01)
                entropy = [2.4 - 0.2 * layer + rng.normal(0, 0.02) for layer in range(layers)]
                if rank == bad_rank and step >= start:
                    grad, cos, entropy[1] = grad * 1.6, cos - 0.15, entropy[1] - 1.0
                if nan_at == (step, rank):
                    loss = math.nan
                rec = Record.make(
                    run=run,
                    step=step,
                    rank=rank,
                    world=world,
                    host=f"node{rank // 4}",
                    time=1.7e9 + step,
                    scalars={
                        "loss": loss,
                        "loss_global": float(losses.mean()),
                        "grad_norm_local": grad,
                        "grad_norm_global": 1.0,
                        "grad_cosine": cos,
                        "nonfinite": float(math.isnan(loss)),
                    },
                    layers={"attn_entropy": entropy},
                )
                fh.write(to_json(rec) + "\n")
    return path


def sdc_incident(rank: int = 5, first: int = 62, last: int = 119) -> Incident:
    return Incident(
        id="inc-sdc",
        run="run-a",
        kind="sdc_suspected",
        severity=Severity.CRITICAL,
        first_step=first,
        last_step=last,
        message=f"SDC suspected on rank {rank} (host node1): grad_norm_local <off> by 60%",
        ranks=(rank,),
        hosts=("node1",),
        metric="grad_norm_local",
        layer=1,
        score=11.5,
        peak_step=80,
    )


def images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in IMG.findall(page)]


# ---------------------------------------------------------------------------------------------
# content


def test_clean_run_report_holds_every_plot_and_says_nothing_happened(tmp_path):
    records = make_records(tmp_path / "clean.jsonl")
    out = write_report(records, [], tmp_path / "out" / "report.html")  # an empty incidents file
    page = out.read_text()
    pngs = images(page)
    assert len(pngs) == 3  # training curves, rank heat map, attention entropy
    assert all(p.startswith(PNG_MAGIC) and len(p) > 5_000 for p in pngs)
    assert "verdict clean" in page and "No incidents were raised for this run." in page
    assert "<tr class='incident'" not in page
    assert "<script" not in page and "http" not in page.split("</header>")[1]  # self-contained, offline


def test_without_incidents_the_page_says_they_were_not_given_rather_than_calling_the_run_clean(tmp_path):
    records = make_records(tmp_path / "nan.jsonl", nan_at=(40, 2))
    page = write_report(records, None, tmp_path / "r.html").read_text()
    assert "verdict info" in page and "No incidents were given" in page
    assert "sdcwatch replay --json RECORDS &gt; incidents.jsonl" in page
    assert "No incidents were raised" not in page and "verdict clean" not in page
    assert "<div class='k'>incidents</div><div class='v'>not given</div>" in page


def test_incidents_become_table_rows_and_the_verdict_names_the_rank(tmp_path):
    records = make_records(tmp_path / "bad.jsonl", bad_rank=5)
    spike = sdc_incident().to_dict() | {
        "id": "inc-spike",
        "kind": "loss_spike",
        "severity": "warning",
        "ranks": [],
        "hosts": [],
        "layer": None,
        "step": 90,
        "first_step": 90,
        "last_step": 91,
        "message": "loss spike, ranks consistent",
    }
    page = write_report(
        records,
        [sdc_incident(), spike],
        tmp_path / "r.html",
        injected={"kind": "noise", "rank": 5, "step": 60, "duration": 0, "target": "blocks.1.attn", "magnitude": 0.01},
    ).read_text()
    rows = re.findall(r"<tr class='incident' data-kind='([a-z_]+)'>(.*?)</tr>", page)
    assert [kind for kind, _ in rows] == ["sdc_suspected", "loss_spike"]
    sdc_row = rows[0][1]
    assert "62–119" in sdc_row and "(peak 80)" in sdc_row and ">5<" in sdc_row and "node1" in sdc_row
    assert "&lt;off&gt;" in sdc_row  # messages are escaped, never injected as markup
    assert "verdict critical" in page and "rank 5 (host node1)" in page
    # the suspect card names ranks (a lone "5" would read as a count)
    assert "<div class='k'>suspect ranks</div><div class='v'>rank 5 <small>node1</small></div>" in page
    assert "noise on rank 5 from step 60" in page  # what was injected, in the header
    assert len(images(page)) == 3


def test_an_injected_fault_without_incidents_is_called_a_missed_detection(tmp_path):
    records = make_records(tmp_path / "run.jsonl", steps=30)
    fault = {"kind": "bitflip", "rank": 2, "step": 10, "duration": 1, "target": "blocks.1.attn.qkv", "bit": 30}
    page = write_report(records, [], tmp_path / "r.html", injected=[fault]).read_text()
    assert "verdict warning" in page and "missed detection" in page
    assert "bitflip on rank 2 from step 10 for 1 step" in page
    clean = write_report(records, [], tmp_path / "c.html", injected="nothing (clean run)").read_text()
    assert "verdict clean" in clean and "nothing (clean run)" in clean


def test_deviating_rank_stands_out_in_the_deviation_score(tmp_path):
    data = load_records(make_records(tmp_path / "bad.jsonl", world=16, bad_rank=11, start=40))
    score, used, widespread, _ = rank_deviation(data)
    assert not widespread.any()
    assert used == ["loss", "grad_norm_local", "grad_cosine"]
    assert score.shape == (120, 16)
    flagged = (score[40:] > 3.5).mean(axis=0)
    assert int(np.argmax(flagged)) == 11
    assert flagged[11] > 0.9
    assert np.delete(flagged, 11).max() < 0.3
    before = (score[:40] > 3.5).mean(axis=0)
    assert before[11] < 0.3  # the rank was healthy before the fault


def test_a_nan_a_rank_reported_is_maximal_deviation_and_a_missing_record_is_not(tmp_path):
    path = make_records(tmp_path / "nan.jsonl", nan_at=(30, 3))
    lines = path.read_text().splitlines()
    dropped = [line for line in lines if json.loads(line)["step"] == 50 and json.loads(line)["rank"] == 6]
    path.write_text("\n".join(line for line in lines if line not in dropped) + "\n")
    data = load_records(path)
    assert data.missing == 1 and not data.present[50, 6]
    score = rank_deviation(data).score
    assert np.isinf(score[30, 3])
    assert np.isnan(score[50, 6])
    assert np.isfinite(np.delete(score[30], 3)).all()
    page = write_report(path, None, tmp_path / "r.html").read_text()
    assert len(images(page)) == 3 and "1 missing" in page


def test_a_small_world_has_no_heat_map_and_says_why(tmp_path):
    page = write_report(make_records(tmp_path / "two.jsonl", world=2), None, tmp_path / "r.html").read_text()
    assert len(images(page)) == 2
    assert "comparing ranks needs at least 3" in page


def test_run_selection_when_a_file_holds_several_runs(tmp_path):
    path = make_records(tmp_path / "multi.jsonl", steps=40, run="big")
    make_records(path, steps=10, world=4, run="small")
    assert load_records(path).run == "big"
    small = load_records(path, run="small")
    assert (small.run, small.world, len(small.steps), small.other_runs) == ("small", 4, 10, {"big": 320})
    page = write_report(path, [sdc_incident()], tmp_path / "r.html", run="small").read_text()
    assert "also holds other runs" in page
    assert "<tr class='incident'" not in page  # the incident belongs to run-a, not to this run
    with pytest.raises(ReplayError, match="no records of run 'nope'"):
        load_records(path, run="nope")


def test_load_incidents_keeps_the_last_state_of_each_incident(tmp_path):
    inc = sdc_incident()
    opened = {"change": "opened", "incident": inc.to_dict() | {"last_step": 62}}
    resolved = inc.to_dict() | {"resolved_step": 140, "open": False}
    other = inc.to_dict() | {"id": "inc-2", "first_step": 10, "step": 10, "severity": "info"}
    path = tmp_path / "incidents.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (opened, other, resolved)) + "\n\n")
    loaded = load_incidents(path)
    assert [i.id for i in loaded] == ["inc-2", "inc-sdc"]
    assert loaded[1].resolved_step == 140 and loaded[1].last_step == 119 and not loaded[1].open
    assert loaded[1].severity is Severity.CRITICAL and loaded[1].ranks == (5,)
    assert Incident.from_dict(inc.to_dict()).to_dict() == inc.to_dict()


# ---------------------------------------------------------------------------------------------
# errors name the file and the line


def test_malformed_record_lines_name_file_and_line(tmp_path):
    path = make_records(tmp_path / "r.jsonl", steps=2, world=3)
    lines = path.read_text().splitlines()
    bad_json = tmp_path / "bad_json.jsonl"
    bad_json.write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n")
    with pytest.raises(ReplayError) as err:
        load_records(bad_json)
    assert (err.value.path, err.value.line) == (str(bad_json), 3)
    assert str(err.value).startswith(f"{bad_json}:3: ") and "not valid JSON" in str(err.value)

    bad_field = tmp_path / "bad_field.jsonl"
    bad_rank = json.loads(lines[1]) | {"rank": 7}
    bad_field.write_text("\n".join([lines[0], json.dumps(bad_rank)] + lines[2:]) + "\n")
    with pytest.raises(ReplayError, match=r"bad_field\.jsonl:2: .*'rank'.*out of range"):
        load_records(bad_field)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ReplayError, match=r"empty\.jsonl: holds no records"):
        write_report(empty, None, tmp_path / "x.html")
    with pytest.raises(ReplayError, match=r"absent\.jsonl: cannot read records"):
        load_records(tmp_path / "absent.jsonl")
    assert not (tmp_path / "x.html").exists()


@pytest.mark.parametrize(
    "line, problem",
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"kind": "x", "severity": "fatal", "message": "m", "step": 1}', "'severity': 'fatal' is not one of"),
        ('{"kind": "x", "severity": "info", "step": 1}', "'message' is missing"),
        ('{"kind": "x", "severity": "info", "message": "m", "step": "one"}', "'first_step' must be an integer"),
        ('{"kind": "x", "severity": "info", "message": "m", "step": 1, "ranks": ["5"]}', "'ranks' must be a list"),
        ("{oops", "not valid JSON"),
    ],
)
def test_malformed_incident_lines_name_file_and_line(tmp_path, line, problem):
    path = tmp_path / "incidents.jsonl"
    path.write_text(json.dumps(sdc_incident().to_dict()) + "\n" + line + "\n")
    with pytest.raises(ReplayError) as err:
        load_incidents(path)
    assert err.value.line == 2 and str(err.value).startswith(f"{path}:2: ")
    assert problem in str(err.value)


def test_report_command(tmp_path, capsys):
    records = make_records(tmp_path / "run.jsonl", bad_rank=2)
    incidents = tmp_path / "incidents.jsonl"
    incidents.write_text(json.dumps(sdc_incident(rank=2).to_dict()) + "\n")
    out = tmp_path / "sub" / "report.html"
    assert (
        report_main(
            [
                str(records),
                "--incidents",
                str(incidents),
                "-o",
                str(out),
                "--title",
                "Nightly run",
                "--injected",
                "bitflip on rank 2",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert "<title>Nightly run</title>" in page and "bitflip on rank 2" in page
    assert page.count("<tr class='incident'") == 1

    faults = tmp_path / "faults.jsonl"
    faults.write_text(
        '{"kind": "noise", "rank": 2, "step": 60, "duration": 0, "target": "blocks.*", "magnitude": 0.01}\n'
    )
    assert report_main([str(records), "-o", str(out), "--injected", str(faults)]) == 0
    capsys.readouterr()
    assert "noise on rank 2 from step 60 (target blocks.*, where output, magnitude 0.01)" in out.read_text()
    faults.write_text('{"kind": "noise", "step": -1}\n')
    assert report_main([str(records), "-o", str(out), "--injected", str(faults)]) == 1
    assert f"{faults}:1" in capsys.readouterr().err

    incidents.write_text("{}\n")
    assert report_main([str(records), "--incidents", str(incidents), "-o", str(out)]) == 1
    assert f"{incidents}:1: incident field 'kind' is missing" in capsys.readouterr().err


def test_docstring_examples():
    assert doctest.testmod(report, verbose=False).failed == 0


# ---------------------------------------------------------------------------------------------
# real training logs


def _real_log(name: str) -> list[dict[str, str]]:
    path = REAL_LOGS / name
    if not path.exists():
        pytest.skip(f"real logs not found at {REAL_LOGS}: they ship beside the repo in CI")
    with open(path) as fh:
        return list(csv.DictReader(fh))


def _records_from_log(rows: list[dict[str, str]], path: Path) -> Path:
    with open(path, "w") as fh:
        for row in rows:
            scalars = {"loss": float(row["loss"])}
            if row.get("grad_norm"):
                scalars["grad_norm_global"] = scalars["grad_norm_local"] = float(row["grad_norm"])
            fh.write(to_json(Record.make(run="real", step=int(row["step"]), rank=0, world=1, scalars=scalars)) + "\n")
    return path


def test_real_benign_spike_stays_on_scale_and_is_marked(tmp_path):
    # modded-nanogpt speedrun: a one-step data-caused spike at step 947 (5.28 after about 3.7).
    rows = _real_log("modded_nanogpt_muon_124m.csv")
    data = load_records(_records_from_log(rows, tmp_path / "muon.jsonl"))
    assert len(data.steps) == len(rows)
    ((label, loss, _),) = global_series(data)
    lo, hi = _robust_limits(loss)
    assert hi >= float(loss[data.steps == 947][0]) > 5.0  # a real spike is drawn, not clipped off
    spike = {
        "id": "s",
        "run": "real",
        "kind": "loss_spike",
        "severity": "warning",
        "step": 947,
        "first_step": 947,
        "last_step": 947,
        "message": "loss spike, one series: cannot name a rank",
    }
    page = write_report(tmp_path / "muon.jsonl", [spike], tmp_path / "r.html").read_text()
    assert len(images(page)) == 1 and "comparing ranks needs at least 3" in page
    assert page.count("<tr class='incident'") == 1


def test_real_run_that_is_nan_from_the_first_step_still_renders(tmp_path):
    rows = _real_log("llmc_gpt2_124m_nan.csv")[:2000]
    data = load_records(_records_from_log(rows, tmp_path / "nan.jsonl"))
    assert np.isnan(data.scalars["loss"]).all() and data.missing == 0
    page = write_report(tmp_path / "nan.jsonl", None, tmp_path / "r.html").read_text()
    assert len(images(page)) == 1


# ---------------------------------------------------------------------------------------------
# it renders in a real browser


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    if CHROMIUM is None:
        pytest.skip("chromium not installed (Debian packages chromium and chromium-driver)")
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=True)


def test_report_renders_in_headless_chromium(tmp_path):
    records = make_records(tmp_path / "run.jsonl", bad_rank=5)
    out = write_report(records, [sdc_incident()], tmp_path / "report.html")
    dom = _chromium("--dump-dom", out.as_uri(), profile=tmp_path / "profile").stdout
    assert len(IMG.findall(dom)) == 3
    assert dom.count('<tr class="incident"') + dom.count("<tr class='incident'") == 1
    assert "sdc_suspected" in dom and 'id="incidents"' in dom

    shot = tmp_path / "shot.png"
    _chromium(f"--screenshot={shot}", "--window-size=1280,2200", out.as_uri(), profile=tmp_path / "profile")
    from matplotlib.image import imread

    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (2200, 1280)
    colours = np.unique((pixels.reshape(-1, 3) * 255).astype(np.uint8), axis=0)
    assert len(colours) > 500  # plots, not a blank or error page
    # The heat map's dark red band (the deviating rank) is on screen: the images were drawn.
    dark_red = (pixels[..., 0] > 0.4) & (pixels[..., 1] < 0.1) & (pixels[..., 2] < 0.1)
    assert dark_red.sum() > 2_000


def test_guard_actions_get_their_own_section(tmp_path):
    records = make_records(tmp_path / "bad.jsonl", bad_rank=5)
    skip = sdc_incident().to_dict() | {
        "id": "inc-guard",
        "kind": "guard_skip",
        "severity": "warning",
        "ranks": [5],
        "step": 70,
        "first_step": 70,
        "last_step": 72,
        "layer": None,
        "message": "guard skipped the update of step 72 on every rank, <b>",
    }
    page = write_report(records, [sdc_incident(), skip], tmp_path / "r.html").read_text()
    section = page[page.index("<section id='guard'>") :]
    assert "step 70-72: <b>skip</b>" in section and "step 72 on every rank, &lt;b&gt;" in section
    clean = write_report(records, [sdc_incident()], tmp_path / "c.html").read_text()
    assert "<section id='guard'>" not in clean


def test_the_help_says_which_commands_write_the_files_it_reads():
    """A user with only the CLI learns from --help where the records and the incidents come from."""
    text = " ".join(report.build_parser().format_help().split())  # argparse wraps the lines
    assert "sdcwatch capture" in text and "sdcwatch replay RECORDS.jsonl --json" in text
    assert "to_dict" not in text
