"""Layer names at the service: learnt from the emitters' own messages on every wire, kept per run and
rank within bounds, and put on the incidents that carry a layer index (and only when known)."""

from __future__ import annotations

import hashlib
import logging
import zlib

import pytest
from sdcwatch.core.errors import SummaryError
from sdcwatch.core.incident import Finding, Severity
from sdcwatch.core.rank_notes import LayerNames, encode_names
from sdcwatch.core.record import KEY_WINDOW
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import CANARY_PRODUCT, TELEMETRY_TOPIC
from sdcwatch.core.model_place import message_at
from sdcwatch.detectors.attribution import Attribution
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.replica import ReplicaDivergenceDetector
from sdcwatch.exporters.logsink import format_logfmt
from sdcwatch.service.bus import decode_summary_message
from sdcwatch.service.ingest import IngestDecoder
from sdcwatch.service.layer_name_book import MAX_TABLES_PER_RUN, LayerNameBook
from sdcwatch.service.offline import replay
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.summary import decode_summary, encode_summary
from sdcwatch.telemetry.wire.emitter import Emitter
from sdcwatch.telemetry.wire.transports import FileTransport, MemoryBus, MemoryTransport

GATE = "model.layers.1.mlp.gate_proj"
PRODUCTS = ["model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.q_proj", GATE]
FAULT_STEP = 40


def _train(transport, run: str, wire: str = "v2", *, names: bool = True, steps: int = 48) -> Emitter:
    """One rank's records as the probes send them: ``gemm_out`` of three products, the third
    written to -1e12 at FAULT_STEP; the names handed over as the watch does."""
    e = Emitter(transport, run=run, rank=0, world=1, host="vm", wire=wire, batch=4)
    if names:
        e.set_names({"products": PRODUCTS, "blocks": ["model.layers.0", "model.layers.1"], "layers": [], "modules": []})
    for s in range(steps):
        e.emit(s, loss=2.0, layers={"gemm_out": [3.0, 3.0, -1e12 if s == FAULT_STEP else 3.0]})
    e.close()
    return e


def _incidents(messages, pipe: DetectionPipeline | None = None) -> list:
    """The incidents the non-finite value opens (the warm-up's other findings are not at issue)."""
    pipe = pipe or DetectionPipeline()
    items, rejected = IngestDecoder().decode(("t", k, v) for k, v in messages)
    assert not rejected
    events = pipe.process(items) + pipe.flush()
    return [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]


@pytest.mark.parametrize("wire", ["v1", "v2"])
def test_an_incident_names_the_module_of_its_layer_index(wire):
    bus = MemoryBus()
    e = _train(MemoryTransport(bus), "r", wire)
    (inc,) = _incidents(bus.messages(TELEMETRY_TOPIC))
    assert (inc.kind, inc.metric, inc.layer, inc.layer_name) == ("nonfinite", "gemm_out", 2, GATE)
    assert f"gemm_out of {GATE} (product 2) = -1e+12" in inc.message
    assert inc.to_dict()["layer_name"] == GATE
    line = format_logfmt(__import__("sdcwatch.core.incident", fromlist=["x"]).IncidentEvent("opened", inc))
    assert f"layer=2 layer_name={GATE} metric=gemm_out" in line
    # once per key window, not per record: 48 steps are 3 windows
    assert e.names.sent == 48 // KEY_WINDOW


def test_a_service_that_joins_mid_run_learns_the_names_within_a_window():
    bus = MemoryBus()
    _train(MemoryTransport(bus), "late")
    messages = bus.messages(TELEMETRY_TOPIC)
    # the service starts after the run's first two windows (steps 0-31) went by
    late = [(k, v) for k, v in messages if int(k.split(b"/")[1]) >= 2]
    assert late[0][1][:4] == b"SDCN"  # the window's names come ahead of its records
    (inc,) = _incidents(late)
    assert inc.layer_name == GATE


def test_an_older_emitter_without_names_still_gets_the_index_alone():
    bus = MemoryBus()
    _train(MemoryTransport(bus), "old", names=False)
    (inc,) = _incidents(bus.messages(TELEMETRY_TOPIC))
    assert inc.layer == 2 and inc.layer_name is None
    assert "gemm_out (product 2) = -1e+12" in inc.message  # a product, not a layer
    assert inc.to_dict()["layer_name"] is None


def test_the_json_file_wire_carries_the_names_to_replay(tmp_path):
    path = tmp_path / "run.jsonl"
    _train(FileTransport(path), "file")
    assert sum('"kind":"layer_names"' in ln for ln in path.read_text().splitlines()) == 3
    (inc,) = replay(path)
    assert inc.layer_name == GATE and f"of {GATE}" in inc.message


