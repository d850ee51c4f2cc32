"""The report on a run recorded at the probes' default sampling, as a user's DDP job records it: the
attention panel draws the measurements (taken one step in 16), an incident's index is read in its
metric's family, an incident's status is the service's, and the rank heat map keeps healthy ranks calm.

The captures are real: four simulated data-parallel ranks of the reference GPT with the default
``ProbeConfig()`` writing JSON lines through the emitter's file transport, and the incidents come
from ``sdcwatch replay --json`` over them, as the docs tell a user to make them.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from sdcwatch.core.incident import Incident, Severity
from test_report import make_records

from sdcwatch.report import load_incidents, load_records, rank_deviation, write_report
from sdcwatch.report.deviation import Z_ALARM, Z_FLAG
from sdcwatch.report.plots import _Z_CAP, _deviation_cmap, plot_heatmap

WORLD = 4
STEPS = 96
FAULT_STEP = 44  # an unhealthy node (1% noise on every matrix product of rank 1) from here on
FIGURE = re.compile(r"<img alt='([^']*)' src='data:image/png;base64,([A-Za-z0-9+/=]+)'")
MEAN_BLUE = np.array([0x1F, 0x5F, 0xA8]) / 255  # the attention panel's mean over ranks
SUSPECT_RED = np.array([0xD6, 0x27, 0x28]) / 255  # the first suspect rank's colour


def _capture(path: Path, faults=()) -> Path:
    """Four ranks at the default sampling (attention and act_max every 16th step), with end markers."""
    torch = pytest.importorskip("torch")
    from sdcwatch.telemetry import Emitter
    from sdcwatch.telemetry.probes.config import ProbeConfig
    from sdcwatch.telemetry.wire.transports import FileTransport
    from sdcwatch.testbed.simulated import SimulatedRun

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = SimulatedRun(
            world=WORLD,
            seed=0,
            batch_size=4,
            faults=list(faults),
            probes=ProbeConfig(),
            emitter_factory=lambda rank, host: Emitter(
                FileTransport(path), run="gpt-ddp", rank=rank, world=WORLD, host=host
            ),
        )
        run.train(STEPS)
        run.close()  # each rank's end-of-run marker
    finally:
        torch.set_num_threads(threads)
    return path


@pytest.fixture(scope="module")
def clean_capture(tmp_path_factory) -> Path:
    return _capture(tmp_path_factory.mktemp("clean") / "records.jsonl")


@pytest.fixture(scope="module")
def faulted_capture(tmp_path_factory) -> tuple[Path, Path]:
    """(records, incidents): an unhealthy node on rank 1, and what ``sdcwatch replay --json`` made of it."""
    from sdcwatch.service.offline import replay_main
    from sdcwatch.testbed.faultspec import FaultSpec

    folder = tmp_path_factory.mktemp("faulted")
    fault = FaultSpec(
        kind="noise", rank=1, step=FAULT_STEP, duration=0, target="blocks.*", where="output", magnitude=0.01, seed=1
    )
    records = _capture(folder / "records.jsonl", [fault])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert replay_main([str(records), "--json"]) == 0
    incidents = folder / "incidents.jsonl"
    incidents.write_text(out.getvalue())
    return records, incidents


def _figures(page: str) -> dict[str, np.ndarray]:
    """The page's figures as RGB arrays in 0..1, by the first word of their alt text."""
    from matplotlib.image import imread

    return {alt.split()[0]: imread(io.BytesIO(base64.b64decode(b64)))[..., :3] for alt, b64 in FIGURE.findall(page)}


def _pixels_near(image: np.ndarray, colour: np.ndarray, tol: float = 0.06) -> int:
    return int((np.abs(image - colour).max(axis=-1) < tol).sum())


def _attention_caption(page: str) -> str:
    section = page[page.index("<section id='attention'>") :]
    return section[: section.index("</p>")]


def _status_cells(page: str) -> list[str]:
    """The status column of the incidents table, row by row."""
    rows = re.findall(r"<tr class='incident'.*?</tr>", page)
    return [re.sub(r"<[^>]+>", "", re.findall(r"<td[^>]*>(.*?)</td>", row)[8]) for row in rows]


