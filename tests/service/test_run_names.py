"""Run names belong to the keys issued for them (issue 36, item 2): a key file's ``runs=`` patterns,
a binding table that never gives a live run away, a refused run named in a log line and counted
by key and reason; in process here, then against a real `sdcwatch serve` on the real broker."""

from __future__ import annotations

import logging

import pytest
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.signing import AuthError, JobKey, Keyring, RunBindings
from sdcwatch.service.auth import Authenticator

SECRET = "-secret-0123456789abcdef"
KEY_A, KEY_B, KEY_C = (JobKey.parse(f"job-{c}:{c}{SECRET}") for c in "abc")
KEY_FILE = f"job-a:a{SECRET} runs=job-a,job-a-*\njob-b:b{SECRET} runs=team-b-*\n# legacy: any name\njob-c:c{SECRET}\n"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_file_says_which_run_names_each_key_may_use_and_a_key_without_patterns_any():
    ring = Keyring.from_text(KEY_FILE)
    assert ring.kids == ("job-a", "job-b", "job-c") and ring.unrestricted == ("job-c",)
    assert ring.runs_of("job-a") == ("job-a", "job-a-*") and ring.runs_of("job-c") is None
    assert ring.may_use("job-a", "job-a") and ring.may_use("job-a", "job-a-restart-2")
    assert not ring.may_use("job-a", "job-ab") and not ring.may_use("job-b", "job-a")
    assert ring.may_use("job-c", "job-a") and not ring.may_use("job-x", "anything")
    assert ring.get("job-b").tag(b"m") == KEY_B.tag(b"m")  # the patterns are not part of the secret
    with pytest.raises(ConfigError, match="line 1.*runs="):
        Keyring.from_text(f"job-a:a{SECRET} runs=a,,b")


def test_another_tenants_key_cannot_take_a_run_name_it_is_not_issued_for_and_is_named_once_a_window(caplog):
    clock = _Clock()
    auth = Authenticator(Keyring.from_text(KEY_FILE), log_every=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "sdcwatch.service.auth"):
        for _ in range(32):  # the squatter goes first
            with pytest.raises(AuthError, match="not issued for run 'job-a'"):
                auth.bind(["job-a"], "job-b")
        auth.bind(["job-a"], "job-a")  # the owner still binds its run
        clock.now += 11
        with pytest.raises(AuthError, match="not issued for run 'job-a-2'"):
            auth.bind(["job-a-2"], "job-b")
    assert auth.key_of("job-a") is not None and auth.key_of("job-a").kid == "job-a"
    assert auth.refused == {("job-b", "run_name"): 33}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "refused run 'job-a' (run_name; 1 such" in lines[0]
    assert "refused run 'job-a-2' (run_name; 32 such" in lines[1]


def test_a_key_without_patterns_binds_a_free_name_as_before_and_the_service_says_so_at_start(caplog):
    auth = Authenticator(Keyring.from_text(KEY_FILE))
    with caplog.at_level(logging.WARNING, "sdcwatch.service.auth"):
        auth.warn_unrestricted()
    assert "job-c" in caplog.text and "job-a" not in caplog.text.split("carry")[0]
    auth.bind(["job-a"], "job-a")
    auth.bind(["some-free-name"], "job-c")  # as before run patterns: its first key owns a free name
    with pytest.raises(AuthError, match="bound to key 'job-a'"):
        auth.bind(["job-a"], "job-c")  # ... but never one another key holds
    assert auth.refused == {("job-c", "bound"): 1}


def test_a_flood_of_run_names_never_unbinds_a_live_run_and_an_idle_one_makes_room():
    clock = _Clock()
    b = RunBindings(max_runs=100, idle_s=900.0, clock=clock)
    assert b.check("victim", "job-a", clock()) is None
    for i in range(99):
        assert b.check(f"junk-{i}", "job-c", clock()) is None
    for i in range(99, 100_352):  # the measured flood: every new name is refused, the victim stays
        clock.now += 0.001
        assert b.check(f"junk-{i}", "job-c", clock())[0] == "full"
        if i % 10_000 == 0:
            assert b.check("victim", "job-a", clock()) is None  # the victim keeps sending
    assert b.kid_of("victim") == "job-a" and len(b) == 100
    assert b.check("victim", "job-c", clock())[0] == "bound"
    clock.now += 901  # every junk binding idle; the victim sends again, then a new run gets a place
    assert b.check("victim", "job-a", clock()) is None
    assert b.check("new-run", "job-c", clock()) is None
    assert b.kid_of("victim") == "job-a" and b.kid_of("junk-0") is None and len(b) == 100