def test_each_pipeline_stage_rank_is_named_from_its_own_list_and_an_unknown_rank_is_not():
    book = LayerNameBook()
    stage0 = LayerNames.build("pp", 0, 4, 0, {"products": ["model.layers.0.mlp.up_proj"]})
    stage1 = LayerNames.build("pp", 2, 4, 0, {"products": ["model.layers.8.mlp.up_proj"]})
    book.take([stage0, stage1, LayerNames.build("pp", 1, 4, 0, {"products": ["model.layers.0.mlp.up_proj"]})])
    assert len(book._runs["pp"].tables) == 2  # ranks 0 and 1 share one copy

    def finding(rank):
        return Finding("nonfinite", "nonfinite", Severity.CRITICAL, "pp", 5, 1.0, "x: gemm_in (product 0) = nan",
                       ranks=(rank,), metric="gemm_in", layer=0)  # fmt: skip

    named = book.enrich([finding(0), finding(1), finding(2), finding(3)], "pp")
    assert [f.layer_name for f in named] == [
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.8.mlp.up_proj",
        None,  # rank 3 sent nothing: not guessed from another stage
    ]
    assert named[3].message == "x: gemm_in (product 0) = nan"
    # a finding past the list, or of a metric that is not indexed, stays as it is
    past = Finding("d", "k", Severity.WARNING, "pp", 5, 1.0, "m", ranks=(0,), metric="gemm_in", layer=7)
    loss = Finding("d", "k", Severity.WARNING, "pp", 5, 1.0, "m", ranks=(0,), metric="loss", layer=0)
    book.enrich([past, loss], "pp")
    assert past.layer_name is None and loss.layer_name is None


def test_a_rank_whose_list_grew_points_at_the_new_one_and_the_old_copy_goes():
    book = LayerNameBook()
    book.learn(LayerNames.build("g", 0, 1, 0, {"products": ["a"]}))
    before = book.bytes
    book.learn(LayerNames.build("g", 0, 1, 16, {"products": ["a", "b.c"]}))
    assert len(book._runs["g"].tables) == 1 and book.bytes > before
    assert book.names_of("g", 0)["products"] == ("a", "b.c")


def test_memory_stays_bounded_runs_tables_and_bytes(caplog):
    book = LayerNameBook(max_runs=3)
    for i in range(10):
        book.learn(LayerNames.build(f"run{i}", 0, 1, 0, {"products": ["x"]}))
    assert list(book._runs) == ["run7", "run8", "run9"]
    with caplog.at_level(logging.WARNING, "sdcwatch.detectors"):
        for r in range(MAX_TABLES_PER_RUN + 5):
            book.learn(LayerNames.build("wide", r, 1000, 0, {"products": [f"p{r}"]}))
    assert len(book._runs["wide"].tables) == MAX_TABLES_PER_RUN and book.refused == 5
    assert "not kept" in caplog.text
    small = LayerNameBook(max_bytes=2000)
    for i in range(20):
        small.learn(LayerNames.build(f"b{i}", 0, 1, 0, {"products": [f"{i}.{'n' * 100}"]}))
    assert small.bytes <= 2000 and "b19" in small._runs
    for run in list(small._runs):
        small.forget(run)
    assert small.bytes == 0 and small.ranks == 0


def test_the_names_survive_a_restart_in_the_saved_state(tmp_path):
    bus = MemoryBus()
    _train(MemoryTransport(bus), "saved", steps=FAULT_STEP - 2)
    pipe = DetectionPipeline()
    assert _incidents(bus.messages(TELEMETRY_TOPIC), pipe) == []
    pipe.save(tmp_path / "state.json")
    restored = DetectionPipeline()
    assert restored.load(tmp_path / "state.json")
    assert restored.names.names_of("saved", 0)["products"] == tuple(PRODUCTS)


def test_a_malformed_names_message_is_rejected_with_reason_names_and_the_rest_kept():
    good = LayerNames.build("h", 0, 1, 0, {"products": ["a"]})
    text = b'{"products":["a\\u001b[31m"]}'  # an escape sequence for the log line, digest and all right
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    bad = encode_names(LayerNames("h", 0, 1, 0, {}, digest, zlib.compress(text)))
    items, rejected = IngestDecoder().decode([("t", b"h/0", bad), ("t", b"h/0", encode_names(good))])
    assert [r.code for r in rejected] == ["names"] and "control character" in rejected[0].reason
    assert [x.names for x in items] == [good.names]


