"""The trust boundary under attack, with real components: forged control decisions against a real
guarded gloo DDP job, and forged records, floods and storage faults against one real `sdcwatch serve`
on the real broker. Each attack waits until the service has read what came before it (by its own
counters), so no outcome depends on what one poll happens to read first."""

from __future__ import annotations

import json
import threading
import time
import uuid

import numpy as np
import pytest
from polling import wait_for
from sdcwatch.core.control import ACTIONS, Decision
from sdcwatch.core.signing import JobKey, Keyring
from sdcwatch.service.auth import Authenticator
from sdcwatch.service.ingest import IngestDecoder, SchemaRegistry, as_records

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.integration

KEY_A = JobKey.parse(f"job-a:{'a' * 8}-secret-{uuid.uuid4().hex}")
KEY_B = JobKey.parse(f"job-b:{'b' * 8}-secret-{uuid.uuid4().hex}")
#: The run table of the service under attack (detectors.max_runs): the junk runs fill it.
MAX_RUNS = 200


class _Steps:
    """The records of a run on a telemetry topic and its newest step, read in the background from
    the topic's start (signed or not), as the service decodes them."""

    def __init__(self, bootstrap: str, topic: str, run: str) -> None:
        from sdcwatch.service.kafka_source import TopicReader

        self.ingest = IngestDecoder(SchemaRegistry(), auth=Authenticator(Keyring([KEY_A]), unsigned="accept"))
        self.reader = TopicReader(bootstrap, topic, from_beginning=True)
        self.run, self.last, self.records = run, -1, []
        self.job: threading.Thread | None = None  # the training job, when it runs in a thread
        self._stop, self._drain, self._drained = threading.Event(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:  # the reader is this thread's alone (kafka-python's consumer is not thread-safe)
        mark = None
        while not self._stop.is_set():
            if mark is None and self._drain.is_set():
                mark = self.reader.end_mark()
            messages = [(f"{m.partition}:{m.offset}", m.key, m.value) for m in self.reader.poll_messages(0.2)]
            for rec in as_records(self.ingest.decode(messages)[0]):
                if rec.run == self.run:
                    self.records.append(rec)
                    self.last = max(self.last, rec.step)
            if mark is not None and self.reader.past(mark):
                self._drained.set()

    def drain(self) -> None:
        """Once the job has ended: wait until every record on the topic now (its last) has been read."""
        self._drain.set()
        wait_for(self._drained.is_set, 60, f"the last records of {self.run}")

    def wait(self, step: int, timeout: float = 120.0) -> int:
        def reached() -> int | None:
            if self.last >= step:
                return self.last
            if self.job is not None and not self.job.is_alive():
                self.drain()
                assert self.last >= step, f"the job ended at step {self.last}, before step {step}"
            return None

        return wait_for(reached, timeout, f"step {step} of {self.run}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.reader.close()


@pytest.mark.slow
def test_a_forged_control_decision_does_not_stop_a_signed_job_and_the_services_signed_one_does(bootstrap, monkeypatch):
    """Before: one unsigned ``{"run": R, "action": "evict", "ranks": [1]}`` on the control topic
    stopped a real guarded 2-rank gloo job with exit code 16 within seconds. Now the job holds a key:
    the forged decision and one signed with another job's key are refused and the job trains to its
    last step; a decision signed with the job's key (as the service signs it) still evicts."""
    from kafka import KafkaProducer
    from sdcwatch.telemetry.wire.transports import ensure_topic
    from sdcwatch.testbed.ddp import DDPSettings

    monkeypatch.setenv("SDCWATCH_KEY", f"job-a:{KEY_A._secret.decode()}")  # every rank (spawned) holds it
    tag = uuid.uuid4().hex[:8]
    control = f"ctl.{tag}"
    base = DDPSettings(
        world=2,
        steps=400,
        run=f"guarded-{tag}",
        bootstrap=bootstrap,
        topic=f"tel.{tag}",
        control_topic=control,
        guard={"mode": "act"},
        corpus_bytes=1 << 16,
        batch_size=2,
    )
    ensure_topic(bootstrap, control, 1)  # the guard's reader is on it from the first step
    producer = KafkaProducer(bootstrap_servers=[bootstrap], linger_ms=0)

    def send(value: bytes) -> None:
        producer.send(control, key=base.run.encode(), value=value)
        producer.flush()

    def attack_then_decide(steps: _Steps) -> None:
        # at step 5: the attack as found, and a decision signed with another job's key
        send(Decision(base.run, "evict", "forged", ranks=(1,)).encode())
        send(Decision(base.run, "evict", "x", ranks=(1,), seq=time.time_ns() // 1000).sign(KEY_B))
        steps.wait(40)  # 35 steps later the job still trains; now the service's decision
        nonce = wait_for(lambda: steps.ingest.auth.nonce_of(base.run) or None, 60, "the job's start")
        now, seq = time.time(), time.time_ns() // 1000
        send(
            Decision(base.run, "evict", "rank 1 computes", ranks=(1,), issued_at=now, seq=seq, nonce=nonce).sign(KEY_A)
        )

    try:
        exit_code, records = _guarded_job(bootstrap, base, attack_then_decide)
    finally:
        producer.close()
    assert exit_code == 16, "the job did not act on the decision signed with its key"
    evicted = [r.step for r in records if r.scalars.get("guard_action") == ACTIONS.index("evict")]
    assert evicted, "no record says the guard evicted"
    assert min(evicted) >= 40, f"the job was evicted at step {min(evicted)}, by a forged decision"


def _guarded_job(bootstrap: str, settings, at_step_5) -> tuple[int, list]:
    """Run the guarded DDP job; call ``at_step_5(steps)`` once step 5 is on the bus. (exit code, records)."""
    from sdcwatch.testbed.ddp import launch
    from torch.multiprocessing import ProcessExitedException

    outcome: dict = {}

    def job() -> None:
        try:
            launch(settings)
            outcome["exit"] = 0
        except ProcessExitedException as exc:
            outcome["exit"] = exc.exit_code
        except Exception as exc:  # reported below
            outcome["error"] = exc

    steps = _Steps(bootstrap, settings.topic, settings.run)
    trainer = steps.job = threading.Thread(target=job, daemon=True)
    trainer.start()
    try:
        steps.wait(5)
        at_step_5(steps)
        trainer.join(240)
        assert not trainer.is_alive(), "the job did not finish"
        assert "error" not in outcome, outcome
        steps.drain()
        return outcome["exit"], list(steps.records)
    finally:
        steps.close()


# ---------------------------------------------------------------------------------------------
# one real service under every attack


def _own_mount_namespace() -> tuple[str, ...] | None:
    """A prefix that runs a command in a mount namespace of its own (where the test can fill or
    freeze the state folder under the service alone), or None where this machine does not allow it."""
    import shutil
    import subprocess

    if not (shutil.which("unshare") and shutil.which("nsenter")):
        return None
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
        capture_output=True,
        timeout=30,
    )
    return ("unshare", "-m") if probe.returncode == 0 else None


def _in_namespace(pid: int, *cmd: str, check: bool = True) -> bool:
    """Run ``cmd`` in the mount namespace of process ``pid``; whether it succeeded (with ``check``,
    a failure raises, naming what the command said)."""
    import subprocess

    done = subprocess.run(["nsenter", "-t", str(pid), "-m", *cmd], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise AssertionError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.returncode == 0


class _Victim:
    """A 4-rank job signed with job-a's key, sending the service what a training loop would."""

    def __init__(self, bootstrap: str, topic: str, run: str, key: JobKey) -> None:
        from sdcwatch.telemetry import Emitter

        self.run = run
        self.emitters = [
            Emitter(bootstrap=bootstrap, topic=topic, key=key, run=run, rank=r, world=4, host=f"h{r // 2}")
            for r in range(4)
        ]
        self.next = 0
        self.rng = np.random.default_rng(sum(map(ord, run)))

    def train(self, steps: int, nan_at: int | None = None, pace: float = 0.01) -> None:
        import math

        for step in range(self.next, self.next + steps):
            for em in self.emitters:  # healthy ranks: the same distribution, independent noise
                bad = step == nan_at and em.rank == 2
                noise = self.rng.normal(0.0, 0.01, 3)
                em.emit(
                    step,
                    loss=math.nan if bad else 2.0 + noise[0],
                    grad_norm_local=1.0 + noise[1],
                    grad_norm_global=1.0,
                    layers={"attn_entropy": [1.5 + noise[2], 1.6 + noise[2]]},
                )
            time.sleep(pace)
        for em in self.emitters:
            assert em.flush(60)
        self.next += steps

    def close(self) -> None:
        for em in self.emitters:
            em.close(5)


def _settled(serve, **want: float) -> list:
    """Wait until the service has read everything on its topic (lag 0, records no longer growing)
    and each ``metric=value`` floor holds; its samples then."""
    from serve_process import metric, scrape

    seen = {"records": -1.0}

    def done() -> list | None:
        samples = scrape(serve.metrics_url)
        if metric(samples, "sdcwatch_pipeline_consumer_lag_records") > 0:
            return None
        total = metric(samples, "sdcwatch_pipeline_records_total") + metric(
            samples, "sdcwatch_pipeline_dead_letters_total"
        )
        if total != seen["records"]:
            seen["records"] = total
            return None
        for name, floor in want.items():
            if metric(samples, name) < floor:
                return None
        return samples

    return wait_for(done, 120, f"the service to read everything ({want})", interval=0.5, retry_on=OSError)


def _opened(serve, run: str) -> list[dict]:
    return [e for e in serve.events() if e["change"] == "opened" and e["run"] == run]


def _forged(run: str, step: int, rank: int, world: int = 4, **scalars: float) -> bytes:
    from sdcwatch.core.record import encode
    from sdcwatch.core.record_type import Record

    return encode(Record(run, step, rank, world, "evil", time.time(), 0, scalars or {"loss": 1.0}, {}, {}))


def _flood_schemas(n: int, runs: int) -> list[tuple[bytes, bytes]]:
    """``n`` valid v2 messages, each carrying a layout of its own, under ``runs`` run names."""
    import numpy as np
    from sdcwatch.core.columnar import encode_rows
    from sdcwatch.core.record_layout import Schema

    out = []
    for i in range(n):
        schema = Schema(("loss", f"m{i}"), (), (), ())
        rows = np.zeros(1, schema.dtype)
        rows["step"], rows["rank"], rows["world"], rows["time"] = i // runs, 0, 1, time.time()
        run = f"flood-{i % runs}"
        out.append((run.encode(), KEY_B.sign(encode_rows(schema, run, ["x"], rows.tobytes(), 1, with_schema=True))))
    return out


def _dead_letters(bootstrap: str, topic: str) -> list[tuple[str, str]]:
    """(run, reason code) of every dead letter on ``topic`` (signed ones opened with the test's keys)."""
    from serve_process import peek_topic
    from sdcwatch.core.columnar import MAGIC_V2, parse_header
    from sdcwatch.core.messages import decode_message
    from sdcwatch.core.signing import is_signed

    ring = Keyring([KEY_A, KEY_B])
    out = []
    for m in peek_topic(bootstrap, topic):
        reason = dict(m.headers).get("sdcwatch.reason_code", b"").decode()
        value = ring.verify(m.value)[1] if is_signed(m.value) else m.value
        try:
            runs = [parse_header(value).run] if value[:4] == MAGIC_V2 else [r.run for r in decode_message(value)]
        except Exception:  # not a record at all
            runs = ["?"]
        out += [(run, reason) for run in runs]
    return out


def _nan_incident(serve, run: str, step: int) -> dict:
    inc = wait_for(
        lambda: next((e for e in _opened(serve, run) if e["first_step"] == step), None),
        90,
        f"the NaN of {run} at step {step}",
        interval=0.5,
    )
    assert inc["kind"] == "nonfinite" and inc["ranks"] == [2], inc
    return inc


@pytest.mark.slow
def test_signed_runs_are_watched_through_forgeries_floods_and_a_sigkill_on_one_real_service(bootstrap, tmp_path):
    """Before, on this service and broker: 11 forged records "from rank 3" opened a critical
    incident blaming rank 3; forged end markers ended a run; 1,000 one-record runs locked every new
    run out for 15 minutes; a schema flood dead-lettered 35-72% of a v2 run's messages and its NaN was
    missed; a SIGKILL announced an incident twice. Each attack here waits for the service to read
    what came before it, and each phase has a real NaN that must be found at its step and rank.
    The run table is a fifth of its default size (detectors.max_runs 200), so the junk that fills
    it, as 1,000 one-record runs filled the default one, is a fifth as long to send and read."""
    from kafka import KafkaProducer
    from serve_process import ServeProcess, Topics, metric, peek_topic
    from sdcwatch.core.messages import end_marker
    from sdcwatch.core.rank_notes import CheckpointMark, CheckpointNote, encode_note

    keys = tmp_path / "keys"
    keys.write_text(f"job-a:{KEY_A._secret.decode()}\njob-b:{KEY_B._secret.decode()}\n")
    topics, group, state = Topics.fresh(), f"trust-{uuid.uuid4().hex[:8]}", tmp_path / "state"
    flags = ("--auth-key-file", str(keys), "--detectors-align-timeout-s", "2", "--detectors-max-runs", str(MAX_RUNS))

    def start(snapshot_s: float) -> ServeProcess:
        serve = ServeProcess(bootstrap, topics, state, *flags, group=group, snapshot_interval_s=snapshot_s)
        serve.wait_banner()
        return serve

    serve = start(1)
    victim = _Victim(bootstrap, topics.telemetry, "victim", KEY_A)
    producer = KafkaProducer(bootstrap_servers=[bootstrap], linger_ms=5, max_request_size=4 << 20)
    send = lambda value, key=b"evil": producer.send(topics.telemetry, key=key, value=value)  # noqa: E731
    try:
        victim.train(20)
        _settled(serve, sdcwatch_training_last_step=19)

        # 1. forged records and end markers: unsigned, and signed with another job's key
        for sign in (lambda v: v, KEY_B.sign):
            for step in range(20, 23):
                send(sign(_forged("victim", step, 3, loss=float("nan"), nonfinite=1.0)))
            for rank in range(4):
                send(sign(_encode(end_marker("victim", 20, rank, 4))))
        producer.flush()
        samples = _settled(serve, sdcwatch_pipeline_dead_letters_total=14)
        assert metric(samples, "sdcwatch_pipeline_dead_letters_by_reason_total", reason="auth") == 14
        assert metric(samples, "sdcwatch_training_run_finished", run="victim") == 0
        victim.train(30, nan_at=35)  # steps 20-49
        _nan_incident(serve, "victim", 35)
        assert not [e for e in serve.events() if 3 in e.get("ranks", [])], "an incident names the forged rank"
        victim.emitters[0].checkpoint(45, "/real/c-45")  # the job's checkpoint, marked once step 49 is judged
        victim.train(5)  # steps 50-54
        wait_for(
            lambda: _checkpoints(bootstrap, topics.anomalies, keys, "victim")[0]["checkpoints"] or None, 60, "c-45"
        )

        # 2. as many one-record runs and checkpoint notes of other runs as the service keeps runs
        # (another job's key: an insider), forged checkpoint markings on the anomalies topic, then a new real run
        for i in range(MAX_RUNS):
            send(KEY_B.sign(_forged(f"junk-{i}", 0, 0, world=1)), key=f"junk-{i}".encode())
            send(KEY_B.sign(encode_note(CheckpointNote(f"note-{i}", 0, 1, 1, f"/junk/{i}"))), key=b"n")
        for sign in (lambda v: v, KEY_B.sign):  # before: `sdcwatch checkpoints` believed the unsigned one
            mark = CheckpointMark("victim", 54, "/attacker/x", "clean", (), "no incident before it")
            value = sign(json.dumps({"change": "checkpoint", **mark.to_dict()}).encode())
            producer.send(topics.anomalies, key=mark.id.encode(), value=value)
        producer.flush()
        samples = _settled(serve)
        refused_before = metric(samples, "sdcwatch_pipeline_dead_letters_by_reason_total", reason="runs")
        fresh = _Victim(bootstrap, topics.telemetry, "fresh", KEY_A)
        fresh.train(80, nan_at=70, pace=0.1)  # a training run keeps sending: 8 s at 10 steps a second
        _nan_incident(serve, "fresh", 70)
        samples = _settled(serve)
        waited = metric(samples, "sdcwatch_pipeline_dead_letters_by_reason_total", reason="runs") - refused_before
        assert waited < 40 * 4, f"the new run waited {waited / 4:.0f} of its 80 steps (over 4 s) for a place"
        fresh.close()  # its end markers: the run finished
        listing, refusals = _checkpoints(bootstrap, topics.anomalies, keys, "victim")
        assert [(c["step"], c["path"]) for c in listing["checkpoints"]] == [(45, "/real/c-45")], listing
        assert "/attacker/x" not in json.dumps(listing) and "2 messages refused: 2 auth" in refusals
        assert "/attacker/x" not in json.dumps(serve.events())  # what the service signed, as a reader opens it

        # 2b. the finished run's own signed messages replayed (its NaN at 70, its end markers) while
        # the next run of that name (a new start of the job: a new signer) trains
        replayed = [(m.key, m.value) for m in peek_topic(bootstrap, topics.telemetry) if m.key.startswith(b"fresh")]
        again = _Victim(bootstrap, topics.telemetry, "fresh", JobKey("job-a", KEY_A._secret))
        samples = _settled(serve)
        refused_before = metric(samples, "sdcwatch_auth_runs_refused_total", key="job-a", reason="replayed")
        again.train(10)
        for k, v in replayed:
            send(v, key=k)
        producer.flush()
        again.train(40, nan_at=30)
        _nan_incident(serve, "fresh", 30)  # the new run is not blind, and rank 2 is named, not framed
        samples = _settled(serve, sdcwatch_training_last_step=49)
        assert metric(samples, "sdcwatch_auth_runs_refused_total", key="job-a", reason="replayed") - refused_before == (
            len(replayed)
        )
        assert sorted(e["first_step"] for e in _opened(serve, "fresh")) == [30, 70], "the replayed NaN reopened"
        assert metric(samples, "sdcwatch_training_run_finished", run="fresh") == 0, "a replayed end marker ended it"
        again.close()

        # 3. a schema flood while the victim trains on the default wire (v2)
        forged = len([1 for run, _ in _dead_letters(bootstrap, topics.dead) if run == "victim"])
        assert forged == 14  # the forgeries of phase 1, and nothing of the victim's own
        flood = _flood_schemas(6_500, runs=100)  # past both bounds: 64 layouts a run, 1,024 in all
        flooder = threading.Thread(target=lambda: [send(v, key=k) for k, v in flood] and producer.flush())
        flooder.start()
        victim.train(100, nan_at=120)  # steps 50-149: the first incident resolves, a new one opens
        flooder.join(120)
        _settled(serve)
        _nan_incident(serve, "victim", 120)
        lost = [reason for run, reason in _dead_letters(bootstrap, topics.dead) if run == "victim"][forged:]
        assert lost == [], f"the victim's messages were dead-lettered: {lost[:5]}"

        # 4. SIGKILL after an incident was announced and before a snapshot held it
        serve.stop()
        serve = start(600)  # no periodic snapshot: the kill loses everything since the start
        victim.train(70, nan_at=200)  # steps 150-219
        _nan_incident(serve, "victim", 200)
        serve.proc.kill()
        serve.wait()
        serve = start(1)
        victim.train(10)  # steps 220-229
        _settled(serve, sdcwatch_training_last_step=229)
        ids = [e["id"] for e in _opened(serve, "victim")]
        assert sorted(ids) == sorted(set(ids)), f"an incident was announced twice: {ids}"
        assert {e["first_step"] for e in _opened(serve, "victim")} == {35, 120, 200}
        assert serve.running()
    finally:
        producer.close()
        victim.close()
        serve.close()


def _checkpoints(bootstrap: str, topic: str, keys, run: str) -> tuple[dict, str]:
    """``sdcwatch checkpoints --run RUN --json`` with the service's key file: (its listing, its stderr)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "sdcwatch.cli", "checkpoints", "--run", run, "--json", "--auth-key-file", str(keys)]
    out = subprocess.run(
        [*cmd, "--bootstrap", bootstrap, "--topic", topic], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout), out.stderr


def _encode(rec) -> bytes:
    from sdcwatch.core.record import encode

    return encode(rec)


def test_serve_survives_a_full_and_a_read_only_state_folder_and_finds_the_fault_meanwhile(bootstrap, tmp_path):
    """Before: a full or read-only state folder crashed `sdcwatch serve` at its next snapshot
    (uncaught OSError, exit 1), and again after every restart. The folder is filled (a 256 KiB file
    system mounted over it) and then made read-only under the running service, in a mount
    namespace of its own: each snapshot fails, is counted, detection goes on, and once the
    folder is back the state is written again."""
    from serve_process import ServeProcess, Topics, metric

    prefix = _own_mount_namespace()
    if prefix is None:
        pytest.skip("this machine does not let a process mount a file system in a namespace of its own (unshare -m)")
    keys = tmp_path / "keys"
    keys.write_text(f"job-a:{KEY_A._secret.decode()}\n")
    topics, state = Topics.fresh(), tmp_path / "state"
    state.mkdir()
    serve = ServeProcess(bootstrap, topics, state, "--auth-key-file", str(keys), snapshot_interval_s=0.5, prefix=prefix)
    serve.wait_banner()
    victim = _Victim(bootstrap, topics.telemetry, "disk", KEY_A)
    try:
        victim.train(20)
        _settled(serve, sdcwatch_training_last_step=19)
        assert (state / "pipeline-state.json").is_file()

        def errors() -> float:
            return metric(serve.scrape(), "sdcwatch_state_write_errors_total")

        _in_namespace(serve.pid, "mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(state))  # full
        _in_namespace(serve.pid, "sh", "-c", f"dd if=/dev/zero of={state}/fill bs=4k 2>/dev/null; true")
        victim.train(30, nan_at=30)  # steps 20-49
        _nan_incident(serve, "disk", 30)
        wait_for(lambda: errors() >= 2 or None, 30, "failed snapshots counted (disk full)")
        full_errors = errors()
        _in_namespace(serve.pid, "umount", "--lazy", str(state))  # a snapshot may hold a file open there

        _in_namespace(serve.pid, "mount", "--bind", str(state), str(state))  # read-only
        # a mount with a file open for writing cannot turn read-only (EBUSY): the service writes a
        # snapshot every 0.5 s, so the remount is tried until it falls between two of them
        wait_for(
            lambda: _in_namespace(serve.pid, "mount", "-o", "remount,ro,bind", str(state), check=False),
            30,
            "the state folder remounted read-only between two snapshots",
        )
        victim.train(70, nan_at=100)  # steps 50-119
        _nan_incident(serve, "disk", 100)
        wait_for(lambda: errors() >= full_errors + 2 or None, 30, "failed snapshots counted (read-only)")
        _in_namespace(serve.pid, "umount", "--lazy", str(state))

        written = (state / "pipeline-state.json").stat().st_mtime
        wait_for(
            lambda: (state / "pipeline-state.json").stat().st_mtime > written or None, 30, "the state written again"
        )
        assert serve.running()
        assert "No space left on device" in serve.stderr() and "Read-only file system" in serve.stderr()
    finally:
        victim.close()
        serve.close()
