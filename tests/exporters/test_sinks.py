"""Alertmanager, webhook and log sinks against fake transports: payloads, retries, refresh,
resolution, and that publishing never waits for the network."""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime

import pytest
import sdcwatch_exporter_test_support as support  # registered by conftest.py
from polling import returns, wait_for
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.incident import IncidentEvent, Severity
from sdcwatch.exporters import AlertmanagerSink, Backoff, DeliveryError, LogSink, WebhookSink, alert_for, alertname_for
from sdcwatch.exporters.logsink import format_logfmt


def fast_backoff() -> Backoff:
    return Backoff(initial=0.01, maximum=0.05)


class FakePost:
    """Records POSTs; fails the first ``failures`` calls; with ``answer``, answers none before it is set."""

    def __init__(self, failures: int = 0, answer: threading.Event | None = None) -> None:
        self.failures = failures
        self.answer = answer
        self.calls: list[tuple[str, object]] = []
        self.attempts = 0
        self.lock = threading.Lock()

    def __call__(self, url, body, timeout):
        if self.answer is not None:
            self.answer.wait()
        with self.lock:
            self.attempts += 1
            if self.failures > 0:
                self.failures -= 1
                raise DeliveryError(f"{url}: HTTP 503")
            self.calls.append((url, json.loads(body)))
        return 200

    def alerts(self) -> list[dict]:
        with self.lock:
            return [alert for _, body in self.calls for alert in body]


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def opened(**kw) -> IncidentEvent:
    return IncidentEvent("opened", support.sdc_incident(opened_at=1000.0, **kw))


def resolved(**kw) -> IncidentEvent:
    return IncidentEvent("resolved", support.sdc_incident(opened_at=1000.0, resolved=True, **kw))


# -- Alertmanager ---------------------------------------------------------------------------------


def test_alert_carries_the_labels_and_annotations_operators_route_on():
    post = FakePost()
    with AlertmanagerSink(
        "http://am:9093/", post=post, clock=lambda: 2000.0, refresh_interval=60, extra_labels={"cluster": "c1"}
    ) as sink:
        sink.publish(opened())
        assert sink.flush(5)
    ((url, body),) = post.calls
    assert url == "http://am:9093/api/v2/alerts"
    (alert,) = body
    assert alert["labels"] == {
        "alertname": "SdcwatchSdcSuspected",
        "run": "r1",
        "severity": "critical",
        "kind": "sdc_suspected",
        "incident": "inc-sdc-1",
        "rank": "5",
        "host": "h2",
        "layer": "1",
        "metric": "attn_entropy",
        "source": "sdcwatch",
        "cluster": "c1",
    }
    assert alert["annotations"]["summary"].startswith("loss spike, SDC suspected on rank 5")
    assert "rank 5" in alert["annotations"]["description"] and "layer 1" in alert["annotations"]["description"]
    assert json.loads(alert["annotations"]["evidence"]) == {"robust_z": 12.25, "steps": [100, 110, 120]}
    assert parse_time(alert["startsAt"]) == 1000.0
    assert parse_time(alert["endsAt"]) == 2000.0 + 4 * 60  # open: valid for four refresh intervals


def test_the_description_says_what_the_index_counts():
    """A checksum's index is a product and stream_max's a block: the description says so, with the
    module's name when the rank sent it; an attention statistic's index is a layer."""
    inc = support.sdc_incident()
    inc.metric, inc.layer = "gemm_out", 11
    assert "; product 11; metric gemm_out;" in alert_for(inc, now=0.0, valid_for=60)["annotations"]["description"]
    inc.metric, inc.layer, inc.layer_name = "stream_max", 3, "model.layers.3"
    assert (
        "; block 3 (model.layers.3); metric stream_max;"
        in alert_for(inc, now=0.0, valid_for=60)["annotations"]["description"]
    )
    inc.metric, inc.layer, inc.layer_name = "attn_entropy", 1, None
    assert "; layer 1; metric attn_entropy;" in alert_for(inc, now=0.0, valid_for=60)["annotations"]["description"]


def test_resolution_is_sent_with_ends_at_the_resolution_time():
    post = FakePost()
    with AlertmanagerSink("http://am:9093", post=post, clock=lambda: 5000.0) as sink:
        sink.publish(opened())
        sink.publish(resolved())
        assert sink.flush(5)
    last = post.alerts()[-1]
    assert parse_time(last["endsAt"]) == 1030.0 and last["labels"]["rank"] == "5"