def _named(message: str, around, metric: str, layer: int | None, names: dict, rank: int = 0) -> Finding:
    """A finding on ``rank`` of run ``w`` (world 4, every rank sent ``names``), after the book named it."""
    book = LayerNameBook()
    for r in range(4):
        book.learn(LayerNames.build("w", r, 4, 0, names))
    f = Finding("d", "k", Severity.CRITICAL, "w", 4, 1.0, message, ranks=(rank,), metric=metric, layer=layer, around=around)  # fmt: skip
    (out,) = book.enrich([f], "w")
    return out


def test_the_message_names_the_module_where_the_index_was():
    products = {"products": [f"p{i}" for i in range(11)] + [GATE]}
    msg, around = message_at("v at step 4: ", "gemm_out", 11, " = 1e+12 on rank 0")
    assert msg == "v at step 4: gemm_out (product 11) = 1e+12 on rank 0"
    f = _named(msg, around, "gemm_out", 11, products)
    assert f.layer_name == GATE
    assert f.message == f"v at step 4: gemm_out of {GATE} (product 11) = 1e+12 on rank 0"
    # rendered from the fields, not found in the text: text that reads like the place is left alone
    msg, around = message_at("on host gemm_out (product 11): ", "gemm_out", 11, " = nan")
    assert _named(msg, around, "gemm_out", 11, products).message == (
        f"on host gemm_out (product 11): gemm_out of {GATE} (product 11) = nan"
    )
    # a message that names no place of its own gets the name at its end
    assert _named("gemm_out (product 12) = 1", None, "gemm_out", 1, {"products": ["a", "x"]}).message.endswith(
        "[gemm_out product 1: x]"
    )
    # a name with regex replacement syntax goes in as it is
    assert "a\\1b" in _named("v", message_at("", "gemm_in", 0, "")[1], "gemm_in", 0, {"products": ["a\\1b"]}).message


def test_the_rank_local_evidence_names_its_layer_where_attribution_places_it():
    """A persistent rank outlier in an attention statistic becomes silent drift: both the place
    attribution gives (``layer 2 attention``) and the outlier's own message name the module."""
    msg, around = message_at("rank 1 deviates from the other ranks in ", "attn_entropy", 2, " (evidence 9.0)")
    f = _named(msg, around, "attn_entropy", 2, {"layers": ["m.l.0.attn", "m.l.1.attn", "m.l.2.attn"]}, rank=1)
    f.kind = "rank_outlier"
    (drift,) = Attribution().apply(4, 4, [f])
    assert drift.kind == "silent_drift" and drift.layer_name == "m.l.2.attn"
    assert drift.message == (
        "silent drift suspected on rank 1, m.l.2.attn (layer 2) attention (attn_entropy): "
        "rank 1 deviates from the other ranks in attn_entropy of m.l.2.attn (layer 2) (evidence 9.0)"
    )


def test_without_names_a_product_or_a_block_is_called_so_not_a_layer():
    """Where attribution places rank-local evidence on a block or a product, it says what the index
    counts, as the message itself does; an attention statistic's index stays a layer."""
    msg, around = message_at("rank 1 deviates from the other ranks in ", "stream_max", 3, " (evidence 9.0)")
    f = Finding("rank_outlier", "rank_outlier", Severity.WARNING, "w", 4, 9.0, msg, ranks=(1,),
                metric="stream_max", layer=3, around=around)  # fmt: skip
    (drift,) = Attribution().apply(4, 4, [f])
    assert drift.message == (
        "silent drift suspected on rank 1, stream_max (block 3): "
        "rank 1 deviates from the other ranks in stream_max (block 3) (evidence 9.0)"
    )
    assert message_at("", "gemm_bwd", 7, "")[0] == "gemm_bwd (product 7)"
    assert message_at("", "attn_entropy", 2, "")[0] == "attn_entropy layer 2"


def test_a_finding_split_per_rank_names_each_rank_from_its_own_list():
    """A checksum mismatch on one rank of each pipeline stage opens one incident per rank; each
    names its own product, from its own stage's list."""
    from sdcwatch.service.incidents import IncidentBook

    names = LayerNameBook()
    names.learn(LayerNames.build("pp", 0, 4, 0, {"products": ["model.layers.0.mlp.up_proj"]}))
    names.learn(LayerNames.build("pp", 2, 4, 0, {"products": ["model.layers.8.mlp.up_proj"]}))
    hits = [{"rank": 0, "metric": "gemm_fwd", "layer": 0, "ratio": 40.0}, {"rank": 2, "metric": "gemm_fwd", "layer": 0, "ratio": 30.0}]  # fmt: skip
    f = Finding("checksum", "checksum_mismatch", Severity.CRITICAL, "pp", 9, 40.0,
                "checksum mismatch at step 9 on rank 0 and 1 more rank(s): gemm_fwd (product 0) is off",
                ranks=(0, 2), metric="gemm_fwd", layer=0, evidence={"hits": hits})  # fmt: skip
    book = IncidentBook()
    events = book.add(names.enrich([f], "pp"), ["h0", "h1", "h2", "h3"])
    by_rank = {e.incident.ranks: e.incident.layer_name for e in events if e.change == "opened"}
    assert by_rank == {(0,): "model.layers.0.mlp.up_proj", (2,): "model.layers.8.mlp.up_proj"}


