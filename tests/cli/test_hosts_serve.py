"""A small fleet through a real `sdcwatch serve` on the broker: a host whose ranks show checksum
mismatches in two runs is suspect, the others clean; `sdcwatch hosts` lists them, /metrics shows
the suspect only, and an operator's clear is applied by the running service and recorded."""

from __future__ import annotations

import json

import pytest
from detector_synth import FPS, LAYERS, Fault, SyntheticRun
from polling import wait_for
from serve_process import ServeProcess, Topics, metric, run_cli, scrape, wait_metric
from sdcwatch.service.host_files import read_hosts

pytestmark = pytest.mark.integration


#: Steps the ranks send before the test waits for the service to judge them (< its 64 open steps a run)
WINDOW = 48


def _send(bootstrap: str, url: str, topic: str, synth: SyntheticRun, steps: int) -> None:
    """Every rank's records of ``synth`` through an emitter, then its end-of-run marker, ``WINDOW``
    steps at a time, each window judged before the next is sent: the ranks of a step reach the
    service together, as those of a job in step do. A burst read unevenly (a producer slow to start,
    a partition read ahead of the others under load) would have a step closed without its late ranks
    (5 s after its first, or past 64 open steps): their flipped checksums unseen, no host suspect."""
    from sdcwatch.telemetry import Emitter, KafkaTransport

    emitters = [
        Emitter(KafkaTransport(bootstrap, topic), run=synth.run, rank=r, world=synth.world, host=synth.hosts[r])
        for r in range(synth.world)
    ]
    for step in range(steps):
        for rec in synth.records(step):
            layers = {n: rec.layers[n] for n in LAYERS}
            fps = {n: rec.fingerprints[n] for n in FPS}
            scalars = {k: v for k, v in rec.scalars.items() if k != "emitter_dropped"}  # the emitter's own count
            emitters[rec.rank].emit(step, layers=layers, fingerprints=fps, **scalars)
        if step % WINDOW == WINDOW - 1:
            assert all(em.flush(60) for em in emitters), f"{synth.run}: the broker did not take a rank's records"
            _wait_judged(url, synth.run, step)
    for em in emitters:
        em.close(60)


def _wait_judged(url: str, run: str, step: int) -> None:
    def judged(samples: list) -> bool:
        return metric(samples, "sdcwatch_training_last_step", run=run) >= step

    wait_metric(url, judged, 90, f"step {step} of {run} judged")


def _verdicts(state) -> dict:
    body = read_hosts(state)
    return {} if body is None else {h["host"]: h for h in body["hosts"]}


def test_a_bad_host_across_runs_is_suspect_listed_exported_and_cleared(bootstrap, tmp_path):
    topics, state = Topics.fresh(), tmp_path / "state"
    with ServeProcess(bootstrap, topics, state, snapshot_interval_s=1) as serve:
        url = serve.wait_banner()
        # node0 (ranks 0-3) flips a checksum in jobs a and b; node1 once, in job c only; a loss spike
        # on every rank (a bad batch) in each run credits no host
        for i, (run, faults) in enumerate(
            (
                ("job-a", [Fault("checksum", 40, rank=1), Fault("checksum", 70, rank=2), Fault("loss_spike", 90)]),
                ("job-b", [Fault("checksum", 40, rank=1), Fault("checksum", 70, rank=2), Fault("loss_spike", 90)]),
                ("job-c", [Fault("checksum", 50, rank=5), Fault("loss_spike", 60)]),
            )
        ):
            _send(bootstrap, url, topics.telemetry, SyntheticRun(world=8, run=run, seed=i, faults=faults), 110)
        wait_for(
            lambda: _verdicts(state).get("node0", {}).get("verdict") == "suspect" and "node1" in _verdicts(state),
            90,
            "node0 suspect and node1 tracked in hosts.json",
        )
        listed = run_cli("hosts", "--json", "--state-dir", str(state))
        assert listed.returncode == 0, listed.stderr
        hosts = {h["host"]: h for h in json.loads(listed.stdout)["hosts"]}
        assert (hosts["node0"]["verdict"], hosts["node0"]["runs"], hosts["node0"]["kinds"]) == (
            "suspect",
            ["job-a", "job-b"],
            ["checksum"],
        )
        assert {h: v["verdict"] for h, v in hosts.items() if h != "node0"} == {"node1": "clean"}
        assert (state / "quarantine.txt").read_text() == ""  # suspect is not quarantined
        samples = scrape(url)
        assert metric(samples, "sdcwatch_host_verdict", host="node0", verdict="suspect") == 1.0
        assert metric(samples, "sdcwatch_host_verdict", host="node1") == 0.0  # a clean host has no series
        assert (metric(samples, "sdcwatch_hosts_tracked"), metric(samples, "sdcwatch_hosts_suspect")) == (2.0, 1.0)

        clear = ("hosts", "clear", "node0", "--reason", "GPU replaced", "--by", "ops", "--wait", "90s")
        cleared = run_cli(*clear, "--state-dir", str(state))
        assert cleared.returncode == 0, cleared.stdout + cleared.stderr
        assert "applied by the service: node0 is cleared" in cleared.stdout
        after = _verdicts(state)["node0"]
        assert (after["verdict"], after["cleared_by"], after["reason"]) == ("cleared", "ops", "GPU replaced")
        serve.stop()
    (line,) = (state / "host-clears.jsonl").read_text().splitlines()
    clear = json.loads(line)
    assert (clear["host"], clear["by"], clear["reason"]) == ("node0", "ops", "GPU replaced")
    saved = json.loads((state / "pipeline-state.json").read_text())
    assert saved["carried"]["host_clears_through"] == clear["wall"]  # a restart applies it no second time