def test_open_alerts_are_refreshed_and_resolved_ones_are_not():
    post = FakePost()
    with AlertmanagerSink("http://am:9093", post=post, refresh_interval=0.05) as sink:
        sink.publish(opened(id="a"))
        sink.publish(opened(id="b", rank=9, host="h4"))
        assert sink.flush(5)
        sink.publish(resolved(id="b", rank=9, host="h4"))
        assert sink.flush(5)
        resolved_at = len(post.calls)
        wait_for(lambda: len(post.calls) >= resolved_at + 3, 30, "three refreshes at 0.05 s", interval=0.01)
        after = list(post.calls[resolved_at:])
    assert len(after) >= 3, "open alerts were not re-sent"
    refreshed = [a["labels"]["incident"] for _, body in after for a in body]
    assert set(refreshed) == {"a"}  # the resolved alert is not refreshed


def test_failed_posts_are_retried_with_backoff_until_delivered():
    post = FakePost(failures=3)
    with AlertmanagerSink("http://am:9093", post=post, backoff=fast_backoff()) as sink:
        sink.publish(opened())
        assert sink.flush(5)
        assert sink.failures == 3 and sink.sent == 1
    assert post.attempts == 4 and post.alerts()[0]["labels"]["rank"] == "5"


def test_events_during_an_outage_collapse_to_the_latest_state_per_incident():
    post = FakePost(failures=2)
    with AlertmanagerSink("http://am:9093", post=post, backoff=fast_backoff(), clock=lambda: 9000.0) as sink:
        sink.publish(opened())
        wait_for(lambda: post.attempts, 30, "the first delivery to fail", interval=0.001)  # the outage is on
        sink.publish(resolved())
        assert sink.flush(5)
    delivered = post.alerts()
    assert len(delivered) == 1 and parse_time(delivered[0]["endsAt"]) == 1030.0


def test_publish_never_waits_for_a_slow_alertmanager():
    answer = threading.Event()
    post = FakePost(answer=answer)  # an Alertmanager that answers nothing until the publishes are done
    sink = AlertmanagerSink("http://am:9093", post=post)
    returns(lambda: [sink.publish(opened(id=f"i{i}")) for i in range(500)], 30, "500 publishes, none answered")
    answer.set()
    sink.close(timeout=3)


def test_a_dead_alertmanager_does_not_hang_close_or_raise():
    post = FakePost(failures=10**9)
    sink = AlertmanagerSink("http://am:9093", post=post, backoff=fast_backoff())
    sink.publish(opened())
    assert not sink.flush(0.2)
    returns(lambda: sink.close(timeout=2), 30, "close(timeout=2) with the Alertmanager dead")
    assert sink.failures >= 2 and sink.sent == 0


def test_queue_overflow_drops_the_oldest_events_and_counts_them():
    gate = threading.Event()

    def blocked(url, body, timeout):
        gate.wait(5)
        return 200

    sink = AlertmanagerSink("http://am:9093", post=blocked, max_queue=10)
    for i in range(50):
        sink.publish(opened(id=f"i{i}"))
    gate.set()
    sink.close(timeout=5)
    assert 30 <= sink.dropped <= 40  # the worker may have taken one batch before blocking


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"url": "am:9093"}, "alertmanager.url"),
        ({"url": "http://am", "refresh_interval": 0}, "alertmanager.refresh_interval"),
        ({"url": "http://am", "timeout": -1}, "alertmanager.timeout"),
        ({"url": "http://am", "extra_labels": {"bad-name": "x"}}, "alertmanager.extra_labels"),
        ({"url": "http://am", "max_queue": 0}, "sink.max_queue"),
    ],
)
def test_bad_alertmanager_settings_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        AlertmanagerSink(**kwargs)
    assert err.value.key == key


def test_alertname_is_camel_case_of_the_kind():
    assert alertname_for("sdc_suspected") == "SdcwatchSdcSuspected"
    assert alertname_for("nonfinite") == "SdcwatchNonfinite"