def test_the_canary_product_of_a_replica_divergence_is_named():
    records = [
        Record.make(
            run="w",
            step=8,
            rank=r,
            world=4,
            scalars={CANARY_PRODUCT: 5.0},
            fingerprints={"gemm_canary_fp": 0xBAD if r == 3 else 1},
        )  # fmt: skip
        for r in range(4)
    ]
    (f,) = ReplicaDivergenceDetector().update(StepFrame.from_records("w", 8, 4, records))
    assert f.message.endswith("disagree(s) with the majority on gemm_canary_fp (product 5)")
    f = _named(
        f.message, f.around, f.metric, f.layer, {"canary_products": [f"p{i}" for i in range(5)] + [GATE]}, rank=3
    )
    assert f.message.endswith(f"on gemm_canary_fp of {GATE} (product 5)")


def _spatial(messages, state=None) -> tuple[list, DetectionPipeline]:
    """A spatial stage (restored from ``state`` when given) fed ``messages``: its summaries on the
    wire, in the order it publishes them."""
    spatial = DetectionPipeline(stage="spatial")
    if state is not None:
        assert spatial.load(state)
    items, rejected = IngestDecoder().decode(("t", k, v) for k, v in messages)
    assert not rejected
    spatial.process(items)
    spatial.flush()
    return [encode_summary(s) for s in spatial.take_summaries()], spatial


def _judged(wire: list) -> tuple[list, DetectionPipeline]:
    """A temporal stage's non-finite incidents from summaries on the wire."""
    temporal = DetectionPipeline(stage="temporal")
    events = temporal.process_summaries(x for w in wire for x in decode_summary_message(w)) + temporal.flush()
    return [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"], temporal


def test_split_stages_the_temporal_stage_names_the_module_from_the_names_the_spatial_stage_took():
    bus = MemoryBus()
    _train(MemoryTransport(bus), "split")
    wire, _ = _spatial(bus.messages(TELEMETRY_TOPIC))
    # the names ride on the run's first summary only: the windows after send the same lists again
    assert [i for i, w in enumerate(wire) if decode_summary(w).names is not None] == [0]
    (inc,), temporal = _judged(wire)
    assert (inc.metric, inc.layer, inc.layer_name) == ("gemm_out", 2, GATE)
    assert f"gemm_out of {GATE} (product 2) = -1e+12" in inc.message
    assert temporal.names.names_of("split", 0)["products"] == tuple(PRODUCTS)


def test_a_spatial_stage_restarted_from_its_state_sends_the_names_again(tmp_path):
    bus = MemoryBus()
    _train(MemoryTransport(bus), "again")
    messages = bus.messages(TELEMETRY_TOPIC)
    first = [(k, v) for k, v in messages if int(k.split(b"/")[1]) < 1]  # the first window, names and all
    _, spatial = _spatial(first)
    spatial.save(tmp_path / "spatial.json")
    # the rest of the run without its names messages: only the restarted stage's book has them
    rest = [(k, v) for k, v in messages if int(k.split(b"/")[1]) >= 1 and v[:4] != b"SDCN"]
    wire, _ = _spatial(rest, tmp_path / "spatial.json")
    assert decode_summary(wire[0]).names is not None
    (inc,), _ = _judged(wire)  # a temporal stage that saw nothing of the first window
    assert inc.layer_name == GATE


def test_names_on_a_summary_that_break_a_bound_are_refused_and_the_step_is_still_judged(caplog):
    bus = MemoryBus()
    _train(MemoryTransport(bus), "forged")
    wire, _ = _spatial(bus.messages(TELEMETRY_TOPIC))
    first = decode_summary(wire[0])
    digest = next(iter(first.names["tables"]))
    first.names = {"world": 1, "tables": {digest: {"products": ["x\nincident=resolved"]}}, "ranks": {digest: [0]}}
    with caplog.at_level(logging.WARNING, "sdcwatch.detectors"):
        (inc,), temporal = _judged([encode_summary(first), *wire[1:]])
    assert inc.layer == 2 and inc.layer_name is None  # judged, named by nothing forged
    assert temporal.names.refused == 1 and "control character" in caplog.text
    first.names = ["not", "an", "object"]
    with pytest.raises(SummaryError, match="names"):
        decode_summary(encode_summary(first))
