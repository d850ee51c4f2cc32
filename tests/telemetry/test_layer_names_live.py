"""End to end through the real broker and ``sdcwatch serve``: a tiny Hugging Face Qwen2 trained in a
hand-written loop with ``attach(model, Emitter(), optimizer=opt)``, a value of -1e12 written into
``model.layers.1.mlp.gate_proj``'s output at step 40. The incident names that module (fields,
message, the anomalies topic, /metrics), a service that joins after the run began learns the names
within a key window, and a hostile names message on the topic is dead-lettered with its reason."""

from __future__ import annotations

import hashlib
import uuid
import zlib

import pytest
from installed import needs

torch = pytest.importorskip("torch")
needs("transformers")

from sdcwatch.core.rank_notes import LayerNames, encode_names  # noqa: E402
from sdcwatch.core.record import KEY_WINDOW  # noqa: E402
from serve_process import ServeProcess, Topics, metric, peek_topic, scrape, wait_metric  # noqa: E402

GATE = "model.layers.1.mlp.gate_proj"
FAULT_STEP, STEPS, VOCAB, SEQ = 40, 48, 64, 16


def _train(bootstrap: str, topic: str, run: str) -> int:
    """The user's loop; returns the index of the faulty product in the watch's ``checksums.names``."""
    from sdcwatch.telemetry import Emitter, attach
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ * 4,
    )
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg)
    step = {"now": 0}

    def fault(module, args, out):  # one element of the product's output, at one step
        if step["now"] != FAULT_STEP:
            return None
        out = out.clone()
        out.view(-1)[0] = -1e12
        return out

    model.get_submodule(GATE).register_forward_hook(fault)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    emitter = Emitter(bootstrap=bootstrap, topic=topic, run=run, rank=0, world=1, local_rank=0, host="vm")
    watch = attach(model, emitter, optimizer=opt)
    g = torch.Generator().manual_seed(1)
    for s in range(STEPS):
        step["now"] = s
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        watch.step(s, loss=loss)
    watch.close()
    emitter.close(timeout=30.0)
    assert emitter.names.sent >= STEPS // KEY_WINDOW
    return watch.checksums.names.index(GATE)


def _hostile_names() -> bytes:
    """A names message whose digest is right but whose name would forge a log field."""
    text = b'{"products":["x\\nincident=resolved"]}'
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return encode_names(LayerNames("hostile", 0, 1, 0, {}, digest, zlib.compress(text)))


def test_a_fault_in_a_named_module_gives_an_incident_naming_it(bootstrap, tmp_path):
    from kafka import KafkaProducer

    topics = Topics.fresh()
    run = f"qwen-{uuid.uuid4().hex[:6]}"
    with ServeProcess(bootstrap, topics, tmp_path / "state") as service:
        service.wait_banner()
        producer = KafkaProducer(bootstrap_servers=[bootstrap])
        producer.send(topics.telemetry, key=b"hostile/0", value=_hostile_names()).get(timeout=30)
        producer.close()
        index = _train(bootstrap, topics.telemetry, run)
        opened = service.wait_incident("nonfinite")
        want = f"gemm_out of {GATE} (product {index}) = 1e+12"  # largest |row sum|
        assert opened["run"] == run and opened["first_step"] == FAULT_STEP
        assert (opened["metric"], opened["layer"], opened["layer_name"]) == ("gemm_out", index, GATE)
        assert want in opened["message"], opened["message"]
        wait_metric(
            service.metrics_url,
            lambda s: (
                metric(s, "sdcwatch_incident_info", run=run, kind="nonfinite", layer_name=GATE) == 1
                and metric(s, "sdcwatch_pipeline_dead_letters_by_reason_total", reason="names") == 1
            ),
            60,
            "the incident's layer_name label and the names dead letter",
        )
        samples = scrape(service.metrics_url)
    assert [m.value[:4] for m in peek_topic(bootstrap, topics.dead)] == [b"SDCN"]
    assert not [s for s in samples if s.name == "sdcwatch_incident_info" and "\n" in s.labels.get("layer_name", "")]

    # a service that joins after the first two windows went by: only what came later is on its topic
    late = Topics.fresh()
    kept = [m for m in peek_topic(bootstrap, topics.telemetry) if m.key.startswith(run.encode())]
    kept = [m for m in kept if int(m.key.rsplit(b"/", 1)[1]) >= 2]
    assert kept and kept[0].value[:4] == b"SDCN"  # the window's names travel ahead of its records
    producer = KafkaProducer(bootstrap_servers=[bootstrap])
    for m in kept:
        producer.send(late.telemetry, key=m.key, value=m.value)
    producer.flush(timeout=30)
    producer.close()
    with ServeProcess(bootstrap, late, tmp_path / "late-state") as service:
        service.wait_banner()
        joined = service.wait_incident("nonfinite")
    assert (joined["layer"], joined["layer_name"]) == (index, GATE)
    assert want in joined["message"]