# ---------------------------------------------------------------------------------------------
# sampled metrics


def test_the_attention_panel_of_a_default_sampled_run_draws_its_measurements(clean_capture, tmp_path):
    # a suspect rank: its curve is drawn too, and its unmeasured steps are not "non-finite"
    suspect = Incident("i1", "gpt-ddp", "silent_drift", Severity.WARNING, 30, 60, "rank 1 drifts", ranks=(1,))
    page = write_report(clean_capture, [suspect], tmp_path / "r.html").read_text()
    attention = _figures(page)["attention"]
    # the mean over ranks is drawn in both layers' panels (6 measurements each), not only in the legend
    assert _pixels_near(attention, MEAN_BLUE) > 600  # 52 before: the legend's line alone
    # the suspect's curve: points and the line joining them (drawn a little transparent), not a red
    # "non-finite" bar along the top of every panel from step 0 (6,000 pixels of it before)
    assert _pixels_near(attention[: attention.shape[0] // 3], SUSPECT_RED) < 400
    reddish = (attention[..., 0] > 0.75) & (attention[..., 1] < 0.55) & (attention[..., 2] < 0.55)
    assert reddish.sum() > 500
    caption = _attention_caption(page)
    assert "one in 16 here" in caption and "each point is one measurement" in caption
    data = load_records(clean_capture)
    measured_steps = data.steps[data.measured["attn_entropy"].any(axis=1)]
    assert measured_steps.tolist() == list(range(0, STEPS, 16))  # measured one step in 16, absent otherwise


# ---------------------------------------------------------------------------------------------
# an incident's index, in its family


def test_an_incident_on_a_product_does_not_frame_attention_layer_0(faulted_capture, tmp_path):
    records, incidents_file = faulted_capture
    incidents = load_incidents(incidents_file)
    # the detectors caught the unhealthy node on the per-product canary: its layer 0 is product 0
    canary = [i for i in incidents if i.metric == "gemm_canary_fp"]
    assert canary and canary[0].layer == 0 and canary[0].ranks == (1,)
    assert canary[0].first_step >= FAULT_STEP
    page = write_report(records, incidents_file, tmp_path / "r.html").read_text()
    # layer 0's panel is not titled "◀ named by an incident" in red (above the plot, left of the legend)
    title = _figures(page)["attention"]
    title = title[: title.shape[0] // 5, : title.shape[1] // 3]
    assert ((title[..., 0] > 0.75) & (title[..., 1] < 0.4) & (title[..., 2] < 0.4)).sum() == 0
    assert "framed in red when an incident names that attention layer (none here)" in _attention_caption(page)
    row = re.search(r"<tr class='incident' data-kind='[a-z_]+'>(.*?gemm_canary_fp.*?)</tr>", page).group(1)
    assert "<td>product 0 (blocks.0.attn.qkv)</td>" in row

    # an incident on an attention statistic does name its attention layer
    attn = Incident(
        "i2", "gpt-ddp", "rank_outlier", Severity.WARNING, 64, 64, "entropy", ranks=(2,), metric="attn_entropy", layer=1
    )
    page = write_report(records, [*incidents, attn], tmp_path / "r2.html").read_text()
    caption = _attention_caption(page)
    assert re.search(r"names that attention layer: layer 1 \(incident #\d+ on attn_entropy\)", caption)
    assert "layer 0" not in caption


# ---------------------------------------------------------------------------------------------
# the incident's status, as the service last said


def test_an_incident_the_service_resolved_at_the_run_end_shows_resolved(faulted_capture, tmp_path):
    records, incidents_file = faulted_capture
    replayed = load_incidents(incidents_file)
    assert replayed
    page = write_report(records, incidents_file, tmp_path / "r.html").read_text()
    # every rank sent its end-of-run marker: the service resolves the run's incidents at its last step
    # (replay stops at the end of the file with them open; the report knows the run ended)
    cells = _status_cells(page)
    assert len(cells) == len(replayed)
    assert all(re.fullmatch(rf"resolved at {STEPS - 1}( \(run end\))?", cell) for cell in cells), cells

    # before the run ended (a capture without its end markers, the incidents as last opened): open
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(line for line in records.open() if "sdcwatch.run_end" not in line))
    opened = tmp_path / "opened.jsonl"
    opened.write_text(
        "".join(
            json.dumps({"change": "opened", **i.to_dict(), "resolved_step": None, "open": True}) + "\n"
            for i in replayed
        )
    )
    page = write_report(cut, opened, tmp_path / "c.html").read_text()
    assert _status_cells(page) == ["open"] * len(replayed)


def test_the_last_event_of_an_incident_says_whether_it_is_resolved(clean_capture, tmp_path):
    """The anomalies topic (``change`` beside the incident), the log sink (``change`` around it), and
    ``sdcwatch incidents --json`` (``status``): the last line of each id is the service's last word."""
    cut = tmp_path / "live.jsonl"  # the run still live: no end markers
    cut.write_text("".join(line for line in clean_capture.open() if "sdcwatch.run_end" not in line))
    inc = Incident("gpt-ddp:nonfinite:40", "gpt-ddp", "nonfinite", Severity.CRITICAL, 40, 41, "NaN", ranks=(2,))
    still = Incident("gpt-ddp:loss_spike:70", "gpt-ddp", "loss_spike", Severity.WARNING, 70, 70, "spike")
    opened = {"change": "opened", **inc.to_dict()}
    updated = {"change": "updated", **(inc.to_dict() | {"last_step": 44})}
    resolved = {"change": "resolved", "incident": inc.to_dict() | {"last_step": 44, "open": False}}  # no step given
    lines = [opened, {"change": "opened", **still.to_dict()}, updated, resolved]
    path = tmp_path / "incidents.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    page = write_report(cut, path, tmp_path / "r.html").read_text()
    assert _status_cells(page) == ["resolved at 44", "open"]


# ---------------------------------------------------------------------------------------------
# the heat map keeps healthy ranks calm


def deviation_colours(score: np.ndarray) -> np.ndarray:
    """The RGBA colour the heat map draws each calibrated score in, +Inf at the top of the scale (as
    the map draws it: a rank's own non-finite value goes in purple on top)."""
    x = np.where(np.isinf(score), _Z_CAP, np.asarray(score, dtype=np.float64))
    return _deviation_cmap()(np.ma.masked_invalid(x / _Z_CAP))


def test_the_heat_map_of_a_clean_4_rank_capture_keeps_every_rank_calm(clean_capture):
    data = load_records(clean_capture)
    deviation = rank_deviation(data)
    score = deviation.score[np.isfinite(deviation.score)]
    assert score.size == STEPS * WORLD
    alarming = _alarming(deviation_colours(score))
    # at most 1 cell in 100 of a healthy rank drawn alarming (the plain |z| put 10-17% above 3.5)
    assert alarming.mean() < 0.01, f"{alarming.sum()} of {score.size} healthy cells drawn alarming"
    assert (score > Z_FLAG).mean() < 0.02
    # the colours the scale draws: red from Z_ALARM up, pale up to Z_FLAG
    assert _alarming(deviation_colours(np.array([Z_ALARM, 9.0, 20.0, np.inf]))).all()
    assert not _alarming(deviation_colours(np.array([0.0, 2.0, Z_FLAG]))).any()
    # the bar beside the map (share of steps at |z| > 3.5 before the scaling): no rank stands out in red
    _, _, share = plot_heatmap(data, [], [])
    assert share.max() < 3 * np.median(share)


def test_a_faulty_rank_is_still_drawn_alarming(tmp_path):
    data = load_records(make_records(tmp_path / "bad.jsonl", world=WORLD, steps=160, bad_rank=1, start=80))
    deviation = rank_deviation(data)
    alarming = _alarming(deviation_colours(np.nan_to_num(deviation.score, posinf=100.0)))
    assert alarming[80:, 1].mean() > 0.9
    assert alarming[:80, 1].mean() < 0.02  # it was healthy before the fault
    assert np.delete(alarming, 1, axis=1).mean() < 0.01


def _alarming(rgba: np.ndarray) -> np.ndarray:
    """Cells drawn red to dark red: the alarming band of the heat map's colour scale."""
    r, g, b = rgba[..., 0], rgba[..., 1], rgba[..., 2]
    return (r > 0.45) & (g < 0.35) & (b < 0.3)
