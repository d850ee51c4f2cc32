"""The per-product canary: one linear layer's product of a fixed input per step, in rotation, whose
fingerprint must agree across replicas; a rank whose products are a little off is named by the
vote (in one process, in the simulated runs and in a real gloo FSDP2 job)."""

from __future__ import annotations

import uuid

import pytest

torch = pytest.importorskip("torch")

from reference_loop import train_reference  # noqa: E402
from sdcwatch.core.incident import Incident, Severity  # noqa: E402
from sdcwatch.core.record_type import Record  # noqa: E402
from sdcwatch.detectors.frame import StepFrame  # noqa: E402
from sdcwatch.detectors.replica import ReplicaDivergenceDetector  # noqa: E402
from sdcwatch.service.control_policy import ControlPolicy  # noqa: E402
from sdcwatch.telemetry.probes.gemm_canary import GemmCanary, known_input  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.testbed.faults import FaultInjector  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4)
LINEARS = ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"]


class Recorder:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def emit(self, step, *, layers=None, fingerprints=None, **scalars) -> None:
        self.records.append({"step": step, "layers": layers, "fingerprints": fingerprints})


def _noise(rank: int = 0, step: int = 0, target: str = "blocks.0.mlp.fc", magnitude: float = 1e-4) -> FaultSpec:
    return FaultSpec(kind="noise", rank=rank, step=step, duration=0, target=target, magnitude=magnitude, seed=3)


def _twins() -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    a = GPT(CFG)
    b = GPT(CFG)
    b.load_state_dict(a.state_dict())
    return a, b


def test_the_known_input_depends_on_the_shape_alone():
    x = known_input(32, 96, torch.float32, "cpu")
    torch.manual_seed(123)  # the global generator plays no part
    assert torch.equal(known_input(32, 96, torch.float32, "cpu"), x) and x.shape == (4, 32)
    assert not torch.equal(known_input(32, 128, torch.float32, "cpu"), x)
    assert known_input(32, 96, torch.bfloat16, "cpu").dtype == torch.bfloat16


def test_the_products_rotate_in_registration_order_and_replicas_agree_bit_for_bit():
    a, b = _twins()
    ca, cb = GemmCanary(a), GemmCanary(b)
    assert [n for n, _ in ca.products] == LINEARS + [n.replace(".0.", ".1.") for n in LINEARS] + ["head"]
    n = len(ca.products)
    assert ca.product_at(3)[0] == ca.product_at(3 + n)[0] == "blocks.0.mlp.proj"
    got = [int(ca.fingerprint(s)) for s in range(n)]
    assert got == [int(cb.fingerprint(s)) for s in range(n)]
    assert len(set(got)) == n  # a different product each step
    with torch.no_grad():
        b.blocks[1].mlp.fc.weight[0, 0] += 1e-3  # a replica's weight differs: its product does
    assert [int(cb.fingerprint(s)) == g for s, g in enumerate(got)] == [s != 6 for s in range(n)]


def test_a_faulty_units_noise_reaches_the_canary_through_the_modules_own_hooks():
    """Relative noise of 1e-4 on one product's output (the campaign's unhealthy node at its mildest,
    far below the checksum's rounding bound) changes that product's canary, and only that one."""
    a, b = _twins()
    injector = FaultInjector([_noise(rank=1)], rank=1).attach(b)
    injector.begin_step(5)
    ca, cb = GemmCanary(a), GemmCanary(b)
    differs = [int(ca.fingerprint(s)) != int(cb.fingerprint(s)) for s in range(9)]
    assert differs == [s == 2 for s in range(9)]  # blocks.0.mlp.fc
    injector.rank = 0  # the fault is rank 1's: on another rank the same module computes cleanly
    assert int(ca.fingerprint(2)) == int(cb.fingerprint(2))


