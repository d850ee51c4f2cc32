"""Under a simulated ``tp x pp x dp`` layout a fault's detectability is that of the check of its
rank's own share: a tensor-parallel rank checks its part of each product, so the bound a campaign
records (testbed.shard_injector.BoundedShardInjector) is the bound of the culprit's share of the
tensor it hit, the one that rank's forward checksum holds it to."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.telemetry.probes.config import ProbeConfig  # noqa: E402
from sdcwatch.testbed.fault_bounds import (  # noqa: E402
    CoveredInjection,
    bias_grad_bound,
    linear_bound,
    memory_bound,
    weight_grad_bound,
)
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from sdcwatch.testbed.model import GPTConfig  # noqa: E402
from sdcwatch.testbed.parallel3d import ParallelSimulatedRun  # noqa: E402
from sdcwatch.testbed.shard_injector import ShardInjector  # noqa: E402
from sdcwatch.testbed.shard_plan import parse_layout, rank_at  # noqa: E402
from sdcwatch.testbed.simulated import shared_corpus  # noqa: E402

torch.set_num_threads(1)
SMALL = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4)  # 4 heads of 8; MLP width 128
LAYOUT = parse_layout("tp=2,pp=2,dp=2")
STEP = 3


def _at(d: int, p: int, t: int) -> int:
    return rank_at(LAYOUT, d, p, t)


#: (replica, stage, tensor shard) of each fault's rank, and the fault
FAULTS = {
    "fc out": ((1, 0, 1), {"kind": "near_inf", "magnitude": 8.0, "target": "blocks.0.mlp.fc"}),  # column-parallel
    "proj out": ((0, 1, 0), {"kind": "near_inf", "magnitude": 8.0, "target": "blocks.1.attn.proj"}),  # partial sum
    "mix out": ((1, 1, 1), {"kind": "near_inf", "magnitude": 8.0, "target": "blocks.1.attn.mix"}),  # its heads
    "qkv grad": ((0, 0, 0), {"kind": "bitflip", "bit": 25, "where": "grad", "target": "blocks.0.attn.qkv"}),
    "proj param": ((1, 1, 0), {"kind": "bitflip", "bit": 25, "where": "param", "target": "blocks.1.mlp.proj"}),
    "block out": ((0, 0, 1), {"kind": "near_inf", "magnitude": 8.0, "target": "blocks.0"}),  # no checksum
}


def _qkv_rows(t: int) -> torch.Tensor:
    """The rows of the fused [q | k | v] weight shard ``t`` of 2 holds: its 2 heads of 8 in each."""
    return torch.cat([torch.arange(16 * t, 16 * t + 16) + 32 * j for j in range(3)])


#: fault seed -> what its gradient and memory faults hit (the weight's element or the bias's)
SEEDS = {1: "weight", 2: "bias"}


@pytest.fixture(scope="module", params=sorted(SEEDS), ids=[SEEDS[s] for s in sorted(SEEDS)])
def bounded(request):
    faults = [
        FaultSpec.from_dict({"rank": _at(*place), "step": STEP, "seed": request.param, **f})
        for place, f in FAULTS.values()
    ]
    recs: dict[int, dict] = {}

    class Keep:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def emit(self, step, *, layers=None, fingerprints=None, time=None, **scalars):
            if step == STEP:
                recs[self.rank] = layers or {}

    run = ParallelSimulatedRun(
        LAYOUT,
        seed=0,
        faults=faults,
        model=SMALL,
        batch_size=2,
        corpus=shared_corpus(1 << 18),
        probes=ProbeConfig(checksum_every=1),
        emitter_factory=lambda rank: Keep(rank),
        fault_bounds=True,
    )
    seen: dict[str, torch.Tensor] = {}

    def capture(name: str, replica: int):
        """The layer's input (and output gradient) in ``replica``'s training pass of STEP."""

        def hook(module, args, out):
            if run.step == STEP and run.probe.replica == replica and out.requires_grad:
                seen[f"{name} x"] = args[0].detach().clone()
                out.register_hook(lambda g: seen.__setitem__(f"{name} dy", g.detach().clone()))

        return hook

    model = run.model
    model.get_submodule("blocks.0.mlp.fc").register_forward_hook(capture("fc", 1))
    model.get_submodule("blocks.0.attn.qkv").register_forward_hook(capture("qkv", 0))

    def before(step: int, run) -> None:
        if step == STEP - 1:  # the weights of step STEP, as the optimizer left them (before the memory fault)
            for name in ("blocks.1.mlp.proj", "blocks.0.mlp.fc"):
                layer = model.get_submodule(name)
                seen[f"{name} weight"], seen[f"{name} bias"] = (
                    layer.weight.detach().clone(),
                    layer.bias.detach().clone(),
                )

    try:
        run.train(STEP + 1, on_step=before)
        injections = list(run.injector.injections)
    finally:
        run.close()
    assert len(injections) == len(FAULTS) and all(isinstance(i, CoveredInjection) for i in injections)
    by = {label: next(i for i in injections if i.rank == _at(*place)) for label, (place, _) in FAULTS.items()}
    assert {by["qkv grad"].target, by["proj param"].target} == {
        f"blocks.0.attn.qkv.{SEEDS[request.param]}",
        f"blocks.1.mlp.proj.{SEEDS[request.param]}",
    }
    return run, by, recs, seen


def test_each_fault_names_the_check_that_covers_its_tensor(bounded):
    _, by, _, _ = bounded
    assert {label: i.check for label, i in by.items()} == {
        "fc out": "gemm_fwd",
        "proj out": "gemm_fwd",
        "mix out": "gemm_fwd",
        "qkv grad": "gemm_bwd",
        "proj param": "gemm_weight",
        "block out": None,
    }
    assert by["block out"].bound is None
    assert all(i.bound > 0 for label, i in by.items() if label != "block out")


def test_the_bound_is_the_one_the_culprit_forward_checksum_holds_its_share_to(bounded):
    """On a checked step the culprit's ratio for the product is its share's residual (the change)
    over its share's bound: the injection's bound, not the whole product's."""
    run, by, recs, _ = bounded
    for label in ("fc out", "proj out", "mix out"):
        inj = by[label]
        stage = LAYOUT.coords(inj.rank)["pp"]
        index = run.probe.stage_products[stage].index(inj.target)
        ratio = recs[inj.rank]["gemm_fwd"][index]
        change = abs(float(inj.after) - float(inj.before))
        assert ratio == pytest.approx(change / inj.bound, rel=1e-3), label


