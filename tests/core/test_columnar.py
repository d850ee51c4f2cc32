"""Wire format v2: schemas, packed records, messages, and the emitter that sends them."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sdcwatch.core.columnar import MAGIC_V2, encode_rows, parse_header
from sdcwatch.core.messages import decode_stream, encode_items
from sdcwatch.core.errors import ConfigError, RecordError
from sdcwatch.core.mesh import DIMS
from sdcwatch.core.record import MAGIC, record_key
from sdcwatch.core.record_layout import PackedRecord, Schema, schema_for
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import RUN_END
from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport

f32 = st.floats(width=32, allow_nan=False)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)


@st.composite
def records(draw):
    scalars = draw(st.dictionaries(names, st.floats(allow_nan=True), max_size=6))
    fps = draw(st.dictionaries(names, st.integers(0, (1 << 64) - 1), max_size=3))
    layers = draw(st.dictionaries(names, st.lists(f32, max_size=5).map(tuple), max_size=3))
    world = draw(st.integers(1, 1 << 20))
    dims = draw(st.lists(st.sampled_from(DIMS), unique=True, max_size=len(DIMS)))
    coords = {d: draw(st.integers(0, world - 1)) for d in DIMS if d in dims}
    return Record(
        draw(st.text(min_size=1, max_size=8)),
        draw(st.integers(0, (1 << 63) - 1)),
        draw(st.integers(0, world - 1)),
        world,
        draw(st.text(max_size=8).filter(lambda s: "\n" not in s)),
        draw(st.floats(allow_nan=False, allow_infinity=False)),
        draw(st.integers(0, 1 << 16)),
        scalars,
        fps,
        layers,
        coords,
    )


def pack(rec: Record) -> PackedRecord:
    return PackedRecord.from_record(rec)


def same(a: Record, b: Record) -> bool:
    """Equal, NaN equal to NaN."""
    eq = lambda x, y: x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))  # noqa: E731
    return (a.key, a.world, a.host, a.time, a.local_rank, a.fingerprints, a.layers, a.coords) == (
        b.key,
        b.world,
        b.host,
        b.time,
        b.local_rank,
        b.fingerprints,
        b.layers,
        b.coords,
    ) and (list(a.scalars) == list(b.scalars) and all(eq(a.scalars[k], b.scalars[k]) for k in a.scalars))


@settings(max_examples=200, deadline=None)
@given(records())
def test_a_packed_record_round_trips(rec):
    try:
        rec.run.encode("utf-8"), rec.host.encode("utf-8")
    except UnicodeEncodeError:
        return
    p = pack(rec)
    assert same(p.to_record(), rec)
    (back,) = decode_stream([encode_items([p], record_key, 256, set())[0][1]])
    assert same(back, rec)


def test_schema_id_is_the_hash_of_its_text_and_the_text_is_canonical():
    sch = schema_for(("loss", "lr"), ("grad_fp",), (("attn_entropy", 4),))
    assert Schema.from_text(sch.text) == sch and Schema.from_text(sch.text).id == sch.id
    assert schema_for(("lr", "loss")).id != schema_for(("loss", "lr")).id
    with pytest.raises(RecordError, match="canonical"):
        Schema.from_text(sch.text.replace(b",", b", "))
    with pytest.raises(RecordError, match="bad metric name"):
        schema_for(("bad name!",))
    with pytest.raises(RecordError, match="twice"):
        schema_for(("loss", "loss"))
    with pytest.raises(RecordError, match="layers"):
        Schema.from_text(b'{"scalars":[],"fingerprints":[],"layers":[["a",-1]]}')


def test_schema_rides_with_the_first_message_of_each_key_only():
    sent: set = set()
    recs = [pack(Record("r", s, 0, 1, "h", 1.0, 0, {"loss": 1.0})) for s in range(40)]
    msgs = [encode_items([p], record_key, 256, sent)[0] for p in recs]
    inline = [parse_header(v).schema_text is not None for _, v, _ in msgs]
    assert inline == [s % 16 == 0 for s in range(40)]  # keys are 16-step windows
    assert [r.step for r in decode_stream(v for _, v, _ in msgs)] == list(range(40))
    with pytest.raises(RecordError, match="unknown schema"):
        decode_stream([msgs[1][1]])  # alone, a message without its schema cannot be read


def test_mixed_items_become_v1_and_v2_messages():
    v1 = Record("r", 3, 1, 2, "h1", 1.0, 0, {"loss": 2.0})
    v2 = pack(Record("r", 3, 0, 2, "h0", 1.0, 0, {"loss": 1.0}))
    out = encode_items([v1, v2], record_key, 256, set())
    assert sorted(v[:4] for _, v, _ in out) == sorted([MAGIC, MAGIC_V2])
    assert sorted((r.rank, r.host) for r in decode_stream(v for _, v, _ in out)) == [(0, "h0"), (1, "h1")]


def test_bad_v2_messages_name_the_field():
    sch = schema_for(("loss",))
    good = encode_rows(sch, "r", ["h"], sch.struct.pack(1, 0, 1, 0, 0, 1.0, 2.0), 1, with_schema=True)
    with pytest.raises(RecordError, match="records"):
        decode_stream([good[:-1]])
    with pytest.raises(RecordError, match="truncated"):
        parse_header(good[:12])
    forged = bytearray(good)
    forged[10] ^= 1  # the schema id no longer matches the schema sent with it
    with pytest.raises(RecordError, match="schema id"):
        decode_stream([bytes(forged)])
    wrong_length = bytearray(good)
    wrong_length[6] ^= 1
    with pytest.raises(RecordError, match="header length"):
        parse_header(bytes(wrong_length))
    with pytest.raises(RecordError, match="version"):
        parse_header(good[:4] + b"\x07" + good[5:])


def test_emitter_sends_v2_by_default_and_v1_on_request():
    for wire, magics in (("v2", {MAGIC_V2}), ("v1", {MAGIC, b"SDCB"})):
        bus = MemoryBus()
        with Emitter(MemoryTransport(bus), run="r", rank=1, world=2, host="h", wire=wire) as em:
            for step in range(20):
                em.emit(step, loss=0.5 * step, layers={"attn_entropy": [1.0, 2.5]}, fingerprints={"grad_fp": step})
                em.emit(100 + step, loss=1.0)  # a second layout, as on unsampled steps
            assert em.flush(5)
        *data, marker = bus.messages("sdcwatch.telemetry")  # close() ends the run with a v1 marker
        assert {v[:4] for _, v in data} <= magics and marker[1][:4] == MAGIC
        recs = sorted((r for r in bus.records() if RUN_END not in r.scalars), key=lambda r: r.step)
        assert [r.step for r in recs] == list(range(20)) + list(range(100, 120))
        r = recs[7]
        assert (r.run, r.rank, r.world, r.host, r.scalars, r.layers, r.fingerprints) == (
            "r",
            1,
            2,
            "h",
            {"loss": 3.5, "emitter_dropped": 0.0},
            {"attn_entropy": (1.0, 2.5)},
            {"grad_fp": 7},
        )
    assert Emitter(MemoryTransport(MemoryBus()), env={"SDCWATCH_WIRE": "v1"}).wire == "v1"
    with pytest.raises(ConfigError) as info:
        Emitter(MemoryTransport(MemoryBus()), wire="v3")
    assert info.value.key == "wire"


def test_v2_emitter_counts_bad_records_as_invalid_and_sends_the_rest():
    bus = MemoryBus()
    with Emitter(MemoryTransport(bus), run="r", rank=0, world=1, host="h") as em:
        em.emit(1, loss="x")
        em.emit(2, **{"bad name!": 1.0})
        em.emit(3, layers={"a": object()})
        em.emit(-1, loss=1.0)
        em.emit(4, fingerprints={"fp": -3})
        em.emit(5, time=math.inf, loss=1.0)
        em.emit(6, loss=math.nan)
        assert em.flush(5)
    assert [r.step for r in bus.records() if RUN_END not in r.scalars] == [6] and em.invalid == 6


def test_the_codec_keeps_the_training_rank_light():
    code = (
        "import sys, sdcwatch.core.columnar, sdcwatch.telemetry; "
        "print([m for m in ('torch', 'kafka', 'scipy', 'river') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_schema_without_coordinates_keeps_its_text_and_id_and_one_with_them_carries_them():
    plain = schema_for(("loss",))
    assert plain.text == b'{"scalars":["loss"],"fingerprints":[],"layers":[]}'
    placed = schema_for(("loss",), coords=("pp", "tp"))
    assert placed.id != plain.id and Schema.from_text(placed.text) == placed
    assert placed.row_size == plain.row_size + 8
    with pytest.raises(RecordError, match="mesh dims"):
        schema_for(("loss",), coords=("pp", "pp"))
    with pytest.raises(RecordError, match="mesh dims"):
        Schema.from_text(b'{"scalars":[],"fingerprints":[],"layers":[],"coords":["warp"]}')


def test_the_emitter_puts_coordinates_from_the_environment_on_every_record():
    bus = MemoryBus()
    env = {"RANK": "5", "WORLD_SIZE": "16", "SDCWATCH_MESH": "tp=2,pp=2,dp=4", "SDCWATCH_RUN": "r"}
    for wire in ("v1", "v2"):
        with Emitter(MemoryTransport(bus), env=env, wire=wire, end_marker=False) as em:
            em.emit(1, loss=1.0)
        assert em.coords == {"pp": 0, "dp_replicate": 2, "tp": 1}
    assert [r.coords for r in bus.records()] == [{"pp": 0, "dp_replicate": 2, "tp": 1}] * 2
    explicit = {"RANK": "5", "WORLD_SIZE": "16", "SDCWATCH_COORDS": "pp=1,dp=0,tp=1"}
    assert Emitter(MemoryTransport(MemoryBus()), env=explicit).coords == {"pp": 1, "dp_replicate": 0, "tp": 1}
    with pytest.raises(ConfigError, match="SDCWATCH_MESH"):
        Emitter(MemoryTransport(MemoryBus()), env={"WORLD_SIZE": "8", "SDCWATCH_MESH": "tp=2,pp=2,dp=4"})
    with pytest.raises(ConfigError, match="unknown mesh dim 'warp'"):
        Emitter(MemoryTransport(MemoryBus()), env={"WORLD_SIZE": "8", "SDCWATCH_COORDS": "warp=1"})
    with pytest.raises(ConfigError, match=r"coords.tp"):
        Emitter(MemoryTransport(MemoryBus()), world=2, coords={"tp": 3})