@pytest.mark.parametrize("bounded", [False, True])
def test_the_canary_is_the_layers_product_through_its_fault_hooks_and_no_other_hook(bounded):
    """The product is ``F.linear`` on the layer's weights, passed through the fault injectors' output
    hooks only (:func:`output_faults`): the module's other hooks (a probe's, a user's) never run.
    An injector subclass that wraps the hooks (the campaign's, which records each fault's bound)
    corrupts it alike."""
    from sdcwatch.telemetry.probes import fingerprint as fp
    from sdcwatch.telemetry.probes.output_faults import output_faults
    from sdcwatch.testbed.fault_bounds import BoundedInjector

    a, b = _twins()
    fc = b.blocks[0].mlp.fc
    calls = []
    fc.register_forward_hook(lambda m, args, out: calls.append(1))
    assert output_faults(fc) == []
    x = known_input(fc.in_features, fc.out_features, fc.weight.dtype, fc.weight.device)
    with torch.no_grad():
        clean = int(fp.fingerprint_device([torch.nn.functional.linear(x, fc.weight, fc.bias)]))
    canary = GemmCanary(b)
    assert int(canary.fingerprint(2)) == clean and calls == []
    injector = (BoundedInjector if bounded else FaultInjector)([_noise(rank=1)], rank=1).attach(b)
    injector.begin_step(5)
    assert len(output_faults(fc)) == 1 and output_faults(b.blocks[0].mlp.proj) == []
    assert int(canary.fingerprint(2)) != clean and calls == []  # the fault reaches it, the other hook does not run
    assert int(canary.fingerprint(2)) == int(GemmCanary(b).fingerprint(2))  # the same noise at the same step
    injector.detach()
    assert output_faults(fc) == [] and int(canary.fingerprint(2)) == clean


def test_the_probes_do_not_record_the_canary_and_report_it_every_step():
    """The canary's product goes through the module, not through the step's measurements: every other
    metric of the record is what it is with the canary off."""
    records = []
    for every in (1, 0):
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        rec = Recorder()
        watch = attach(model, rec, optimizer=opt, gemm_canary_every=every, checksum_every=2, activations_every=1)
        train_reference(model, opt, watch, 4, seed=1)
        watch.close()
        records.append(rec.records)
    with_canary, without = records
    for a, b in zip(with_canary, without):
        assert a["layers"] == b["layers"]
        fps = dict(a["fingerprints"])
        assert "gemm_canary_fp" in fps and (b["fingerprints"] or {}) == {
            k: v for k, v in fps.items() if k != "gemm_canary_fp"
        }


def _record(rank: int, fp: int, coords: dict | None, param_fp: int | None = None) -> Record:
    fps = {"gemm_canary_fp": fp}
    if param_fp is not None:
        fps["param_fp"] = param_fp
    return Record(
        run="r", step=7, rank=rank, world=4, host=f"h{rank}", time=1.0, scalars={"loss": 1.0}, fingerprints=fps,
        coords=coords or {},
    )  # fmt: skip