def test_the_bound_is_that_of_the_rank_share_of_the_tensor(bounded):
    """Worked out by hand from the tensors the fault met: the output features of a column-parallel
    layer shard 1 holds, the input features of a row-parallel weight shard 0 holds, the heads' rows
    of the fused qkv's gradient shard 0 holds; each smaller than the whole tensor's bound."""
    _, by, _, seen = bounded
    x, w, b = seen["fc x"], seen["blocks.0.mlp.fc weight"], seen["blocks.0.mlp.fc bias"]
    mine = slice(64, 128)  # shard 1's half of the MLP width
    assert by["fc out"].bound == pytest.approx(linear_bound(x, w[mine], b[mine], x.dtype), rel=1e-6)
    assert by["fc out"].bound < 0.8 * linear_bound(x, w, b, x.dtype)

    proj = by["proj param"]
    if proj.target.endswith("weight"):  # shard 0's half of the MLP width: the proj weight's input columns
        expected = memory_bound(seen["blocks.1.mlp.proj weight"][:, :64])
        assert proj.bound < 0.8 * memory_bound(seen["blocks.1.mlp.proj weight"])
    else:  # a row-parallel layer's bias is added after the all-reduce: every rank holds all of it
        expected = memory_bound(seen["blocks.1.mlp.proj bias"])
    assert proj.bound == pytest.approx(expected, rel=1e-6)

    grad = by["qkv grad"]
    x, dy = seen["qkv x"], seen["qkv dy"][..., _qkv_rows(0)]
    if grad.target.endswith("weight"):
        expected = weight_grad_bound(x, dy, torch.zeros(48, 32))
    else:
        expected = bias_grad_bound(dy, torch.zeros(48))
    assert grad.bound == pytest.approx(expected, rel=1e-6)


def test_the_training_injector_of_a_layout_keeps_no_bound():
    """The bound costs the campaign only: without ``fault_bounds`` the pieces' injectors record plain injections."""
    fault = FaultSpec.from_dict({"rank": _at(1, 0, 1), "step": 1, "seed": 1, **FAULTS["fc out"][1]})
    run = ParallelSimulatedRun(LAYOUT, seed=0, faults=[fault], model=SMALL, batch_size=2, corpus=shared_corpus(1 << 18))
    try:
        run.train(2)
        (inj,) = run.injector.injections
    finally:
        run.close()
    assert all(type(x) is ShardInjector for x in run.injectors)
    assert not isinstance(inj, CoveredInjection) and not hasattr(inj, "bound")
