"""A one-rank job that sends every kind of telemetry message, and how to check what a reader saw of it
(tests/service/test_message_kinds.py: the in-memory and file transports; tests/cli/test_capture.py: Kafka)."""

from __future__ import annotations

from sdcwatch.core.messages import is_end_marker
from sdcwatch.core.rank_notes import CheckpointNote, LayerNames, RankDevice
from sdcwatch.core.record import KEY_WINDOW
from sdcwatch.core.record_type import Record
from sdcwatch.core.signing import JobKey
from sdcwatch.telemetry import Emitter

STEPS, SAVED = 40, 20
NAMES = {"products": ["m.q_proj", "m.k_proj"], "blocks": ["m.layers.0"]}


def run_job(transport, wire: str, key: JobKey | None = None) -> Emitter:
    """A one-rank job on a GPU that names its layers, saves a checkpoint after step 20 and ends normally."""
    env = {"CUDA_VISIBLE_DEVICES": "5"}
    em = Emitter(transport, run="kinds", rank=0, world=1, host="h", wire=wire, key=key, env=env)
    em.set_names(NAMES)
    for step in range(STEPS):
        em.emit(step, loss=2.0 - step / 100, grad_norm_global=1.0, layers={"gemm_out": [1.0, 2.0]})
        if step == SAVED:
            em.checkpoint(SAVED, f"ckpt-{SAVED}")
    em.close()
    assert em.ended and em.notes.sent == 1 and em.sent == STEPS
    return em


def order_of(messages: list) -> list[tuple[str, int]]:
    """What a reader saw, in its order: ("record", step), ("names", step), ("note", step), ("gpu", step),
    ("end", step)."""
    kind = {LayerNames: "names", CheckpointNote: "note", RankDevice: "gpu"}
    return [
        ("end" if is_end_marker(m) else "record", m.step) if isinstance(m, Record) else (kind[type(m)], m.step)
        for m in messages
    ]


def assert_complete_and_in_order(seen: list[tuple[str, int]], *, window: bool = False) -> None:
    """Every record, the names, the GPU (once, before the first record), the note and the end marker
    were seen, the note after the records
    made before it and before those made after it: of the whole run, or (``window``: read from
    Kafka, where each key window has a partition of its own) of its key window."""
    records = [s for k, s in seen if k == "record"]
    assert sorted(records) == list(range(STEPS)) and ("end", STEPS - 1) in seen
    assert ("names", 0) in seen and ("note", SAVED) in seen
    assert [k for k, _ in seen].count("gpu") == 1 and seen.index(("gpu", 0)) < seen.index(("record", 0))
    note = seen.index(("note", SAVED))
    first = SAVED // KEY_WINDOW * KEY_WINDOW if window else 0
    near = range(first, first + KEY_WINDOW) if window else range(STEPS)
    assert {s for k, s in seen[:note] if k == "record" and s in near} == set(range(first, SAVED + 1))
    assert all(s > SAVED for k, s in seen[note:] if k == "record" and s in near)
