"""Mesh coordinates on /metrics, in alerts and in the log: bounded, joinable, absent without them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

import sdcwatch_exporter_test_support as support  # registered by conftest.py
from sdcwatch.core.mesh import DIMS
from sdcwatch.core.incident import IncidentEvent
from sdcwatch.exporters import SdcwatchCollector
from sdcwatch.exporters.alertmanager import alert_for
from sdcwatch.exporters.collector import incident_coords_label
from sdcwatch.exporters.logsink import format_logfmt


def render(view) -> list[str]:
    registry = CollectorRegistry()
    registry.register(SdcwatchCollector(lambda: view, clock=lambda: 1001.0, top_k=16))
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def mesh_coords(world: int, tp: int, pp: int) -> np.ndarray:
    """(world, dims) coordinates of a (pp, dp, tp) mesh, tensor parallel fastest."""
    dp = world // (tp * pp)
    r = np.arange(world)
    c = np.full((world, len(DIMS)), -1)
    c[:, DIMS.index("tp")] = r % tp
    c[:, DIMS.index("dp_replicate")] = (r // tp) % dp
    c[:, DIMS.index("pp")] = r // (tp * dp)
    return c


def with_coords(world: int) -> object:
    view = support.large_view(world)
    view.runs[0].coords = mesh_coords(world, tp=8, pp=16)
    return view


@pytest.mark.parametrize("world", [1024, 16_384])
def test_cardinality_stays_under_2000_at_16384_ranks_with_coordinates(world):
    lines = render(with_coords(world))
    assert len(lines) < 2000, f"{len(lines)} series at {world} ranks with coordinates"
    coords = [s for s in lines if s.startswith("sdcwatch_rank_coordinates{")]
    per_rank = [s for s in lines if s.startswith("sdcwatch_rank_outlier_score{")]
    assert len(coords) == len(per_rank)  # one coordinate series per rank that has series, no more
    assert len(lines) - len(coords) == len(render(support.large_view(world)))


def test_coordinates_of_an_exported_rank_are_its_own():
    view = with_coords(16_384)
    coords = view.runs[0].coords
    rank = view.incidents[0].ranks[0]
    tp, dp, pp = (int(coords[rank, DIMS.index(d)]) for d in ("tp", "dp_replicate", "pp"))
    line = next(s for s in render(view) if s.startswith("sdcwatch_rank_coordinates{") and f'rank="{rank}"' in s)
    assert f'tp="{tp}"' in line and f'pp="{pp}"' in line and f'dp_replicate="{dp}"' in line
    assert 'dp_shard=""' in line and line.endswith(" 1.0")


def test_no_coordinate_series_without_coordinates():
    assert not [s for s in render(support.large_view(1024)) if s.startswith("sdcwatch_rank_coordinates")]


def test_alert_labels_and_log_line_name_the_coordinates():
    inc = dataclasses.replace(support.sdc_incident(), coords=({"pp": 0, "dp_replicate": 2, "tp": 1},))
    alert = alert_for(inc, now=1000.0, valid_for=60.0)
    assert alert["labels"]["coords"] == "pp=0,dp_replicate=2,tp=1"
    assert "coords pp=0,dp_replicate=2,tp=1" in alert["annotations"]["description"]
    assert 'coords="pp=0,dp_replicate=2,tp=1"' in format_logfmt(IncidentEvent("opened", inc))
    assert inc.to_dict()["coords"] == [{"pp": 0, "dp_replicate": 2, "tp": 1}]
    plain = support.sdc_incident()
    assert "coords" not in alert_for(plain, now=1000.0, valid_for=60.0)["labels"]
    assert "coords" not in plain.to_dict() and "coords" not in format_logfmt(IncidentEvent("opened", plain))


def test_the_coordinates_label_is_bounded():
    many = tuple({"tp": i % 8, "pp": i // 8} for i in range(40))
    label = incident_coords_label(many)
    assert label.count(";") == 8 and label.endswith(";...(+32)")
