"""The layer-names message: round trips on the binary and JSON wires, and what hostile bytes get."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
from sdcwatch.core.errors import RecordError, UnknownVersionError
from sdcwatch.core.messages import decode_line, encode_line
from sdcwatch.core.rank_notes import (
    MAX_FAMILY_NAMES,
    MAX_LAYER_NAME_BYTES,
    MAX_TEXT_BYTES,
    LayerNames,
    clean_names,
    decode_names,
    encode_names,
)
from sdcwatch.core.vocabulary import family_of
from sdcwatch.core.limits import LimitError, RecordLimits, reason_of

PRODUCTS = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "mlp.gate_proj")]
NAMES = {
    "products": PRODUCTS,
    "blocks": ["model.layers.0", "model.layers.1"],
    "layers": ["model.layers.0.self_attn", "model.layers.1.self_attn"],
    "modules": PRODUCTS + ["lm_head"],
}


def _msg(**kw) -> LayerNames:
    args = dict(run="run-a", rank=3, world=8, step=17, names=NAMES) | kw
    return LayerNames.build(**args)


def _raw(text: bytes, *, digest: int | None = None, run: bytes = b"r", rank: int = 0, world: int = 1) -> bytes:
    """A names message assembled by hand (a hostile writer's tool)."""
    import hashlib

    if digest is None:
        digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    payload = zlib.compress(text)
    head = struct.pack("<4sBQIIQ", b"SDCN", 1, 5, rank, world, digest)
    return head + struct.pack("<H", len(run)) + run + struct.pack("<I", len(payload)) + payload


def test_binary_round_trip_keeps_every_list_and_the_digest():
    msg = _msg()
    back = decode_names(encode_names(msg), RecordLimits())
    assert (back.run, back.rank, back.world, back.step) == ("run-a", 3, 8, 17)
    assert back.names == {k: tuple(v) for k, v in NAMES.items()}
    assert back.digest == msg.digest
    named = {m: back.names[family_of(m)] for m in ("gemm_out", "stream_max", "attn_entropy")}
    assert named["gemm_out"][3] == "model.layers.1.mlp.gate_proj"
    assert named["stream_max"][1] == "model.layers.1"
    assert named["attn_entropy"][0] == "model.layers.0.self_attn"
    assert len(named["gemm_out"]) < 99 and family_of("loss") is None


def test_json_round_trip_is_one_strict_line():
    msg = _msg()
    line = encode_line(msg)
    assert "\n" not in line and json.loads(line)["kind"] == "layer_names"
    back = decode_line(line)
    assert back.names == msg.names and back.digest == msg.digest and back.step == 17


def test_resending_at_another_step_reuses_the_payload():
    msg = _msg()
    later = msg.at(33)
    assert later.payload is msg.payload and later.step == 33
    assert decode_names(encode_names(later)).step == 33


def test_families_say_which_metric_indexes_what():
    assert family_of("gemm_out") == family_of("gemm_fwd") == "products"
    assert family_of("stream_max") == "blocks"
    assert family_of("attn_entropy") == family_of("attn_logit_min") == family_of("act_max") == "layers"
    assert family_of("act_max_module") == "modules"
    assert family_of("loss") is None


def test_the_decode_cache_skips_the_inflate_but_not_the_checks():
    cache: dict = {}
    a = decode_names(encode_names(_msg()), cache=cache)
    b = decode_names(encode_names(_msg(rank=4).at(40)), cache=cache)
    assert b.names is a.names and b.rank == 4 and b.step == 40
    with pytest.raises(RecordError, match="rank"):  # a cached payload with a bad rank is still refused
        decode_names(encode_names(_msg(rank=7)).replace(struct.pack("<I", 7), struct.pack("<I", 9), 1), cache=cache)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda b: b[:10], "names"),  # truncated
        (lambda b: b"SDCX" + b[4:], "magic"),
        (lambda b: b[:-3], "names"),  # the payload cut short
        (lambda b: b + b"xx", "names"),  # trailing bytes
    ],
)
def test_malformed_bytes_name_the_field(mutate, field):
    with pytest.raises(RecordError) as err:
        decode_names(mutate(encode_names(_msg())))
    assert err.value.field == field


def test_unknown_version_and_bad_identity():
    b = bytearray(encode_names(_msg()))
    b[4] = 9
    with pytest.raises(UnknownVersionError):
        decode_names(bytes(b))
    with pytest.raises(RecordError, match="rank"):
        decode_names(_raw(b"{}", rank=5, world=5))
    with pytest.raises(LimitError) as err:
        decode_names(_raw(b"{}", world=1 << 20), RecordLimits())
    assert err.value.reason == "world"


def test_a_digest_that_is_not_the_hash_of_the_names_is_refused():
    with pytest.raises(RecordError) as err:
        decode_names(_raw(b'{"products":["a"]}', digest=12345))
    assert err.value.field == "digest"


def test_a_payload_that_is_not_zlib_or_not_json_is_malformed():
    msg = bytearray(_raw(b'{"products":["a"]}'))
    msg[-6:] = b"\x00" * 6
    with pytest.raises(RecordError):
        decode_names(bytes(msg))
    with pytest.raises(RecordError, match="JSON"):
        decode_names(_raw(b"{not json"))


def test_a_decompression_bomb_stops_at_the_bound():
    bomb = b'{"products":["' + b"a" * (MAX_TEXT_BYTES * 4) + b'"]}'
    raw = _raw(bomb)
    assert len(raw) < 64 * 1024  # small on the wire
    with pytest.raises(LimitError) as err:
        decode_names(raw)
    assert err.value.reason == "names" and reason_of(err.value) == "names"


@pytest.mark.parametrize(
    "names, what",
    [
        ({"products": ["a" * (MAX_LAYER_NAME_BYTES + 1)]}, "longer than"),
        ({"products": ["x"] * (MAX_FAMILY_NAMES + 1)}, "names, at most"),
        ({f"f{i}": [] for i in range(17)}, "families"),
        ({"Products!": []}, "identifier"),
        ({"products": ["a\nmetric=forged"]}, "control character"),
        ({"products": ["a\u2028b"]}, "control character"),
        ({"products": [1]}, "string"),
        ({"products": "abc"}, "list"),
        (["products"], "object"),
    ],
)
def test_implausible_names_are_refused_with_reason_names(names, what):
    with pytest.raises(LimitError, match=what) as err:
        decode_names(_raw(json.dumps(names).encode()))
    assert err.value.reason == "names"


def test_a_lone_surrogate_is_refused():
    with pytest.raises(LimitError):
        decode_names(_raw(b'{"products":["\\ud800"]}'))


def test_the_emitter_side_cleans_what_it_cannot_send():
    cleaned = clean_names({"products": ["ok", "bad\nname", "x" * 1000], "blocks": ["é" * 300]})
    assert cleaned["products"][:2] == ("ok", "bad?name")
    assert all(len(n.encode()) <= MAX_LAYER_NAME_BYTES for lst in cleaned.values() for n in lst)
    decode_names(encode_names(LayerNames.build("r", 0, 1, 0, cleaned)))  # sendable


def test_json_names_with_an_unknown_field_or_a_bad_tag_are_refused():
    d = json.loads(encode_line(_msg()))
    with pytest.raises(RecordError, match="unknown field"):
        decode_line(json.dumps({**d, "extra": 1}))
    with pytest.raises(RecordError):
        decode_line(json.dumps({**d, "kind": "record"}))
    with pytest.raises(LimitError):
        decode_line(json.dumps({**d, "names": {"products": ["a\x00"]}}))
