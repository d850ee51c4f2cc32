"""A live one-rank job names rank 0 wherever a rank is named (the incident, its ``rank`` label on
/metrics and in Alertmanager, the log line); a replay of a CSV log (one series, no ranks) names none."""

from __future__ import annotations

import math

import numpy as np
from detector_synth import Fault, SyntheticRun
from prometheus_client import CollectorRegistry
from sdcwatch.core.incident import IncidentEvent
from sdcwatch.core.record import to_json
from sdcwatch.core.record_type import Record
from sdcwatch.exporters.alertmanager import alert_for
from sdcwatch.exporters.collector import SdcwatchCollector
from sdcwatch.exporters.logsink import format_logfmt
from sdcwatch.service import replay
from sdcwatch.service.pipeline import DetectionPipeline

ONE = "one rank, nothing to compare it with: optimisation/data instability or a fault on that rank"
SINGLE = "single series (ranks unknown): optimisation/data instability or an unlocalised fault"


def one_rank_job():
    return SyntheticRun(world=1, seed=1, faults=[Fault("nonfinite", 40, rank=0), Fault("checksum", 100, rank=0)])


def test_a_live_one_rank_job_names_rank_0_on_every_sink():
    pipe = DetectionPipeline(wall=lambda: 1000.0)
    synth = one_rank_job()
    for s in range(120):
        pipe.process(synth.records(s))
    got = {i.kind: i for i in pipe.incidents()}
    assert set(got) == {"nonfinite", "checksum_mismatch"}  # 60 steps apart: two faults
    for inc in got.values():
        assert (inc.ranks, inc.hosts) == ((0,), ("node0",)) and "on rank 0 (host node0)" in inc.message
        assert alert_for(inc, now=1000.0, valid_for=300.0)["labels"]["rank"] == "0"
        assert " rank=0 host=node0 " in format_logfmt(IncidentEvent("opened", inc))
    registry = CollectorRegistry()
    registry.register(SdcwatchCollector(pipe.view, clock=lambda: 1001.0))
    labels = [s.labels for m in registry.collect() for s in m.samples if s.name == "sdcwatch_incident_info"]
    assert sorted((x["kind"], x["rank"], x["host"]) for x in labels) == [
        ("checksum_mismatch", "0", "node0"),
        ("nonfinite", "0", "node0"),
    ]


def test_a_capture_of_a_one_rank_job_replays_naming_rank_0(tmp_path):
    path = tmp_path / "one.jsonl"
    synth = one_rank_job()
    path.write_text("".join(to_json(r) + "\n" for s in range(60) for r in synth.records(s)))
    (inc,) = replay(path)
    assert (inc.kind, inc.first_step, inc.ranks, inc.hosts) == ("nonfinite", 40, (0,), ("node0",))


def test_a_csv_log_names_no_rank_and_the_same_rows_from_a_rank_name_rank_0(tmp_path):
    """The same loss series as a CSV log (a replay: no ranks) and as rank 0's records (a live job)."""
    rng = np.random.default_rng(0)
    loss = 3.0 + 0.02 * rng.standard_normal(120)
    loss[70], loss[100] = 6.0, math.nan
    csv = tmp_path / "log.csv"
    csv.write_text("step,loss\n" + "".join(f"{s},{float(v)!r}\n" for s, v in enumerate(loss)))
    replayed = {i.kind: i for i in replay(csv)}
    assert set(replayed) == {"loss_spike", "nonfinite"}
    assert all(i.ranks == () and i.hosts == () for i in replayed.values())
    assert replayed["loss_spike"].message.endswith(SINGLE)

    pipe = DetectionPipeline()
    for s, v in enumerate(loss):
        pipe.process([Record.make(run="log", step=s, rank=0, world=1, host="gpu7", scalars={"loss": float(v)})])
    pipe.flush()
    live = {i.kind: i for i in pipe.incidents()}
    assert set(live) == {"loss_spike", "nonfinite"}
    assert (live["nonfinite"].ranks, live["nonfinite"].hosts) == ((0,), ("gpu7",))
    assert live["nonfinite"].message == replayed["nonfinite"].message.replace("rank 0", "rank 0 (host gpu7)")
    # a spike is the job's, in a job of any size: no rank, but not "ranks unknown" either
    assert live["loss_spike"].ranks == () and live["loss_spike"].message.endswith(ONE)
