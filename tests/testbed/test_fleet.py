"""The fleet campaign: a small simulated cluster through the real pipeline, its host ledger held to
the issue's targets (suspect within 5 runs on the bad host, quarantined within 10, no clean host
suspect), and ``sdcwatch bench fleet``'s table and JSON."""

from __future__ import annotations

import json

from sdcwatch.testbed.campaign.cli import bench_main
from sdcwatch.testbed.campaign.fleet import FleetConfig, fleet_table, run_fleet

#: A fleet small enough for a test: 8 hosts of 4 ranks, 12 short runs on 3-5 hosts each.
SMALL = dict(hosts=8, ranks_per_host=4, runs=12, min_steps=120, max_steps=160, min_hosts_per_run=3, max_hosts_per_run=5)


def test_the_bad_host_is_named_within_the_targets_and_no_clean_host_is() -> None:
    result = run_fleet(FleetConfig(**SMALL, noise_rate=0.05), seeds=1)
    seed = result["seeds"][0]
    assert seed["runs_on_bad_host"] >= 5  # enough runs on it to mean something
    assert seed["suspect_after_runs"] is not None and seed["suspect_after_runs"] <= 5
    assert seed["quarantine_after_runs"] is not None and seed["quarantine_after_runs"] <= 10
    assert seed["false_suspects"] == [] and result["targets_met"] == 1
    bad = next(h for h in seed["hosts"] if h["host"] == seed["bad_host"])
    assert bad["verdict"] == "quarantine" and len(bad["runs"]) >= 3 and "rank_outlier" in bad["kinds"]
    assert "1 of 1 seeds" in fleet_table(result)


def test_a_clean_fleet_makes_no_suspect(capsys) -> None:
    argv = ["fleet", "--clean", "--seeds", "1", "--workers", "1", "--json", "--runs", "3", "--hosts", "8"]
    assert bench_main([*argv, "--ranks-per-host", "4"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert result["false_suspects"] == 0 and result["targets_met"] is None
    assert [s["hosts"] for s in result["seeds"]] == [[]]  # no host even left a mark worth showing
    assert "seed 0 run 3/3" in out.err  # progress on stderr
