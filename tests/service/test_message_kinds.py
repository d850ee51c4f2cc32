"""Every kind of message a transport writes, read back by every reader: the registry's promise.

A job with layer names and a checkpoint note sends records (v1 or v2), its names, its GPU, the note and
the end-of-run marker, signed or not, through the in-memory and the file transport; the one decoder
(:func:`~sdcwatch.core.messages.decode_message`), the service's ingest, ``sdcwatch capture``,
``sdcwatch replay`` and the report read all of it. (The Kafka transport: tests/cli/test_capture.py.)
"""

from __future__ import annotations

import io
import json

import pytest
from message_job import STEPS, assert_complete_and_in_order, order_of, run_job
from sdcwatch.capture import Capture
from sdcwatch.core.messages import KINDS, decode_line, decode_message, decode_stream
from sdcwatch.core.rank_notes import CheckpointNote, LayerNames, RankDevice
from sdcwatch.core.signing import AuthError, JobKey, Keyring
from sdcwatch.report.data import load_records
from sdcwatch.service.auth import Authenticator
from sdcwatch.service.ingest import IngestDecoder, as_records
from sdcwatch.service.offline import read_records, replay
from sdcwatch.telemetry import FileTransport, MemoryBus, MemoryTransport

KEY = JobKey("job-k", b"k" * 32)
RING = Keyring([KEY])


def test_every_kind_has_its_own_prefix():
    prefixes = [k.prefix for k in KINDS if k.prefix is not None and k.decode is not None]
    assert len(prefixes) == len(set(prefixes)), prefixes
    assert b"SDCS" in prefixes and all(len(p) == 4 for p in prefixes)


@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
@pytest.mark.parametrize("wire", ["v1", "v2"])
def test_the_memory_transport_writes_every_kind_and_every_reader_reads_it(wire, key, tmp_path):
    bus = MemoryBus()
    em = run_job(MemoryTransport(bus), wire, key)
    values = [v for _, v in bus.messages(em.transport.topic)]
    schemas: dict = {}
    decoded = [m for v in values for m in decode_message(v, schemas=schemas, keyring=RING)]
    assert_complete_and_in_order(order_of(decoded))
    assert len(decode_stream(values, keyring=RING)) == STEPS + 1  # the records (and the marker)
    if key is not None:
        with pytest.raises(AuthError, match="no keyring"):
            decode_message(values[0])  # a signed message is never read as if it were not
    # the service's ingest, with and without keys
    ingest = IngestDecoder(auth=Authenticator(RING, unsigned="accept"))
    items, rejected = ingest.decode(("t", None, v) for v in values)
    assert not rejected and len(as_records(items)) == STEPS + 1
    assert {type(x) for x in items} >= {LayerNames, CheckpointNote, RankDevice}
    # sdcwatch capture, then sdcwatch replay and the report of its file
    out = io.StringIO()
    cap = Capture("kinds", out, RING)
    assert cap.take(values) == STEPS + 1 and not cap.refused and cap.finished
    path = tmp_path / "cap.jsonl"
    path.write_text(out.getvalue())
    assert_complete_and_in_order(order_of(list(read_records(path, names=True))))
    assert replay(path) == [] and load_records(path).records == STEPS


def test_the_file_transport_writes_every_kind_in_the_order_it_was_made_and_replay_reads_it(tmp_path):
    """Two users' bugs: a FileTransport capture of a job that reports checkpoints did not replay
    ("bad record field 'kind': unknown field"), and the note of step 20 was written before the
    records of steps 0-19."""
    path = tmp_path / "cap.jsonl"
    run_job(FileTransport(path), "v2")
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)
    assert_complete_and_in_order(order_of([decode_line(line) for line in lines]))
    assert_complete_and_in_order(order_of(list(read_records(path, names=True))))
    assert replay(path) == []
    assert load_records(path).records == STEPS and load_records(path).finished


def test_a_signed_message_that_does_not_verify_is_refused_with_its_reason():
    bus = MemoryBus()
    em = run_job(MemoryTransport(bus), "v2", JobKey("other", b"o" * 32))
    values = [v for _, v in bus.messages(em.transport.topic)]
    cap = Capture("kinds", io.StringIO(), RING)
    assert cap.take(values) == 0
    assert cap.refused.counts == {"auth": len(values)}
    assert "'other', which this service does not hold" in cap.refused.describe()
    unkeyed = Capture("kinds", io.StringIO())
    assert unkeyed.take(values) == 0 and unkeyed.refused.counts == {"auth": len(values)}
    assert "no keyring to verify it" in unkeyed.refused.describe()  # named, not "undecodable"
