"""``sdcwatch bench ingest --parallel``: records with mesh coordinates, judged within peer groups."""

from __future__ import annotations

import json

import pytest

from sdcwatch.testbed.campaign.cli import bench_main


def test_ingest_benchmark_with_a_parallel_layout_carries_coordinates_and_raises_nothing(capsys):
    assert bench_main(["ingest", "--ranks", "64", "--parallel", "tp=2,pp=4,dp=8", "--steps", "1", "--json"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["format"] for r in lines] == ["v1", "v2"]
    for r in lines:
        assert r["parallel"] == "pp=4,dp_replicate=8,tp=2" and r["ranks"] == 64 and r["incidents"] == 0
    v1, v2 = lines
    assert v2["bytes_per_record"] < v1["bytes_per_record"]


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--ranks", "63", "--parallel", "tp=2,pp=4,dp=8"], "give --ranks 64"),
        (["--ranks", "64", "--parallel", "warp=64"], "unknown mesh dim 'warp'"),
    ],
)
def test_ingest_benchmark_names_a_layout_that_does_not_fit(argv, said, capsys):
    with pytest.raises(SystemExit):
        bench_main(["ingest", *argv])
    assert said in capsys.readouterr().err
