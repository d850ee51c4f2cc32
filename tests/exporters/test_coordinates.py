"""Mesh coordinates in alerts and in the log, absent without them; /metrics stays bounded with them."""

from __future__ import annotations

import dataclasses

import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py
from prometheus_client import CollectorRegistry, generate_latest
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


def with_coords(world: int) -> object:
    """The large view of a (pp=16, dp, tp=8) job whose incidents name their ranks' coordinates."""
    view = support.large_view(world)
    dp = world // 128
    view.incidents = [
        dataclasses.replace(
            inc,
            coords=tuple({"pp": r // (8 * dp), "dp_replicate": (r // 8) % dp, "tp": r % 8} for r in inc.ranks),
        )
        for inc in view.incidents
    ]
    return view


@pytest.mark.parametrize("world", [1024, 16_384])
def test_cardinality_stays_under_2000_at_16384_ranks_with_coordinates(world):
    view = with_coords(world)
    assert all(len(inc.coords) == len(inc.ranks) for inc in view.incidents)
    lines = render(view)
    assert len(lines) < 2000, f"{len(lines)} series at {world} ranks with coordinates"
    assert len(lines) == len(render(support.large_view(world)))  # coordinates add no series


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
