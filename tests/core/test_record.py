"""The wire record: round trips, and a decoder that only ever fails with RecordError."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sdcwatch.core.errors import RecordError, SdcwatchError, UnknownVersionError
from sdcwatch.core.mesh import DIMS, MAX_COORD
from sdcwatch.core.record import MAGIC, decode, decode_records, encode, encode_batch, from_json, to_json
from sdcwatch.core.record_type import Record

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,20}", fullmatch=True)
f32 = st.floats(width=32, allow_nan=False)  # layer vectors travel as float32
f64 = st.floats(allow_nan=False)


@st.composite
def records(draw):
    world = draw(st.integers(1, 70_000))
    return Record(
        run=draw(st.text(min_size=1, max_size=30)),
        step=draw(st.integers(0, 2**64 - 1)),
        rank=draw(st.integers(0, world - 1)),
        world=world,
        host=draw(st.text(max_size=30)),
        time=draw(st.floats(allow_nan=False, allow_infinity=False)),
        local_rank=draw(st.integers(0, 2**32 - 1)),
        scalars=draw(st.dictionaries(names, f64, max_size=12)),
        fingerprints=draw(st.dictionaries(names, st.integers(0, 2**64 - 1), max_size=4)),
        layers=draw(st.dictionaries(names, st.lists(f32, max_size=40).map(tuple), max_size=8)),
        coords=draw(st.dictionaries(st.sampled_from(DIMS), st.integers(0, MAX_COORD - 1), max_size=len(DIMS))),
    )


def _valid(rec: Record) -> bool:
    try:
        rec.run.encode("utf-8")
        rec.host.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(records())
def test_binary_round_trip(rec):
    if not _valid(rec):
        with pytest.raises(RecordError):
            encode(rec)
        return
    assert decode(encode(rec)) == rec


@settings(max_examples=200, deadline=None)
@given(records())
def test_json_round_trip(rec):
    if not _valid(rec):
        return
    assert from_json(to_json(rec)) == rec


@settings(max_examples=100, deadline=None)
@given(st.lists(records(), min_size=1, max_size=5))
def test_batch_round_trip(recs):
    recs = [r for r in recs if _valid(r)]
    assert decode_records(encode_batch(recs)) == recs


def test_non_finite_values_survive_both_codecs():
    rec = Record(
        "r",
        3,
        1,
        4,
        "h",
        1.5,
        0,
        {"loss": math.nan, "grad_norm_local": math.inf},
        {},
        {"attn_logit_max": (1e10, -math.inf, math.nan)},
    )
    for back in (decode(encode(rec)), from_json(to_json(rec))):
        assert math.isnan(back.scalars["loss"]) and back.scalars["grad_norm_local"] == math.inf
        v = back.layers["attn_logit_max"]
        assert v[0] == pytest.approx(1e10, rel=1e-6) and v[1] == -math.inf and math.isnan(v[2])
    assert "NaN" in to_json(rec) and "Infinity" in to_json(rec)  # strict JSON, no bare NaN


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_record_error(data):
    try:
        decode_records(data)
    except RecordError:
        pass


@settings(max_examples=400, deadline=None)
@given(records(), st.data())
def test_corrupted_records_raise_only_record_error(rec, data):
    if not _valid(rec):
        return
    buf = bytearray(encode(rec))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    for candidate in (bytes(buf), bytes(buf[:cut])):
        try:
            decode(candidate)
        except RecordError:
            pass


def test_unknown_version_is_rejected_not_guessed():
    buf = bytearray(encode(Record("r", 1, 0, 1)))
    buf[4] = 3  # 1: no coordinates, 2: with coordinates
    with pytest.raises(UnknownVersionError) as info:
        decode(bytes(buf))
    assert info.value.field == "version" and "3" in str(info.value)
    assert isinstance(info.value, SdcwatchError)
    with pytest.raises(UnknownVersionError):
        from_json('{"v": 7, "run": "r", "step": 1, "rank": 0, "world": 1}')


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:10], "header"),
        (lambda b: b + b"\0", "record"),
    ],
)
def test_errors_name_the_field(mutate, field):
    buf = encode(Record("run", 5, 1, 2, "host", 1.0, 0, {"loss": 1.0}))
    with pytest.raises(RecordError) as info:
        decode(mutate(buf))
    assert info.value.field == field


def test_rank_outside_world_is_named():
    head = struct.pack("<4sBQIIId", MAGIC, 1, 1, 5, 4, 0, 0.0) + b"\x01\x00r\x00\x00" + b"\0\0\0"
    with pytest.raises(RecordError) as info:
        decode(head)
    assert info.value.field == "rank"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(run=""), "run"),
        (dict(rank=4, world=4), "rank"),
        (dict(step=-1), "step"),
        (dict(scalars={"bad name": 1.0}), "scalars.bad name"),
        (dict(scalars={"loss": "high"}), "scalars.loss"),
        (dict(fingerprints={"param_fp": -3}), "fingerprints.param_fp"),
        (dict(layers={"attn_entropy": "abc"}), "layers.attn_entropy"),
        (dict(time=math.nan), "time"),
    ],
)
def test_make_validates(kwargs, field):
    base = dict(run="r", step=0, rank=0, world=4)
    base.update(kwargs)
    with pytest.raises(RecordError) as info:
        Record.make(**base)
    assert info.value.field == field


@pytest.mark.parametrize(
    "line, field",
    [
        ("not json", "record"),
        ("[1, 2]", "record"),
        ('{"run": "r", "step": 1, "rank": 0, "world": 1}', "v"),
        ('{"v": 1, "step": 1, "rank": 0, "world": 1}', "run"),
        ('{"v": 1, "run": "r", "step": 1, "rank": 0, "world": 1, "extra": 1}', "extra"),
        ('{"v": 1, "run": "r", "step": 1, "rank": 0, "world": 1, "scalars": {"loss": "x"}}', "scalars.loss"),
        ('{"v": 1, "run": "r", "step": 1, "rank": 0, "world": 1, "layers": {"q_norm_max": 3}}', "layers.q_norm_max"),
    ],
)
def test_json_errors_name_the_field(line, field):
    with pytest.raises(RecordError) as info:
        from_json(line)
    assert info.value.field == field


def test_batch_errors_are_record_errors():
    good = encode_batch([Record("r", 1, 0, 1), Record("r", 2, 0, 1)])
    with pytest.raises(RecordError) as info:
        decode_records(good[:-3])
    assert info.value.field == "batch"
    with pytest.raises(RecordError) as info:
        decode_records(good + b"zz")
    assert info.value.field == "batch"


def test_coordinates_travel_in_version_2_and_records_without_them_stay_version_1():
    plain = Record("r", 3, 1, 16, "h", 1.0, 0, {"loss": 2.0})
    placed = Record("r", 3, 1, 16, "h", 1.0, 0, {"loss": 2.0}, coords={"pp": 1, "dp_replicate": 3, "tp": 0})
    assert encode(plain)[4] == 1 and encode(placed)[4] == 2
    assert decode(encode(placed)).coords == {"pp": 1, "dp_replicate": 3, "tp": 0}
    assert decode(encode(plain)).coords == {}
    assert from_json(to_json(placed)) == placed and '"coords"' not in to_json(plain)


@pytest.mark.parametrize(
    "coords, field",
    [
        ({"tensor_x": 1}, "coords.tensor_x"),
        ({"tp": -1}, "coords.tp"),
        ({"tp": 1.5}, "coords.tp"),
        ({"tp": True}, "coords.tp"),
        ({"pp": MAX_COORD}, "coords.pp"),
    ],
)
def test_bad_coordinates_are_named(coords, field):
    with pytest.raises(RecordError) as info:
        Record.make(run="r", step=1, rank=0, world=4, coords=coords)
    assert info.value.field == field


def test_a_corrupt_coordinate_section_is_a_record_error_naming_coords():
    buf = encode(Record("r", 3, 1, 16, coords={"tp": 1}))
    with pytest.raises(RecordError, match="coords"):
        decode(buf[:-2])  # truncated index
    bad_dim = bytearray(buf)
    bad_dim[-5] = 9  # dim index past DIMS
    with pytest.raises(RecordError, match="mesh dim"):
        decode(bytes(bad_dim))
    empty = bytearray(buf[:-5])
    empty[-1] = 0  # version 2 with no coordinates
    with pytest.raises(RecordError, match="coords"):
        decode(bytes(empty))