def test_restored_bindings_keep_their_starts_and_drop_what_the_key_file_no_longer_allows():
    ring = Keyring.from_text(KEY_FILE)
    before = RunBindings(may_use=None)
    before.check("job-a", "job-b", 0.0)  # bound by a squatter before run patterns came in
    before.check("team-b-1", "job-b", 0.0)
    before.note_start("team-b-1", "abc123", 5.0)
    state = before.snapshot()
    assert state == {"job-a": "job-b", "team-b-1": ["job-b", 5.0, "abc123"]}
    after = RunBindings(may_use=ring.may_use)
    after.restore({**state, "older": "job-c"})  # the earlier form (run -> key id) reads too
    assert after.kid_of("job-a") is None and after.kid_of("older") == "job-c"
    assert after.kid_of("team-b-1") == "job-b" and after.nonce_of("team-b-1") == "abc123"


def test_a_start_is_kept_only_when_signed_by_the_runs_key_and_newer():
    from sdcwatch.core.control import JobStart
    from sdcwatch.service.ingest import IngestDecoder, SchemaRegistry

    auth = Authenticator(Keyring.from_text(KEY_FILE), unsigned="accept")
    dec = IngestDecoder(SchemaRegistry(), auth=auth)
    first, second = JobStart("job-a", started_at=100.0), JobStart("job-a", started_at=200.0)
    items, rejected = dec.decode([("t", b"k", KEY_A.sign(second.encode())), ("t", b"k", KEY_A.sign(first.encode()))])
    assert items == [] and rejected == [] and auth.nonce_of("job-a") == second.nonce  # an older start comes late
    forged = JobStart("job-a", started_at=300.0)
    _, rejected = dec.decode([("t", b"k", forged.encode()), ("t", b"k", KEY_B.sign(forged.encode()))])
    assert [r.code for r in rejected] == ["auth", "auth"] and auth.nonce_of("job-a") == second.nonce
    _, rejected = dec.decode([("t", b"k", KEY_A.sign(b"SDCI{not json"))])
    assert [r.code for r in rejected] == ["malformed"]


# -- against a real service ------------------------------------------------------------------


@pytest.mark.integration
def test_a_squatter_sent_first_is_refused_by_a_real_service_and_the_victims_nan_is_found(bootstrap, tmp_path):
    """Before: 32 records from another tenant's valid key under job-a's run name, sent first, made
    all of job-a's messages dead-lettered ``auth`` and its NaN was missed, with no log line. Now the
    squatter's messages are refused (dead-lettered, counted by key and reason, the run named in the
    log), job-a loses nothing and its NaN is found at its step and rank. With ``--auth-unsigned
    accept`` (issue 36 item 9), unsigned NaN records "from rank 3" sent just before job-a's first
    signed message framed rank 3 and raised a false missing_rank for the real ranks: discarded now."""
    from kafka import KafkaProducer
    from serve_process import ServeProcess, Topics, metric, peek_topic
    from test_hostile_trust import _forged, _nan_incident, _settled, _Victim

    keys = tmp_path / "keys"
    keys.write_text(KEY_FILE)
    topics = Topics.fresh()
    serve = ServeProcess(
        bootstrap, topics, tmp_path / "state", "--auth-key-file", str(keys), "--auth-unsigned", "accept"
    )
    serve.wait_banner()
    producer = KafkaProducer(bootstrap_servers=[bootstrap], linger_ms=5)
    victim = _Victim(bootstrap, topics.telemetry, "job-a", KEY_A)
    try:
        assert "key(s) job-c carry no runs= patterns" in serve.stderr()
        for step in range(32):
            producer.send(topics.telemetry, key=b"job-a", value=KEY_B.sign(_forged("job-a", step, step % 4, loss=1.0)))
        producer.flush()
        samples = _settled(serve, sdcwatch_pipeline_dead_letters_total=32)
        assert metric(samples, "sdcwatch_auth_runs_refused_total", key="job-b", reason="run_name") == 32
        serve.wait_line(lambda line: "refused run 'job-a' (run_name" in line, 30, "the refused run named")
        for step in range(3):  # unsigned, before job-a's first signed message: accepted while unbound
            producer.send(topics.telemetry, key=b"job-a", value=_forged("job-a", step, 3, loss=float("nan")))
        producer.flush()
        victim.train(60, nan_at=35)
        _nan_incident(serve, "job-a", 35)
        samples = _settled(serve, sdcwatch_training_last_step=59)
        assert metric(samples, "sdcwatch_pipeline_dead_letters_total") == 32, "a message of job-a was refused"
        assert (
            60 * 4 <= metric(samples, "sdcwatch_pipeline_records_total") <= 60 * 4 + 3
        )  # the forged: read, then discarded
        opened = [e for e in serve.events() if e["change"] == "opened" and e["run"] == "job-a"]
        assert [(e["kind"], e["first_step"], e["ranks"]) for e in opened] == [("nonfinite", 35, [2])], opened
        dead = peek_topic(bootstrap, topics.dead)  # the squatter's, signed with job-b's key
        assert dead and all(m.value[:4] == b"SDCS" and b"job-b" in m.value[:16] for m in dead)
    finally:
        producer.close()
        victim.close()
        serve.close()
