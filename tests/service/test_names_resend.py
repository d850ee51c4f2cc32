"""Split stages: the spatial stage sends every rank's layer names again, spread over
``names_resend`` seconds, so a temporal stage that starts without its saved state names the
modules again within that time; the cost of a summary stays bounded."""

from __future__ import annotations

import math
from collections import defaultdict

from sdcwatch.core.rank_notes import LayerNames
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC
from sdcwatch.service.bus import decode_summary_message
from sdcwatch.service.ingest import IngestDecoder
from sdcwatch.service.layer_name_book import MAX_RESEND_RANKS, LayerNameBook
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings
from sdcwatch.service.summary import StepSummary, decode_summary, encode_summary
from sdcwatch.telemetry.wire.emitter import Emitter
from sdcwatch.telemetry.wire.transports import MemoryBus, MemoryTransport

WORLD = 8
STEP_S = 10.0  # seconds between steps
RESEND = 60.0  # the spatial stage's names_resend: a cycle spans six summaries
STAGES = [[f"model.layers.{k}.mlp.gate_proj", f"model.layers.{k}.mlp.up_proj", f"model.layers.{k}.mlp.down_proj"] for k in (0, 4)]  # fmt: skip
FAULT_STEP, FAULT_RANK = 40, 5


def _records(steps: int) -> dict[int, list]:
    """Eight ranks in two pipeline stages (ranks 4-7 hold the second), each sending its stage's
    product names as the emitter does (ahead of every 16-step window); rank 5's third product
    is written to -1e12 at FAULT_STEP. The decoded items, by step."""
    bus = MemoryBus()
    emitters = [Emitter(MemoryTransport(bus), run="cold", rank=r, world=WORLD, host=f"h{r // 4}", wire="v1", batch=1) for r in range(WORLD)]  # fmt: skip
    for r, e in enumerate(emitters):
        e.set_names({"products": STAGES[r // 4]})
    for s in range(steps):
        for r, e in enumerate(emitters):
            bad = s == FAULT_STEP and r == FAULT_RANK
            e.emit(s, loss=2.0, layers={"gemm_out": [3.0, 3.0, -1e12 if bad else 3.0]})
    for e in emitters:
        e.close()
    items, rejected = IngestDecoder().decode(("t", k, v) for k, v in bus.messages(TELEMETRY_TOPIC))
    assert not rejected
    by_step = defaultdict(list)
    for x in items:
        by_step[x.step].append(x)
    return by_step


def _spatial_wire(steps: int) -> list[bytes]:
    """A spatial stage fed one step every STEP_S seconds: its summaries on the wire, one a step."""
    now = [0.0]
    spatial = DetectionPipeline(PipelineSettings(names_resend_s=RESEND), stage="spatial", clock=lambda: now[0])
    wire = []
    for step, items in sorted(_records(steps).items()):
        now[0] = step * STEP_S
        spatial.process(items)
        wire += [encode_summary(s) for s in spatial.take_summaries()]
    spatial.flush()
    return wire + [encode_summary(s) for s in spatial.take_summaries()]


def _ranks_on(blob: bytes) -> set[int]:
    names = decode_summary(blob).names or {}
    return {int(r) for rs in names.get("ranks", {}).values() for r in rs}


def test_a_temporal_stage_started_without_state_mid_run_names_every_rank_within_the_period():
    wire = _spatial_wire(48)
    steps = [decode_summary(w).step for w in wire]
    assert _ranks_on(wire[0]) == set(range(WORLD))  # the first summary: every list is new
    # after it, each summary carries the next ranks in turn: 8 ranks x 10 s / 60 s, rounded up
    per_summary = [len(_ranks_on(w)) for w in wire[1:]]
    assert max(per_summary) == math.ceil(WORLD * STEP_S / RESEND) and min(per_summary) >= 1
    # the summaries of any 60 s (six steps) carry every rank
    cycle = int(RESEND / STEP_S)
    for i in range(1, len(wire) - cycle):
        assert set().union(*map(_ranks_on, wire[i : i + cycle])) == set(range(WORLD)), i

    # a temporal stage that starts at step 12 with no state: it has the names of no rank at first
    join = steps.index(12)
    temporal = DetectionPipeline(stage="temporal")
    known_at = {}
    events = []
    for w in wire[join:]:
        events += temporal.process_summaries(decode_summary_message(w))
        known = sum(temporal.names.names_of("cold", r) is not None for r in range(WORLD))
        known_at.setdefault(known, decode_summary(w).step)
    events += temporal.flush()
    assert min(known_at) < WORLD  # not all known from its first summary on
    assert known_at[WORLD] - 12 <= RESEND / STEP_S  # every rank known within the period
    for r in range(WORLD):
        assert temporal.names.names_of("cold", r)["products"] == tuple(STAGES[r // 4])
    (inc,) = [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]
    assert inc.ranks == (FAULT_RANK,) and inc.layer_name == STAGES[1][2]  # its own stage's product
    assert f"gemm_out of {STAGES[1][2]} (product 2) = -1e+12" in inc.message


def test_without_the_resend_the_same_temporal_stage_would_not_learn_the_names():
    """The cycle is what teaches it: the emitters' own names messages, sent every window, are
    nothing new to the spatial stage and are not forwarded."""
    wire = _spatial_wire(48)
    bare = []
    for w in wire:
        s = decode_summary(w)
        s.names = None if s.step else s.names  # only the first summary's, as before the cycle
        bare.append(encode_summary(s))
    join = [decode_summary(w).step for w in bare].index(12)
    temporal = DetectionPipeline(stage="temporal")
    for w in bare[join:]:
        temporal.process_summaries(decode_summary_message(w))
    temporal.flush()
    assert all(temporal.names.names_of("cold", r) is None for r in range(WORLD))


def test_a_summary_resends_at_most_the_bound_and_catches_up_after_a_pause():
    """A run silent for an hour (or a spatial instance that holds every other key window) owes
    ranks to the cycle: they go on the next summaries, at most MAX_RESEND_RANKS each and at most
    one cycle in all, then the pace resumes."""
    world = 3 * MAX_RESEND_RANKS
    now = [0.0]
    book = LayerNameBook(resend=60.0, clock=lambda: now[0])
    msg = LayerNames.build("big", 0, world, 0, {"products": ["a", "b"]})
    for r in range(world):
        book.learn(LayerNames("big", r, world, 0, msg.names, msg.digest, msg.payload))

    def stamped() -> list[int]:
        (s,) = book.stamp([StepSummary("big", 0, world, world)])
        return sorted(int(r) for rs in (s.names or {}).get("ranks", {}).values() for r in rs)

    assert len(stamped()) == world  # all new
    now[0] = 3600.0
    sent = [stamped()]
    for _ in range(7):
        now[0] += 1.0
        sent.append(stamped())
    sizes = [len(x) for x in sent]
    assert max(sizes) == MAX_RESEND_RANKS  # the bound
    assert sent[0] == list(range(MAX_RESEND_RANKS))  # from the cursor on, in rank order
    assert set().union(*map(set, sent[:3])) == set(range(world))  # the owed cycle first
    assert sum(sizes[:-2]) <= 2 * world  # at most one cycle owed, and the pace meanwhile
    assert set(sizes[-2:]) <= {math.floor(world / 60), math.ceil(world / 60)}  # then the pace again
    big = book._lists(book._runs["big"], sent[0])
    assert len(encode_summary(StepSummary("big", 0, world, world, names=big))) < 64 << 10


def test_the_period_is_a_serve_setting_that_reaches_the_spatial_stage():
    import pytest
    from sdcwatch.core.errors import ConfigError

    from sdcwatch.config import load_config

    cfg = load_config(env={"SDCWATCH_DETECTORS_NAMES_RESEND_S": "120"})
    assert cfg.detectors.names_resend_s == 120.0
    spatial = DetectionPipeline(cfg.detectors, stage="spatial")
    assert spatial.names.resend == 120.0 and spatial.names.forwards
    assert not DetectionPipeline(cfg.detectors, stage="temporal").names.forwards
    assert load_config(env={}).detectors.names_resend_s == PipelineSettings().names_resend_s == 300.0
    with pytest.raises(ConfigError, match="names_resend_s"):
        load_config(env={"SDCWATCH_DETECTORS_NAMES_RESEND_S": "0"})


def test_a_list_sent_again_under_a_held_digest_is_trusted_only_when_it_is_that_very_list(caplog):
    """The temporal book skips checking and hashing a list it already holds; a summary that puts
    other names under that digest gets them checked and hashed afresh, as a names message would:
    the held list stays bound to its ranks, and a name with a control character is refused."""
    import logging

    wire = _spatial_wire(20)
    temporal = DetectionPipeline(stage="temporal")
    temporal.process_summaries(decode_summary_message(wire[0]))  # every rank's list
    held = decode_summary(wire[0]).names
    digest = next(d for d, ranks in held["ranks"].items() if 0 in ranks)
    forged = decode_summary(wire[1])
    forged.names = {"world": WORLD, "tables": {digest: {"products": ["x.a", "x.b", "x.c"]}}, "ranks": {digest: [0]}}
    temporal.process_summaries(decode_summary_message(encode_summary(forged)))
    assert temporal.names.names_of("cold", 0)["products"] == ("x.a", "x.b", "x.c")  # as a names message of rank 0
    assert temporal.names.names_of("cold", 1)["products"] == tuple(STAGES[0])  # the held list is not rebound
    assert int(digest, 16) in temporal.names._runs["cold"].tables
    forged = decode_summary(wire[2])
    forged.names = {"world": WORLD, "tables": {digest: {"products": ["x\nincident=resolved"]}}, "ranks": {digest: [2]}}
    with caplog.at_level(logging.WARNING, "sdcwatch.detectors"):
        temporal.process_summaries(decode_summary_message(encode_summary(forged)))
    assert temporal.names.refused == 1 and "control character" in caplog.text
    assert temporal.names.names_of("cold", 2)["products"] == tuple(STAGES[0])
