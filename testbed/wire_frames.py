"""The frames the service builds from records that crossed the bus in a wire format: the campaign
and the tests run detection on exactly what a rank's transport sends and the service decodes."""

from __future__ import annotations

from typing import Sequence

from sdcwatch.core.columnar import WIRES
from sdcwatch.core.errors import RecordError
from sdcwatch.core.messages import encode_items
from sdcwatch.core.record import record_key
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.record_type import Record
from sdcwatch.core.validate import check_choice
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.service.aligner import StepAligner
from sdcwatch.service.ingest import IngestDecoder

__all__ = ["frames_over_wire"]


def frames_over_wire(records: Sequence[Record], wire: str, *, per_message: int = 256) -> list[StepFrame]:
    """The frames the service would build from ``records`` sent in wire format ``wire`` (``v1``/``v2``):
    encoded as the transports do, decoded and aligned waiting for every rank (the campaign runs
    detection on exactly what crosses the bus)."""
    check_choice("wire", wire, WIRES)
    items = list(records) if wire == "v1" else [PackedRecord.from_record(r) for r in records]
    messages = [
        (f"wire/0/{i}", key, value)
        for i, (key, value, _) in enumerate(encode_items(items, record_key, per_message, set()))
    ]
    decoder = IngestDecoder()
    aligner = StepAligner(timeout=1e9, max_open=1 << 30, reorder_grace=1e9)
    frames: list[StepFrame] = []
    for i in range(0, len(messages), 16):  # a poll's worth at a time, as the service reads them
        decoded, rejected = decoder.decode(messages[i : i + 16])
        if rejected:
            raise RecordError("record", f"{len(rejected)} messages did not decode: {rejected[0].reason}")
        frames += aligner.add(decoded)
    frames += aligner.flush()
    return sorted(frames, key=lambda f: (f.run, f.step))