def test_backoff_doubles_up_to_the_cap_and_resets():
    b = Backoff(initial=0.5, maximum=3.0)
    assert [b.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.succeeded()
    assert b.failed() == 0.5
    with pytest.raises(ConfigError):
        Backoff(initial=2, maximum=1)


# -- webhook --------------------------------------------------------------------------------------


def test_webhook_posts_each_change_in_order_with_the_incident_dict():
    post = FakePost(failures=1)
    with WebhookSink("http://hooks/sdc", post=post, backoff=fast_backoff()) as sink:
        sink.publish(opened())
        sink.publish(IncidentEvent("updated", support.sdc_incident(opened_at=1000.0)))
        sink.publish(resolved())
        assert sink.flush(5)
    bodies = [body for _, body in post.calls]
    assert [b["change"] for b in bodies] == ["opened", "updated", "resolved"]
    assert bodies[0]["version"] == 1
    assert bodies[0]["incident"] == support.sdc_incident(opened_at=1000.0).to_dict()
    assert bodies[2]["incident"]["resolved_step"] == 140
    assert sink.sent == 3 and sink.failures == 1


def test_webhook_gives_up_on_an_event_after_max_attempts():
    post = FakePost(failures=3)
    with WebhookSink("http://hooks/sdc", post=post, max_attempts=3, backoff=fast_backoff()) as sink:
        sink.publish(opened(id="lost"))
        sink.publish(opened(id="kept"))
        assert sink.flush(5)
    assert sink.given_up == 1
    assert [body["incident"]["id"] for _, body in post.calls] == ["kept"]


def test_webhook_rejects_bad_settings():
    with pytest.raises(ConfigError, match="webhook.url"):
        WebhookSink("ftp://x")
    with pytest.raises(ConfigError, match="webhook.max_attempts"):
        WebhookSink("http://x", max_attempts=0)


# -- log ------------------------------------------------------------------------------------------


def test_log_sink_writes_one_line_per_change_at_a_severity_level(caplog):
    sink = LogSink("sdcwatch.test.incidents")
    with caplog.at_level(logging.INFO, logger="sdcwatch.test.incidents"):
        sink.publish(opened())
        sink.publish(resolved())
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.INFO]
    first, second = (r.getMessage() for r in caplog.records)
    assert "\n" not in first
    assert first.startswith("incident=opened id=inc-sdc-1 run=r1 kind=sdc_suspected severity=critical")
    assert " rank=5 host=h2 layer=1 " in first
    assert first.endswith('message="loss spike, SDC suspected on rank 5 (host h2), layer 1 attention"')
    assert second.startswith("incident=resolved") and "resolved_step=140" in second


def test_log_sink_json_format_round_trips(caplog):
    sink = LogSink("sdcwatch.test.json", format="json")
    with caplog.at_level(logging.INFO, logger="sdcwatch.test.json"):
        sink.publish(IncidentEvent("updated", support.sdc_incident()))
    record = json.loads(caplog.records[0].getMessage())
    assert record["change"] == "updated" and record["incident"]["ranks"] == [5]


def test_logfmt_quotes_values_that_need_it():
    inc = support.sdc_incident()
    inc.message = 'say "hi"\nnow'
    inc.severity = Severity.WARNING
    line = format_logfmt(IncidentEvent("opened", inc))
    assert line.endswith(r'message="say \"hi\"\nnow"')


def test_log_sink_never_raises_even_if_the_logger_does():
    class Exploding(logging.Logger):
        def log(self, *a, **k):
            raise OSError("disk full")

    LogSink(Exploding("x")).publish(opened())
    with pytest.raises(ConfigError, match="log_sink.format"):
        LogSink(format="xml")


def test_an_incident_that_changes_kind_ends_its_old_alert():
    post = FakePost()
    drift = support.sdc_incident(opened_at=1000.0)
    drift.kind, drift.severity = "silent_drift", Severity.WARNING
    with AlertmanagerSink("http://am:9093", post=post, clock=lambda: 3000.0) as sink:
        sink.publish(IncidentEvent("opened", drift))
        assert sink.flush(5)
        sink.publish(IncidentEvent("updated", support.sdc_incident(opened_at=1000.0)))
        assert sink.flush(5)
    assert len(post.calls) == 2
    second = post.calls[1][1]
    by_name = {a["labels"]["alertname"]: a for a in second}
    assert set(by_name) == {"SdcwatchSilentDrift", "SdcwatchSdcSuspected"}
    assert parse_time(by_name["SdcwatchSilentDrift"]["endsAt"]) == 3000.0  # ended now
    assert parse_time(by_name["SdcwatchSdcSuspected"]["endsAt"]) > 3000.0  # firing
