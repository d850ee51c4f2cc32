"""What every counter scalar on the wire must do (``nonfinite_first``, ``gemm_canary_product``...).

A counter travels unchanged on the three wires (v1 binary, v2 columnar, JSON lines), and a forged
value (NaN, infinite, negative, past 2^53) is refused on each of them with reason ``counter``,
naming the counter, while the honest message beside it is kept.
"""

from __future__ import annotations

import dataclasses

import pytest
from sdcwatch.core.errors import ReplayError
from sdcwatch.core.limits import LimitError, RecordLimits
from sdcwatch.core.messages import decode_message, encode_items
from sdcwatch.core.record import encode_batch, from_json, record_key, to_json
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.record_type import Record
from sdcwatch.service.ingest import IngestDecoder, as_records
from sdcwatch.service.offline import read_records

#: Forged values of a counter, each refused at ingest.
FORGED = [float("nan"), float("inf"), -1.0, -float("inf"), 2.0**60]


def assert_travels_on_every_wire(rec: Record, name: str) -> None:
    """``rec`` carries the counter ``name``: v1, v2 and JSON all give its value back."""
    [v1] = decode_message(encode_batch([rec]), RecordLimits())
    [(key, v2, _)] = encode_items([PackedRecord.from_record(rec)], record_key, 16, set())
    items, rejected = IngestDecoder().decode([("t/0/0", key, v2)])
    assert not rejected
    [v2rec] = as_records(items)
    want = rec.scalars[name]
    assert v1.scalars[name] == v2rec.scalars[name] == from_json(to_json(rec)).scalars[name] == want


def assert_forged_is_dead_lettered(rec: Record, name: str, honest: float, tmp_path) -> None:
    """``rec`` carries a forged ``name``: refused on every wire, an honest rank-1 copy kept."""
    with pytest.raises(LimitError, match=f"scalars.{name}") as err:
        decode_message(encode_batch([rec]), RecordLimits())
    assert err.value.reason == "counter"
    good = PackedRecord.from_record(dataclasses.replace(rec, rank=1, scalars={**rec.scalars, name: honest}))
    [(k1, ok, _)] = encode_items([good], record_key, 16, set())
    [(k2, forged, _)] = encode_items([PackedRecord.from_record(rec)], record_key, 16, set())
    items, rejected = IngestDecoder().decode([("t/0/0", k1, ok), ("t/0/1", k2, forged)])
    assert [r.rank for r in as_records(items)] == [1]  # the forged message only is dead-lettered
    [rj] = rejected
    assert rj.code == "counter" and name in rj.reason
    path = tmp_path / "capture.jsonl"
    path.write_text(to_json(rec) + "\n")  # NaN and Infinity as the JSON records write them
    with pytest.raises(ReplayError, match=name):
        list(read_records(path))
