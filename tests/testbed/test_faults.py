"""The fault injector: spec validation, and faults that land exactly where, when and on whom asked."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.core.errors import FaultSpecError  # noqa: E402
from sdcwatch.testbed.faults import FaultInjector  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec, load_faults, parse_faults  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402

torch.set_num_threads(1)
CFG = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4)


# -- specs -------------------------------------------------------------------------------------


def test_jsonl_and_array_give_the_same_specs():
    items = [
        {
            "kind": "bitflip",
            "rank": 3,
            "step": 10,
            "duration": 1,
            "target": "blocks.1.attn.*",
            "where": "output",
            "bit": 30,
            "seed": 7,
        },
        {"kind": "noise", "rank": None, "step": 0, "duration": 0, "target": "blocks.*.mlp.fc", "magnitude": 0.005},
        {"kind": "lr_spike", "rank": 1, "step": 5, "magnitude": 100.0},
        {"kind": "bad_batch", "rank": 2, "step": 6, "duration": 3},
    ]
    jsonl = "\n".join(json.dumps(d) for d in items) + "\n\n"
    a = parse_faults(jsonl)
    b = parse_faults(json.dumps(items))
    assert a == b
    assert a[0].bit == 30 and a[0].rank == 3 and a[1].rank is None and a[1].duration == 0
    assert [FaultSpec.from_dict(s.to_dict()) for s in a] == a


def test_load_faults_reads_files(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_text('{"kind": "nan", "step": 2, "target": "head"}\n')
    (spec,) = load_faults(p)
    assert spec.kind == "nan" and spec.value != spec.value


@pytest.mark.parametrize(
    "line, key",
    [
        ('{"kind": "bitflip", "step": 1, "target": "x"}', "bit"),
        ('{"kind": "melt", "step": 1}', "kind"),
        ('{"kind": "nan", "step": -1, "target": "x"}', "step"),
        ('{"kind": "nan", "step": 1, "target": "x", "colour": 1}', "colour"),
        ('{"kind": "nan", "step": 1}', "target"),
        ('{"kind": "scale", "step": 1, "target": "x"}', "magnitude"),
        ('{"kind": "noise", "step": 1, "target": "x", "magnitude": -1}', "magnitude"),
        ('{"kind": "nan", "step": 1, "target": "x", "where": "input"}', "where"),
        ('{"kind": "bitflip", "step": 1, "target": "x", "bit": 64}', "bit"),
        ('{"kind": "nan", "step": "1", "target": "x"}', "step"),
        ('{"kind": "nan", "step": 1, "target": "x", "rank": true}', "rank"),
        ('{"kind": "bitflip", "step": 1, "target": "x", "bit": 3, "where": "param", "duration": 5}', "duration"),
        ("{not json", "json"),
    ],
)
def test_bad_specs_name_the_key_and_the_line(line, key):
    text = '{"kind": "inf", "step": 0, "target": "head"}\n' + line
    with pytest.raises(FaultSpecError) as err:
        parse_faults(text, source="faults.jsonl")
    assert err.value.key == key
    assert str(err.value).startswith("faults.jsonl:2: ")


def test_array_errors_name_the_index():
    with pytest.raises(FaultSpecError, match=r"^f\.json\[1\]: fault key 'kind'"):
        parse_faults('[{"kind": "nan", "step": 0, "target": "x"}, {"kind": 3, "step": 0}]', source="f.json")


def test_target_that_matches_nothing_is_an_error():
    with pytest.raises(FaultSpecError) as err:
        FaultInjector([FaultSpec(kind="nan", step=0, target="blocks.9.*")]).attach(GPT(CFG))
    assert err.value.key == "target" and "blocks.0" in str(err.value)


def test_targets_name_the_model_inside_its_compile_wrapper():
    """A job that compiled its model hands the injector the wrapper (as it hands it to ``attach()``):
    targets still name the model's modules, not ``_orig_mod.``'s."""
    model = _model()
    inj = FaultInjector([FaultSpec(kind="nan", rank=0, step=0, target="blocks.1.mlp.fc")]).attach(torch.compile(model))
    assert torch.isnan(_outputs(model, "blocks.1.mlp.fc", inj, 0)).any()


# -- application ---------------------------------------------------------------------------------


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _batch(step: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(100 + step))


def _outputs(model: GPT, name: str, injector: FaultInjector | None, step: int, rank: int = 0) -> torch.Tensor:
    """Output of module ``name`` (as the rest of the model sees it) at ``step``."""
    seen = {}
    module = dict(model.named_modules())[name]
    handle = module.register_forward_hook(lambda m, i, o: seen.__setitem__("out", o.detach().clone()))
    if injector is not None:
        injector.rank = rank
        injector.begin_step(step)
    with torch.no_grad():
        model.loss(_batch(step))
    handle.remove()
    return seen["out"]


def test_bitflip_flips_exactly_the_requested_bit_of_one_element_on_the_requested_rank_and_steps():
    spec = FaultSpec(kind="bitflip", rank=1, step=3, duration=2, target="blocks.1.attn.qkv", bit=27, seed=5)
    faulted = _model()
    inj = FaultInjector([spec]).attach(faulted)
    clean = _model()
    for step in range(7):
        for rank in range(3):
            got = _outputs(faulted, "blocks.1.attn.qkv", inj, step, rank)
            want = _outputs(clean, "blocks.1.attn.qkv", None, step)
            xor = got.view(torch.int32) ^ want.view(torch.int32)
            changed = xor.nonzero()
            if rank == 1 and step in (3, 4):
                assert changed.shape[0] == 1, (step, rank)
                assert int(xor[tuple(changed[0])]) == 1 << 27
            else:
                assert changed.shape[0] == 0, (step, rank)
    assert [(i.step, i.rank) for i in inj.injections] == [(3, 1), (4, 1)]


def test_bitflip_is_deterministic_for_a_seed_and_moves_with_it():
    def where(seed):
        m = _model()
        inj = FaultInjector([FaultSpec(kind="bitflip", step=0, target="blocks.*.attn.*", bit=30, seed=seed)]).attach(m)
        _outputs(m, "head", inj, 0)
        (i,) = inj.injections
        return i.target, i.index

    assert where(1) == where(1)
    assert len({where(s) for s in range(6)}) > 1


@pytest.mark.parametrize(
    "kind, check",
    [
        ("nan", lambda v: math.isnan(v)),
        ("inf", lambda v: v == math.inf),
        ("near_inf", lambda v: v == 1e10),
    ],
)
def test_nonfinite_kinds_land_on_one_element_of_the_target_output_at_the_step(kind, check):
    spec = FaultSpec(kind=kind, rank=0, step=2, target="blocks.0.mlp.fc", seed=3)
    m = _model()
    inj = FaultInjector([spec]).attach(m)
    before = _outputs(m, "blocks.0.mlp.fc", inj, 1)
    assert torch.isfinite(before).all() and before.abs().max() < 1e3
    out = _outputs(m, "blocks.0.mlp.fc", inj, 2)
    odd = (~torch.isfinite(out)) | (out.abs() > 1e9)
    assert int(odd.sum()) == 1
    assert check(float(out[odd][0]))
    assert inj.injections[0].index == int(odd.reshape(-1).nonzero()[0])
    assert torch.isfinite(_outputs(m, "blocks.0.mlp.fc", inj, 3)).all()


def test_near_inf_lands_in_the_attention_logits():
    m = _model()
    inj = FaultInjector([FaultSpec(kind="near_inf", step=0, target="blocks.0.attn.scores", magnitude=1e12)]).attach(m)
    logits = _outputs(m, "blocks.0.attn.scores", inj, 0)
    assert float(logits.amax()) == float(torch.tensor(1e12, dtype=torch.float32))
    assert int((logits > 1e9).sum()) == 1


def test_grad_bitflip_changes_one_element_of_one_parameter_gradient():
    spec = FaultSpec(kind="bitflip", step=1, target="blocks.0.mlp.*", where="grad", bit=12, seed=9)

    def grads(injector_rank):
        m = _model()
        inj = FaultInjector([spec]).attach(m)
        inj.rank = injector_rank
        inj.begin_step(1)
        m.loss(_batch(1)).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    faulted = grads(0)
    assert torch.equal(faulted["blocks.0.mlp.fc.weight"], grads(0)["blocks.0.mlp.fc.weight"])
    other = _model()
    other.loss(_batch(1)).backward()
    clean = {n: p.grad.clone() for n, p in other.named_parameters()}
    diffs = {n: int((faulted[n].view(torch.int32) ^ clean[n].view(torch.int32)).count_nonzero()) for n in clean}
    hit = [n for n, d in diffs.items() if d]
    assert len(hit) == 1 and hit[0].startswith("blocks.0.mlp.") and diffs[hit[0]] == 1
    xor = faulted[hit[0]].view(torch.int32) ^ clean[hit[0]].view(torch.int32)
    assert int(xor[xor != 0][0]) == 1 << 12


def test_noise_is_relative_seeded_and_scale_multiplies():
    def out(spec):
        m = _model()
        return _outputs(m, "blocks.1.mlp.fc", FaultInjector([spec]).attach(m), 0)

    clean = _outputs(_model(), "blocks.1.mlp.fc", None, 0)
    n1 = out(FaultSpec(kind="noise", step=0, target="blocks.1.mlp.fc", magnitude=0.01, seed=1))
    assert torch.equal(n1, out(FaultSpec(kind="noise", step=0, target="blocks.1.mlp.fc", magnitude=0.01, seed=1)))
    assert not torch.equal(n1, out(FaultSpec(kind="noise", step=0, target="blocks.1.mlp.fc", magnitude=0.01, seed=2)))
    rel = float((n1 - clean).pow(2).mean().sqrt() / clean.pow(2).mean().sqrt())
    assert 0.008 < rel < 0.012
    scaled = out(FaultSpec(kind="scale", step=0, target="blocks.1.mlp.fc", magnitude=3.0))
    torch.testing.assert_close(scaled, clean * 3.0)


def test_lr_spike_scales_the_rank_learning_rate_for_its_steps_only():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    inj = FaultInjector([FaultSpec(kind="lr_spike", rank=0, step=2, duration=1, magnitude=50.0)], rank=0).attach(m, opt)
    seen = []
    for step in range(4):
        inj.begin_step(step)
        seen.append(opt.param_groups[0]["lr"])
        inj.end_step()
    assert seen == [0.1, 0.1, 0.1 * 50.0, 0.1]
    other = FaultInjector([FaultSpec(kind="lr_spike", rank=0, step=2, magnitude=50.0)], rank=1).attach(m, opt)
    other.begin_step(2)
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("kind", ["nan", "scale", "noise"])
def test_a_rerun_of_the_step_is_clean_of_a_fault_of_one_step_and_hit_again_by_a_lasting_one(kind):
    """begin_step again for the same step and rank (the guard's rerun): a transient fault stays away, a
    persistent one fires on every pass, with its choices of the first (the same element, the same noise)."""
    extra = {"magnitude": 1e-2 if kind == "noise" else 1e3} if kind != "nan" else {}
    clean = _outputs(_model(), "blocks.0.mlp.fc", None, 3)
    for duration, rerun_hit in ((1, False), (0, True), (2, True)):
        spec = FaultSpec(kind=kind, rank=0, step=3, duration=duration, target="blocks.0.mlp.fc", seed=2, **extra)
        m = _model()
        inj = FaultInjector([spec], rank=0).attach(m)
        first = _outputs(m, "blocks.0.mlp.fc", inj, 3)
        rerun = _outputs(m, "blocks.0.mlp.fc", inj, 3)  # begin_step(3) again, before end_step
        assert inj.rerun == 1
        assert not torch.equal(first, clean)
        same = torch.allclose(rerun, first, rtol=0, atol=0, equal_nan=True)  # NaN is NaN here
        assert same if rerun_hit else torch.equal(rerun, clean), duration
        inj.end_step()
        again = _outputs(m, "blocks.0.mlp.fc", inj, 4)  # the next step: a first pass again
        assert inj.rerun == 0
        lasting = duration != 1
        assert torch.equal(again, _outputs(_model(), "blocks.0.mlp.fc", None, 4)) is not lasting


def test_a_rerun_leaves_the_learning_rate_and_the_data_faults_as_the_first_pass_did():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    faults = [FaultSpec(kind="lr_spike", rank=0, step=2, magnitude=50.0), FaultSpec(kind="bad_batch", rank=0, step=2)]
    inj = FaultInjector(faults, rank=0).attach(m, opt)
    inj.begin_step(2)
    garbage = inj.corrupt_batch(_batch(2))
    inj.begin_step(2)  # the rerun: the spike is not applied twice, the bad batch is the same data
    assert opt.param_groups[0]["lr"] == 0.1 * 50.0
    assert torch.equal(inj.corrupt_batch(_batch(2)), garbage)
    inj.end_step()
    assert opt.param_groups[0]["lr"] == 0.1
    inj.rank = 1  # another rank entering the same step (the simulated driver's ranks) is no rerun
    inj.begin_step(2)
    assert inj.rerun == 0


def test_bad_batch_is_garbage_of_the_same_shape_only_when_active():
    inj = FaultInjector([FaultSpec(kind="bad_batch", rank=2, step=4, duration=2, seed=1)], rank=2)
    batch = _batch()
    inj.begin_step(3)
    assert inj.corrupt_batch(batch) is batch
    inj.begin_step(4)
    g1 = inj.corrupt_batch(batch)
    assert g1.shape == batch.shape and g1.dtype == batch.dtype and not torch.equal(g1, batch)
    again = FaultInjector(inj.faults, rank=2)
    again.begin_step(4)
    assert torch.equal(again.corrupt_batch(batch), g1)
    inj.rank = 1
    assert inj.corrupt_batch(batch) is batch


def test_param_fault_flips_one_parameter_bit_once():
    m = _model()
    before = [p.detach().clone() for p in m.parameters()]
    inj = FaultInjector(
        [FaultSpec(kind="bitflip", rank=0, step=2, target="blocks.1.attn.proj", where="param", bit=5)], rank=0
    ).attach(m)
    inj.begin_step(1)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    inj.begin_step(2)
    diffs = [
        int((a.view(torch.int32) ^ b.detach().view(torch.int32)).count_nonzero())
        for a, b in zip(before, m.parameters())
    ]
    assert sum(diffs) == 1
    inj.begin_step(3)  # one change, not a toggle every step
    diffs = [
        int((a.view(torch.int32) ^ b.detach().view(torch.int32)).count_nonzero())
        for a, b in zip(before, m.parameters())
    ]
    assert sum(diffs) == 1


def test_injector_counts_the_cpu_time_of_its_own_corruption_only_when_a_fault_fires():
    spec = FaultSpec(kind="noise", rank=1, step=2, duration=1, target="blocks.*", magnitude=0.01, seed=1)
    m = _model()
    inj = FaultInjector([spec]).attach(m)
    for step, rank in ((0, 0), (0, 1), (2, 0)):
        _outputs(m, "head", inj, step, rank)
    assert inj.cpu_seconds == 0.0  # nothing fired: the rank's step time keeps everything
    _outputs(m, "head", inj, 2, 1)
    assert inj.cpu_seconds > 0.0 and inj.injections


# -- the injector says when a fault fires ----------------------------------------------------------


def _fired(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sdcwatch.faults" and r.levelname == "INFO"]


def test_each_fault_logs_once_per_rank_when_it_first_fires_not_every_step(caplog):
    faults = [
        FaultSpec(kind="noise", rank=None, step=2, duration=0, target="blocks.*.mlp.fc", magnitude=0.01, seed=1),
        FaultSpec(kind="nan", rank=1, step=3, target="blocks.0.attn.scores", seed=2),
        FaultSpec(kind="lr_spike", rank=0, step=4, duration=2, magnitude=10.0),
    ]
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    inj = FaultInjector(faults).attach(m, opt)
    caplog.set_level("INFO", logger="sdcwatch.faults")
    for step in range(7):
        for rank in (0, 1):
            _outputs(m, "head", inj, step, rank)
            inj.end_step()
        if step == 1:
            assert _fired(caplog) == []  # nothing fired before its step
    assert _fired(caplog) == [
        # a persistent fault on every rank: once per rank (the first module it reached), at step 2
        "fault 0 fired on rank 0 at step 2: noise at blocks.0.mlp.fc (output); on to the end of the run",
        "fault 0 fired on rank 1 at step 2: noise at blocks.0.mlp.fc (output); on to the end of the run",
        "fault 1 fired on rank 1 at step 3: nan at blocks.0.attn.scores (output)",
        "fault 2 fired on rank 0 at step 4: lr_spike at lr (optimizer); on until step 5",
    ]
    assert len(inj.injections) > 4  # it kept firing every step, and said so once


def test_grad_param_and_batch_faults_name_what_they_hit(caplog):
    caplog.set_level("INFO", logger="sdcwatch.faults")
    m = _model()
    inj = FaultInjector(
        [
            FaultSpec(kind="bitflip", rank=0, step=1, target="blocks.1.attn.proj", where="param", bit=5),
            FaultSpec(kind="scale", rank=0, step=1, target="blocks.0.mlp.fc", where="grad", magnitude=1000.0),
            FaultSpec(kind="bad_batch", rank=0, step=1),
        ],
        rank=0,
    ).attach(m)
    inj.begin_step(1)
    inj.corrupt_batch(_batch(1))
    m.loss(_batch(1)).backward()
    (param, batch, grad) = _fired(caplog)  # in the order they fired: at begin_step, on the data, in backward
    assert param.startswith("fault 0 fired on rank 0 at step 1: bitflip at blocks.1.attn.proj.") and "(param)" in param
    assert batch == "fault 2 fired on rank 0 at step 1: bad_batch at batch (data)"
    assert grad.startswith("fault 1 fired on rank 0 at step 1: scale at blocks.0.mlp.fc.") and grad.endswith("(grad)")


def _doc_blocks(section: str) -> dict[str, str]:
    """The first block of each language under ``section`` of docs/fault-injection.md."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "fault-injection.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, str] = {}
    for lang, code in re.findall(r"```(\w+)\n(.*?)```", body, re.S):
        blocks.setdefault(lang, code)
    return blocks