def test_the_canary_is_voted_over_the_peer_group_where_every_shard_is_unique():
    """Plain FSDP over 4 ranks: each rank its own shard (its replica group is itself), but the canary
    is computed on the gathered weight, the same on all four: the odd one is named."""
    coords = [{"dp_replicate": 0, "dp_shard": r} for r in range(4)]
    records = [_record(r, 11 if r != 2 else 12, coords[r], param_fp=100 + r) for r in range(4)]
    [f] = ReplicaDivergenceDetector().update(StepFrame.from_records("r", 7, 4, records))
    assert f.ranks == (2,) and f.metric == "gemm_canary_fp"
    assert f.evidence["metrics"] == {"gemm_canary_fp": [2]}  # the unique shards' param_fp: no vote, no blame
    # two pieces of a pipeline: each votes within its own
    piece = [{"pp": r // 2, "dp_replicate": 0, "dp_shard": r % 2} for r in range(4)]
    records = [_record(r, 20 + r // 2, piece[r]) for r in range(4)]
    assert ReplicaDivergenceDetector(min_world=2).update(StepFrame.from_records("r", 7, 4, records)) == []


def test_a_shard_changed_in_memory_is_not_blamed_on_the_ranks_that_gathered_it():
    """HSDP, 3 replicas x 2 shards: a flipped bit in rank 4's shard reaches the gathered weight of
    ranks 4 and 5 (replica 2): both canaries disagree, but only rank 4's own shard does: rank 4
    alone is named, by param_fp. A compute fault on rank 5 alone is named by the canary."""
    coords = [{"dp_replicate": r // 2, "dp_shard": r % 2} for r in range(6)]

    def frame(canary: list[int], params: list[int]) -> StepFrame:
        records = [
            Record(
                run="r",
                step=7,
                rank=r,
                world=6,
                host=f"h{r}",
                time=1.0,
                scalars={"loss": 1.0},
                fingerprints={"gemm_canary_fp": canary[r], "param_fp": params[r]},
                coords=coords[r],
            )  # fmt: skip
            for r in range(6)
        ]
        return StepFrame.from_records("r", 7, 6, records)

    shards = [100, 101, 100, 101, 100, 101]
    [f] = ReplicaDivergenceDetector().update(frame([1, 1, 1, 1, 2, 2], [*shards[:4], 999, 101]))
    assert f.ranks == (4,) and f.evidence["metrics"] == {"param_fp": [4]}
    [f] = ReplicaDivergenceDetector().update(frame([1, 1, 1, 1, 1, 2], shards))
    assert f.ranks == (5,) and f.evidence["metrics"] == {"gemm_canary_fp": [5]}


def test_a_canary_divergence_alone_asks_for_an_eviction_and_with_the_parameters_a_rollback():
    policy = ControlPolicy(actions=True)

    def incident(metrics: dict) -> Incident:
        return Incident(
            id="i1", run="r", kind="replica_divergence", severity=Severity.CRITICAL, first_step=3, last_step=3,
            ranks=(2,), message="m", evidence={"metrics": metrics},
        )  # fmt: skip

    assert policy.rule(incident({"gemm_canary_fp": [2]})) == ("on_canary_divergence", "evict")
    assert policy.rule(incident({"gemm_canary_fp": [2], "param_fp": [2]}))[1] == "rollback"


def _named(records: list[Record], world: int) -> list[tuple[int, tuple[int, ...], str]]:
    from sdcwatch.service.pipeline import DetectionPipeline

    pipe = DetectionPipeline()
    pipe.book.history = []
    pipe.process(sorted(records, key=lambda r: (r.step, r.rank)))
    pipe.flush()
    return [(i.first_step, i.ranks, i.kind) for i in pipe.book.history]


@pytest.mark.slow
def test_simulated_runs_name_an_unhealthy_rank_by_the_canary_vote():
    """The pure data-parallel and the 3D simulation, shipped default probes: noise of 1e-4 on one
    rank's MLP products from step 2 on is named by the vote at the step its canary checks one."""
    from sdcwatch.telemetry.probes.presets import PROBE_PRESETS
    from sdcwatch.testbed.parallel3d import ParallelSimulatedRun
    from sdcwatch.testbed.shard_plan import parse_layout, rank_at
    from sdcwatch.testbed.simulated import SimulatedRun

    class Sink:
        def __init__(self, rank: int, **kw) -> None:
            self.rank, self.coords, self.out = rank, kw.get("coords") or {}, []

        def emit(self, step, *, layers=None, fingerprints=None, **scalars) -> None:
            self.out.append(
                Record(
                    run="sim",
                    step=step,
                    rank=self.rank,
                    world=world,
                    host=f"h{self.rank}",
                    time=1.0,
                    scalars=scalars,
                    fingerprints=fingerprints or {},
                    layers=layers or {},
                    coords=self.coords,
                )  # fmt: skip
            )

    for layout in (None, "tp=2,pp=2,dp=4"):
        sinks: list[Sink] = []
        factory = lambda r, coords=None: sinks.append(Sink(r, coords=coords)) or sinks[-1]  # noqa: E731
        common = dict(seed=0, emitter_factory=factory, batch_size=2, probes=PROBE_PRESETS["default"], model=CFG)
        if layout is None:
            world, bad = 4, 3
            run = SimulatedRun(world=4, faults=[_noise(bad, 2, "blocks.*.mlp.fc")], **common)
        else:  # a rank of the last stage: its canary rotates over blocks.1's products and the head
            world, bad = 16, rank_at(parse_layout(layout), 2, 1, 1)
            run = ParallelSimulatedRun(layout, faults=[_noise(bad, 2, "blocks.*.mlp.fc")], **common)
        run.train(5)
        run.close()
        found = [x for x in _named([r for s in sinks for r in s.out], world) if x[2] == "replica_divergence"]
        # step 2 checks the first MLP product each rank holds (blocks.0.mlp.fc; blocks.1's on stage 1)
        assert found and found[0][:2] == (2, (bad,)), (layout, found)
        assert all(x[1] == (bad,) for x in found), found


@pytest.mark.integration
@pytest.mark.parametrize(
    "world, replicate, bad",
    [(3, 1, 1), (4, 2, 3)],
    ids=["fsdp-3-ranks", "hsdp-2x2"],
)
@pytest.mark.slow
def test_a_real_fsdp_job_names_the_rank_whose_products_are_a_little_off(tmp_path, world, replicate, bad):
    """FSDP2 over 3 gloo processes, and HSDP of 2 replicas x 2 shards, at the shipped default probes:
    one rank's MLP products carry relative noise of 1e-4 from step 1 on. Under FSDP every shard is
    unique, and under HSDP 2 x 2 two replicas of a shard cannot outvote each other; the canary runs
    on the gathered weights, the same on every rank of the data-parallel group, so its vote names
    the noisy rank at the first step that checks an MLP product, and nothing is raised before."""
    from sdcwatch.service.offline import read_records
    from sdcwatch.telemetry import is_end_marker
    from sdcwatch.testbed.fsdp_run import FSDPSettings, launch

    settings = FSDPSettings(
        steps=4,
        world=world,
        replicate=replicate,
        seed=0,
        run="fsdp-canary",
        jsonl_dir=str(tmp_path),
        topic=f"fsdp.{uuid.uuid4().hex[:8]}",
        corpus_bytes=1 << 18,
        ranks_per_host=1,
        clip=None,
        probes={"attention_every": 16},  # the shipped default
        faults=(_noise(rank=bad, step=1, target="blocks.*.mlp.fc"),),
    )
    launch(settings)
    records = [r for rank in range(world) for r in read_records(tmp_path / f"rank{rank}.jsonl") if not is_end_marker(r)]
    table = {(r.step, r.rank): r for r in records}
    fps = {s: [table[s, r].fingerprints["gemm_canary_fp"] for r in range(world)] for s in range(4)}
    assert [len(set(v)) for v in fps.values()] == [1, 1, 2, 1]  # step 2 checks blocks.0.mlp.fc
    healthy = {fps[2][r] for r in range(world) if r != bad}
    assert len(healthy) == 1 and fps[2][bad] not in healthy
    found = [x for x in _named(records, world) if x[2] == "replica_divergence"]
    assert found and found[0][:2] == (2, (bad,)), found


def test_a_product_the_canary_cannot_compute_is_skipped_and_the_record_still_goes_out():
    class Packed(torch.nn.Linear):  # a weight layout of its own (a quantized layer's, say)
        def forward(self, x):
            if x.shape[0] == 4:
                raise RuntimeError("packed weights need the packed kernel")
            return super().forward(x)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Packed(8, 8))
    rec = Recorder()
    watch = attach(model, rec, attention="none")
    for step in range(4):
        model(torch.randn(3, 8)).sum().backward()
        watch.step(step, loss=torch.tensor(1.0))
    watch.close()
    assert [r["step"] for r in rec.records] == [0, 1, 2, 3] and watch.errors == 0
    assert ["gemm_canary_fp" in (r["fingerprints"] or {}) for r in rec.records] == [True, False, True, False]
    assert watch.gemm_canary.failed == {"1"}


def test_sampled_canaries_still_visit_every_product_in_turn():
    torch.manual_seed(0)
    model = GPT(CFG)
    rec = Recorder()
    watch = attach(model, rec, gemm_canary_every=3, attention="none")
    assert [watch.gemm_canary.product_at(s)[0] for s in (0, 3, 6, 9)] == LINEARS
    for step in range(7):
        model.loss(torch.randint(0, 256, (2, CFG.seq_len + 1), generator=torch.Generator().manual_seed(step)))
        watch.step(step)
    watch.close()
    assert [r["step"] for r in rec.records if "gemm_canary_fp" in (r["fingerprints"] or {})] == [0, 3, 6]
