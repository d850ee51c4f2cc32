"""The sinks and the metrics server against real receivers: Alertmanager (Debian package) and a
loopback HTTP server."""

from __future__ import annotations

import time
import urllib.parse
import urllib.request

import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py
from polling import returns
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import IncidentEvent
from sdcwatch.detectors.registry import detector_metrics
from sdcwatch.exporters import AlertmanagerSink, Backoff, MetricsServer, WebhookSink, catalogue


def am_alerts(base: str, **filters: str) -> list[dict]:
    query = urllib.parse.urlencode([("filter", f'{k}="{v}"') for k, v in filters.items()])
    return support.http_json(f"{base}/api/v2/alerts?{query}")


@pytest.mark.integration
def test_alertmanager_receives_the_incident_alert_then_its_resolution(alertmanager):
    now = time.time()
    incident = support.sdc_incident(id=f"live-{int(now * 1000)}", rank=5, host="h2", opened_at=now)
    # refresh 30 s: open alerts stay valid for 120 s, so a disappearance below is the endsAt we sent
    sink = AlertmanagerSink(alertmanager.base_url, refresh_interval=30.0, backoff=Backoff(initial=0.1, maximum=0.5))
    try:
        sink.publish(IncidentEvent("opened", incident))
        assert sink.flush(10)
        (alert,) = support.wait_for(
            lambda: am_alerts(alertmanager.base_url, incident=incident.id), timeout=10, what="the alert in Alertmanager"
        )
        assert alert["labels"]["rank"] == "5" and alert["labels"]["host"] == "h2"
        assert alert["labels"]["alertname"] == "SdcwatchSdcSuspected"
        assert alert["labels"]["severity"] == "critical" and alert["status"]["state"] == "active"
        assert "SDC suspected on rank 5" in alert["annotations"]["summary"]

        def notified(status):
            return [
                a
                for body in alertmanager.notifications.snapshot()
                if body["status"] == status
                for a in body["alerts"]
                if a["labels"].get("incident") == incident.id
            ]

        firing = support.wait_for(lambda: notified("firing"), timeout=10, what="a firing notification")
        assert firing[0]["labels"]["rank"] == "5"

        incident.resolved_step = 140
        incident.resolved_at = time.time()
        sink.publish(IncidentEvent("resolved", incident))
        assert sink.flush(10)
        support.wait_for(
            lambda: not am_alerts(alertmanager.base_url, incident=incident.id),
            timeout=10,
            what="the alert to leave the active list",
        )
        resolved = support.wait_for(lambda: notified("resolved"), timeout=15, what="a resolved notification")
        assert resolved[0]["labels"]["rank"] == "5" and resolved[0]["status"] == "resolved"
    finally:
        sink.close()


@pytest.mark.integration
def test_alertmanager_sink_survives_an_unreachable_alertmanager():
    port = support.free_port()  # nothing listens there
    sink = AlertmanagerSink(f"http://127.0.0.1:{port}", timeout=0.5, backoff=Backoff(initial=0.05, maximum=0.1))
    returns(lambda: sink.publish(IncidentEvent("opened", support.sdc_incident())), 30, "publish, nobody listening")
    assert not sink.flush(0.5)
    sink.close(timeout=3)
    assert sink.failures >= 2 and sink.sent == 0


def test_webhook_sink_delivers_over_http_after_the_receiver_recovers(receiver):
    receiver.fail_next = 2
    with WebhookSink(receiver.url + "/sdcwatch", backoff=Backoff(initial=0.05, maximum=0.1)) as sink:
        sink.publish(IncidentEvent("opened", support.sdc_incident()))
        assert sink.flush(10)
    (body,) = receiver.snapshot()
    assert body["change"] == "opened" and body["incident"]["ranks"] == [5]
    assert receiver.paths == ["/sdcwatch"] and sink.failures == 2


def test_metrics_server_serves_the_view_on_loopback():
    with MetricsServer(support.small_view, port=0) as server:
        assert server.address == "127.0.0.1" and server.port > 0
        with urllib.request.urlopen(server.url, timeout=5) as resp:
            text = resp.read().decode()
            content_type = resp.headers["Content-Type"]
    assert content_type.startswith("text/plain")
    assert 'sdcwatch_rank_outlier_score{host="h2",rank="5",run="r1"} 9.5' in text
    assert "python_gc" not in text and "process_cpu" not in text  # own registry, sdcwatch only
    assert text.count("# TYPE ") == len(catalogue(detector_metrics()))  # the small view fills every family


def test_metrics_server_rejects_a_bad_port_and_a_taken_one():
    with pytest.raises(ConfigError, match="metrics.port"):
        MetricsServer(support.small_view, port=70000)
    with MetricsServer(support.small_view, port=0) as first:
        with pytest.raises(ConfigError, match="metrics.port"):
            MetricsServer(support.small_view, port=first.port).start()