@pytest.mark.integration
def test_the_documented_plain_loop_runs_logs_its_fault_and_the_service_opens_the_incident(bootstrap, tmp_path):
    """docs/fault-injection.md's loop, as a user copies it with its fault file: it runs, says the
    NaN fired on rank 0 at step 5 (and nothing of rank 1's fault), and `sdcwatch incidents` shows
    the service's nonfinite incident at that step."""
    import subprocess
    import sys
    import uuid

    from polling import wait_for
    from serve_process import ServeProcess, Topics

    blocks = _doc_blocks("In your own training loop")
    (tmp_path / "faults.jsonl").write_text(blocks["json"])
    (tmp_path / "loop.py").write_text(blocks["python"])
    tag = uuid.uuid4().hex[:8]
    topics = Topics.fresh(tag)
    run = f"doc-{tag}"
    env = {
        **os.environ,
        "SDCWATCH_BOOTSTRAP": bootstrap,
        "SDCWATCH_RUN": run,
        "SDCWATCH_BUS_TELEMETRY_TOPIC": topics.telemetry,
        "OMP_NUM_THREADS": "1",
    }
    with ServeProcess(bootstrap, topics, tmp_path / "state", metrics_port=0) as serve:
        serve.wait_banner()
        out = subprocess.run(
            [sys.executable, "loop.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        fired = [line for line in out.stderr.splitlines() if "sdcwatch.faults" in line]
        assert fired == ["INFO:sdcwatch.faults:fault 0 fired on rank 0 at step 5: nan at fc1 (output)"], out.stderr
        serve.wait_incident("nonfinite")

        def listed():
            cmd = ["-m", "sdcwatch.incidents", "--json", "--run", run, "--bus-anomalies-topic", topics.anomalies]
            got = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True, timeout=60)
            assert got.returncode == 0, got.stderr
            return [json.loads(line) for line in got.stdout.splitlines()]

        incidents = wait_for(
            lambda: [e for e in listed() if e["kind"] == "nonfinite"], 30, "the incident", interval=0.5
        )
        assert [e["first_step"] for e in incidents] == [5]
        serve.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_near_inf_is_at_least_the_threshold_in_every_dtype(dtype):
    """1e10 rounds to 9.9992e9 in bf16, below the near-INF threshold: the injector rounds away from zero."""
    from sdcwatch.testbed.faults import at_least

    for value in (1e10, -1e10):
        v = float(at_least(value, dtype))
        assert abs(v) >= 1e10 and math.copysign(1, v) == math.copysign(1, value)
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(dtype)
    inj = FaultInjector([FaultSpec(kind="near_inf", step=0, target="0", where="output")]).attach(lin)
    inj.begin_step(0)
    out = lin(torch.ones(2, 4, dtype=dtype))
    inj.end_step()
    assert out.float().abs().max() >= 1e10
