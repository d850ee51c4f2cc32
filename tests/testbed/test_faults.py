"""The fault injector: spec validation, and faults that land exactly where, when and on whom asked."""

from __future__ import annotations

import json
import math

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
