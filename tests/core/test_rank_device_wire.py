"""The rank-device message (a rank's GPU): round trips on the binary and JSON wires, and what
hostile bytes get."""

from __future__ import annotations

import pytest
from sdcwatch.core.errors import RecordError
from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.messages import decode_line, decode_message, encode_line
from sdcwatch.core.rank_notes import MAX_GPU_BYTES, RankDevice, decode_device, encode_device
from sdcwatch.core.signing import JobKey, Keyring

SAID = RankDevice("run-a", 3, 8, 17, "5:GPU-8f2e1c3a-0000-4000-8000-00000000abcd")


def test_binary_and_json_round_trips_and_the_signed_envelope() -> None:
    assert decode_device(encode_device(SAID)) == SAID
    line = encode_line(SAID)
    assert "\n" not in line and '"kind":"gpu"' in line and decode_line(line) == SAID
    key = JobKey("k", b"k" * 32)
    assert decode_message(key.sign(encode_device(SAID)), keyring=Keyring([key])) == [SAID]


@pytest.mark.parametrize(
    "gpu,why",
    [("", "non-empty"), ("x" * (MAX_GPU_BYTES + 1), "at most"), ("5\x1b[31m", "control character"), (5, "string")],
)
def test_a_label_that_would_break_a_log_line_or_a_bound_is_refused(gpu, why) -> None:
    with pytest.raises(RecordError, match=why):
        RankDevice("r", 0, 1, 0, gpu)


def test_hostile_bytes_name_the_field() -> None:
    good = encode_device(SAID)
    with pytest.raises(RecordError, match="trailing"):
        decode_device(good + b"x")
    with pytest.raises(RecordError):
        decode_device(good[:-3])
    with pytest.raises(RecordError, match="rank device"):
        decode_device(b"SDCK" + good[4:])
    with pytest.raises(RecordError, match="rank"):
        decode_device(encode_device(SAID).replace(b"\x03\x00\x00\x00\x08", b"\x09\x00\x00\x00\x08"))
    with pytest.raises(RecordError, match="world"):
        decode_device(good, RecordLimits(max_world=4))
    with pytest.raises(RecordError, match="unknown field"):
        decode_line('{"v":1,"kind":"gpu","run":"r","rank":0,"world":1,"step":0,"gpu":"1","uuid":"x"}')
