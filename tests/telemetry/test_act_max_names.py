"""A NaN that ``act_max`` finds is named by the leaf module whose output it was: a tiny randomly
initialised Llama with only the activation probe on (``act_max`` every step; no stream, checksum
or attention sample at the fault's step), a NaN written into one MLP projection's output, the
records and the rank's names through the emitter's own messages into the detector pipeline."""

from __future__ import annotations

import pytest
from installed import needs

torch = pytest.importorskip("torch")
needs("transformers")

from sdcwatch.core.incident import Finding, Severity  # noqa: E402
from sdcwatch.core.rank_notes import LayerNames  # noqa: E402
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC  # noqa: E402
from sdcwatch.service.ingest import IngestDecoder  # noqa: E402
from sdcwatch.service.layer_name_book import LayerNameBook  # noqa: E402
from sdcwatch.service.pipeline import DetectionPipeline  # noqa: E402
from sdcwatch.telemetry import attach  # noqa: E402
from sdcwatch.telemetry.wire.emitter import Emitter  # noqa: E402
from sdcwatch.telemetry.wire.transports import MemoryBus, MemoryTransport  # noqa: E402
from sdcwatch.testbed.faults import FaultInjector  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from tiny_llama import tiny_llama, tokens  # noqa: E402

LEAF = "model.layers.1.mlp.up_proj"
FAULT_STEP, STEPS = 2, 3
#: act_max on every step and nothing else that sees the forward pass at the fault's step
ACT_MAX_ONLY = {
    "activations_every": 1,
    "stream_every": 0,
    "checksum_every": 0,
    "gemm_canary_every": 0,
    "attention_every": 1 << 30,
}


def _nonfinite_incident(run: str, **probes) -> tuple:
    """Train the tiny Llama with a NaN in ``LEAF``'s output at FAULT_STEP; the incident it opens
    and the watch."""
    torch.set_num_threads(1)
    model = tiny_llama()
    bus = MemoryBus()
    emitter = Emitter(MemoryTransport(bus), run=run, rank=0, world=1, host="vm", wire="v2", batch=1)
    watch = attach(model, emitter, **probes)
    injector = FaultInjector([FaultSpec(kind="nan", rank=0, step=FAULT_STEP, target=LEAF, where="output", seed=3)])
    injector.attach(model)
    for s in range(STEPS):
        injector.begin_step(s)
        batch = tokens(0, s)
        model(input_ids=batch, labels=batch).loss.backward()
        watch.step(s)
        model.zero_grad()
    watch.close()
    emitter.close()
    items, rejected = IngestDecoder().decode(("t", k, v) for k, v in bus.messages(TELEMETRY_TOPIC))
    assert not rejected
    pipe = DetectionPipeline()
    events = pipe.process(items) + pipe.flush()
    opened = [e.incident for e in events if e.change == "opened" and e.incident.kind == "nonfinite"]
    assert len(opened) == 1, [e.incident.message for e in events]
    return opened[0], watch


def test_a_nan_found_through_act_max_reads_the_leaf_module_it_came_from():
    inc, watch = _nonfinite_incident("leaf", **ACT_MAX_ONLY)
    assert watch.act_max_module == LEAF  # the probe's own reading of where it came from
    assert (inc.first_step, inc.metric, inc.layer) == (FAULT_STEP, "act_max", 1)
    assert inc.layer_name == LEAF  # the leaf module, not the attention layer it sits beside
    assert f"act_max of {LEAF} (layer 1) = nan" in inc.message, inc.message
    assert inc.evidence["act_max_module"] == watch.leaf_names.index(LEAF)
    (hit,) = [h for h in inc.evidence["hits"] if h["metric"] == "act_max"]
    assert hit["layer_name"] == LEAF


def _act_max_finding(module: int | None) -> Finding:
    evidence = {} if module is None else {"act_max_module": module}
    return Finding("nonfinite", "nonfinite", Severity.CRITICAL, "r", 2, 1.0, "act_max layer 1 = nan",
                   metric="act_max", layer=1, evidence=evidence, around=("", " = nan"))  # fmt: skip


def test_without_leaf_module_names_act_max_is_named_by_its_layer():
    """A rank that sent no leaf-module names (or an index past its list) gets the attention layer
    its module sits in, as before; one that did gets the leaf."""
    layers = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    book = LayerNameBook()
    book.learn(LayerNames.build("r", 0, 1, 0, {"layers": layers}))
    (f,) = book.enrich([_act_max_finding(7)], "r")
    assert f.layer_name == layers[1] and f.message == f"act_max of {layers[1]} (layer 1) = nan"
    book.learn(LayerNames.build("r", 0, 1, 16, {"layers": layers, "modules": ["a", "b"]}))
    (f,) = book.enrich([_act_max_finding(7)], "r")
    assert f.layer_name == layers[1]  # 7 is past the two leaf names: not guessed
    (f,) = book.enrich([_act_max_finding(1)], "r")
    assert f.layer_name == "b" and f.message == "act_max of b (layer 1) = nan"
