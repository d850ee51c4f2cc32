"""Compare like with like: detectors under a tp=2, pp=2, dp=4 layout work within peer groups.

Healthy ranks whose numbers differ by tensor and pipeline coordinate raise nothing; a perturbed
rank is named with its coordinates; groups too small to judge say so instead of flagging.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from mesh_synth import MeshFault, MeshRun
from polling import step_until
from sdcwatch.core.incident import Incident, Severity
from sdcwatch.core.jsonsafe import json_safe
from sdcwatch.core.mesh import DIMS
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC
from sdcwatch.detectors.checksum import ChecksumDetector
from sdcwatch.detectors.nonfinite import NonFiniteDetector
from sdcwatch.detectors.peers import KEYS, Groups, grouped_median, grouped_robust, rank_label
from sdcwatch.detectors.rank_outlier import RankOutlierDetector
from sdcwatch.detectors.replica import ReplicaDivergenceDetector
from sdcwatch.detectors.straggler import StragglerDetector
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.summary import decode_summary, encode_summary

STEPS = 160


def _run(mesh: MeshRun, steps: int = STEPS, *, role: str = "both"):
    """Every incident of ``steps`` steps through the default pipeline (optionally split in two
    stages with the summaries encoded on the way, as the scale-out sends them)."""
    if role == "both":
        pipe = DetectionPipeline()
        events = [e for s in range(steps) for e in pipe.process_frame(mesh.frame(s))]
        return pipe, [e.incident for e in events if e.change == "opened"]
    spatial, temporal = DetectionPipeline(stage="spatial"), DetectionPipeline(stage="temporal")
    events = []
    for s in range(steps):
        spatial.process_frame(mesh.frame(s))
        sent = [decode_summary(encode_summary(x)) for x in spatial.take_summaries()]
        events += temporal.process_summaries(sent)
    events += temporal.flush()
    return temporal, [e.incident for e in events if e.change == "opened"]


# -- the groupings ----------------------------------------------------------------------------


def test_peer_replica_and_stage_groups_of_a_3d_layout():
    mesh = MeshRun(tp=2, pp=2, dp=4)
    f = mesh.frame(0)
    peers, replicas, stages = f.peers, f.replicas, f.groups("stage")
    assert peers.n == 4 and (peers.sizes == 4).all()  # (tp, pp) pieces, 4 data-parallel replicas each
    assert replicas.n == 4  # no dp_shard: the replica group is the peer group
    assert stages.n == 2 and (stages.sizes == 8).all()
    for r in range(mesh.world):
        same = set(peers.members(int(peers.ids[r])).tolist())
        want = {
            q
            for q in range(mesh.world)
            if {**mesh.coords(q), "dp_replicate": 0} == {**mesh.coords(r), "dp_replicate": 0}
        }
        assert same == want


def test_records_without_coordinates_are_one_group():
    f = MeshRun().frame(0)
    f.coords = None
    assert f.peers.trivial and f.replicas.trivial and f.groups("stage").trivial


def test_hsdp_shards_split_replica_groups_but_not_peer_groups():
    coords = np.full((8, len(DIMS)), -1)
    coords[:, DIMS.index("dp_replicate")] = np.arange(8) // 4
    coords[:, DIMS.index("dp_shard")] = np.arange(8) % 4
    assert Groups.of(coords, 8, "peer").trivial
    rep = Groups.of(coords, 8, "replica")
    assert rep.n == 4 and [rep.members(g).tolist() for g in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_grouped_statistics_match_numpy_per_group_with_unequal_groups_and_nans():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 5, 200)
    g = Groups(ids, 5)
    X = rng.standard_normal((3, 200))
    X[0, ::7] = np.nan
    X[1, 3] = np.inf
    med, mad, meandev, count = grouped_robust(g.gather(X))
    for k in range(3):
        for j in range(5):
            v = X[k, ids == j]
            v = v[np.isfinite(v)]
            assert count[k, j] == v.size
            assert med[k, j] == pytest.approx(np.median(v))
            assert mad[k, j] == pytest.approx(np.median(np.abs(v - np.median(v))))
            assert meandev[k, j] == pytest.approx(np.mean(np.abs(v - np.median(v))))
    m, n = grouped_median(X[0], g)
    assert m == pytest.approx([np.nanmedian(X[0, ids == j]) for j in range(5)])


# -- healthy ranks that differ by coordinate raise nothing -------------------------------------


@pytest.mark.parametrize("role", ["both", "split"])
def test_a_clean_3d_run_raises_nothing(role):
    _, incidents = _run(MeshRun(), role=role)
    assert incidents == []


def test_an_unhealthy_rank_hides_when_compared_with_every_rank():
    """Why peer groups: over all ranks the by-design differences between pieces swamp a small
    deviation that its own peers show within tens of steps."""
    mesh = MeshRun(faults=[MeshFault("rank_shift", step=40, rank=MeshRun().rank_of(tp=1, pp=0, dp=2))])
    named = {True: [], False: []}
    for grouped in (True, False):
        det = RankOutlierDetector()
        for s in range(200):
            f = mesh.frame(s)
            if not grouped:
                f.coords = None
            named[grouped] += [x.step for x in det.update(f) if x.kind == "rank_outlier"]
    assert named[True] and named[True][0] < 40 + 50
    assert named[False] == []


# -- a perturbed rank is named with its coordinates --------------------------------------------


@pytest.mark.parametrize("role", ["both", "split"])
def test_an_unhealthy_rank_is_named_with_its_coordinates(role):
    mesh = MeshRun(faults=[MeshFault("rank_shift", step=40, rank=0)])
    bad = mesh.rank_of(tp=1, pp=0, dp=2)
    mesh.faults[0].rank = bad
    _, incidents = _run(mesh, role=role)
    named = [i for i in incidents if bad in i.ranks]
    assert named and all(i.ranks == (bad,) for i in incidents if i.severity is not Severity.INFO)
    assert named[0].first_step < 40 + 50
    assert f"rank {bad} (host {mesh.host(bad)}) at pp=0,dp_replicate=2,tp=1" in named[0].message
    assert named[0].coords == ({"pp": 0, "dp_replicate": 2, "tp": 1},)
    assert Incident.from_dict(named[0].to_dict()).coords == named[0].coords


def test_a_nan_is_blamed_on_its_rank_not_on_the_pipeline_it_reached():
    origin = MeshRun().rank_of(tp=1, pp=0, dp=2)
    mesh = MeshRun(faults=[MeshFault("nonfinite", step=30, rank=origin)])
    det = NonFiniteDetector()
    [f] = det.update(mesh.frame(30))
    assert f.ranks == (origin,)
    assert f.metric == "attn_logit_max" and f.layer == 1
    # its pipeline: the later stage's activations, every stage's gradients (the backward pass)
    pipeline = [mesh.rank_of(tp=t, pp=p, dp=2) for p in range(2) for t in range(2)]
    assert f.evidence["pipeline_followers"] == sorted(set(pipeline) - {origin})
    # the global norm went NaN everywhere, but only the 3 other replicas of its piece all-reduce with it
    assert "the all-reduced values of 3 other rank(s) followed" in f.message
    assert "3 other rank(s) of its pipeline received it (activations, gradients)" in f.message
    assert rank_label(mesh.frame(30), origin) in f.message


def test_a_nan_without_coordinates_counts_every_rank_as_before():
    origin = MeshRun().rank_of(tp=1, pp=0, dp=2)
    mesh = MeshRun(faults=[MeshFault("nonfinite", step=30, rank=origin)])
    frame = mesh.frame(30)
    frame.coords = None
    [f] = NonFiniteDetector().update(frame)
    assert len(f.ranks) == 4  # its whole pipeline: no coordinates to tell the origin from the rest
    assert "the all-reduced values of 12 other rank(s) followed" in f.message


def test_shard_fingerprints_are_voted_within_their_replica_group():
    mesh = MeshRun()
    det = ReplicaDivergenceDetector()
    assert det.update(mesh.frame(5)) == []  # each (tp, pp) shard has its own fingerprint
    bad = mesh.rank_of(tp=0, pp=1, dp=3)
    mesh.faults = [MeshFault("replica", step=6, rank=bad)]
    [f] = det.update(mesh.frame(6))
    assert f.ranks == (bad,) and f.metric == "param_fp"
    assert "rank 14 (host node3) at pp=1,dp_replicate=3,tp=0" in f.message
    flat = mesh.frame(5)
    flat.coords = None  # compared over all ranks, the four shards' fingerprints have no majority
    assert [x.message.startswith("replicas split") for x in det.update(flat)] == [True]


def test_a_replica_group_of_two_that_disagrees_is_split_not_blamed():
    mesh = MeshRun(dp=2)
    bad = mesh.rank_of(tp=1, pp=1, dp=1)
    mesh.faults = [MeshFault("replica", step=3, rank=bad)]
    [f] = ReplicaDivergenceDetector().update(mesh.frame(3))
    assert f.ranks == () and "too few to tell which is wrong" in f.message
    assert sorted(f.evidence["split_ranks"]["param_fp"]) == sorted([bad, mesh.rank_of(tp=1, pp=1, dp=0)])


def test_stragglers_are_judged_within_their_pipeline_stage():
    mesh = MeshRun()  # the last stage is 1.4x slower by design
    det = StragglerDetector()
    assert [x for s in range(60) for x in det.update(mesh.frame(s))] == []
    bad = mesh.rank_of(tp=0, pp=0, dp=1)
    mesh.faults = [MeshFault("straggler", step=60, rank=bad)]
    found = [x for s in range(60, 100) for x in det.update(mesh.frame(s))]
    assert found and {x.ranks for x in found} == {(bad,)}
    assert "its pipeline stage's median" in found[0].message and "at pp=0,dp_replicate=1,tp=0" in found[0].message


def test_a_checksum_outlier_is_judged_against_its_peers():
    """Under the rounding bound, far above its peers' P90, while another shard's residuals are
    normally that large: named only when compared within the peer group."""
    mesh = MeshRun()
    bad = mesh.rank_of(tp=0, pp=1, dp=0)
    mesh.faults = [MeshFault("checksum_outlier", step=7, rank=bad)]
    frame = mesh.frame(7)
    [f] = ChecksumDetector().update(frame)
    assert f.kind == "checksum_outlier" and f.ranks == (bad,) and f.layer == 1
    assert "at pp=1,dp_replicate=0,tp=0" in f.message
    frame.coords = None
    assert ChecksumDetector().update(frame) == []  # against every rank's P90 it hides
    assert ChecksumDetector().update(mesh.frame(8)) == []


def test_a_missing_rank_is_named_with_its_coordinates_and_an_unwatched_piece_is_said():
    mesh = MeshRun()
    gone = mesh.rank_of(tp=1, pp=0, dp=3)
    mesh.faults = [MeshFault("missing", step=10, rank=gone)]
    _, incidents = _run(mesh, 30)
    [inc] = [i for i in incidents if i.kind == "missing_rank"]
    assert inc.ranks == (gone,) and "at pp=0,dp_replicate=3,tp=1" in inc.message
    piece = [mesh.rank_of(tp=1, pp=0, dp=d) for d in range(4)]
    _, incidents = _run(MeshRun(faults=[MeshFault("missing", step=10, rank=r) for r in piece]), 30)
    [inc] = [i for i in incidents if i.kind == "missing_rank"]
    assert inc.ranks == tuple(piece)
    assert inc.evidence["unwatched_pieces"] == ["pp=0,tp=1"] and "no rank of pp=0,tp=1 reports" in inc.message


def test_peer_groups_too_small_to_judge_say_so_and_flag_nothing():
    mesh = MeshRun(dp=2)  # 4 pieces of 2 replicas: fewer than rank_outlier.min_world
    mesh.faults = [MeshFault("rank_shift", step=20, rank=mesh.rank_of(tp=0, pp=0, dp=1))]
    det = RankOutlierDetector()
    found = [x for s in range(120) for x in det.update(mesh.frame(s))]
    assert [x.kind for x in found] == ["peers_too_few"]  # said once, not every step
    assert found[0].severity is Severity.INFO
    assert "8 rank(s) in 4 peer group(s) of fewer than 4 ranks" in found[0].message


def test_a_frame_with_coordinates_of_one_data_parallel_group_judges_as_without():
    """Pure data parallelism with coordinates (only dp_replicate) is one peer group: the same
    findings as the same steps without coordinates."""
    from detector_synth import Fault, SyntheticRun, findings_key

    run = SyntheticRun(faults=[Fault("rank_shift", 30, rank=3)])
    a, b = RankOutlierDetector(), RankOutlierDetector()
    fa, fb = [], []
    for s in range(100):
        plain = run.frame(s)
        fa += a.update(plain)
        meshed = run.frame(s)
        meshed.coords = np.full((run.world, len(DIMS)), -1)
        meshed.coords[:, DIMS.index("dp_replicate")] = np.arange(run.world)
        fb += b.update(meshed)
    assert fa and findings_key(fa) == findings_key(fb)


def test_ranks_that_give_no_coordinates_are_judged_and_worded_exactly_as_before():
    """A frame whose coordinate matrix is all "not given" (records without coordinates) gives the
    same incidents, word for word, as a frame without one."""
    from detector_synth import Fault, SyntheticRun

    faults = [
        Fault("rank_shift", 30, rank=3),
        Fault("nonfinite", 60, rank=5),
        Fault("replica", 70, rank=2),
        Fault("straggler", 80, rank=6),
        Fault("missing", 90, rank=1, length=10),
        Fault("checksum", 110, rank=4),
    ]
    run = SyntheticRun(faults=faults)
    out = []
    for blank in (False, True):
        pipe = DetectionPipeline(wall=lambda: 1000.0)
        events = []
        for s in range(140):
            f = run.frame(s)
            if blank:
                f.coords = np.full((run.world, len(DIMS)), -1)
            events += pipe.process_frame(f)
        out.append([(e.change, e.incident.to_dict()) for e in events])
    assert len(out[0]) > 6 and out[0] == out[1]
    assert all("coords" not in d for _, d in out[1])


def test_a_summary_carries_the_coordinate_table_only_when_it_changed_and_a_bad_one_is_refused():
    from sdcwatch.core.errors import SummaryError

    mesh = MeshRun()
    spatial = DetectionPipeline(stage="spatial")
    for s in range(3):
        spatial.process_frame(mesh.frame(s))
    first, second, _ = [decode_summary(encode_summary(x)) for x in spatial.take_summaries()]
    assert (first.coords == mesh.coord_array()).all() and second.coords is None
    assert decode_summary(encode_summary(first)).coords.shape == (mesh.world, len(DIMS))
    first.coords = first.coords[:3]  # a table that does not cover the world
    with pytest.raises(SummaryError, match="coords"):
        decode_summary(encode_summary(first))


def test_a_restored_pipeline_names_ranks_with_coordinates_as_an_uninterrupted_one():
    mesh = MeshRun(faults=[MeshFault("rank_shift", step=40, rank=MeshRun().rank_of(tp=1, pp=1, dp=0))])
    whole = DetectionPipeline(wall=lambda: 1000.0)
    a = [e for s in range(150) for e in whole.process_frame(mesh.frame(s))]
    first = DetectionPipeline(wall=lambda: 1000.0)
    b = [e for s in range(60) for e in first.process_frame(mesh.frame(s))]
    second = DetectionPipeline(wall=lambda: 1000.0)
    second.restore(json.loads(json.dumps(json_safe(first.snapshot()))))
    b += [e for s in range(60, 150) for e in second.process_frame(mesh.frame(s))]
    key = [(e.change, e.incident.to_dict()) for e in a]
    assert key and key == [(e.change, e.incident.to_dict()) for e in b]
    assert any(d.get("coords") == [{"pp": 1, "dp_replicate": 0, "tp": 1}] for _, d in key)


def test_records_with_coordinates_over_either_wire_give_the_same_incidents():
    """Plain records carrying coordinates, encoded as the emitters send them and decoded by the
    service's decoder: v1 and v2 give the same incidents (to the bit), and the same kinds, steps,
    ranks and coordinates as the frames built directly (the wire sends layers as float32)."""
    from sdcwatch.testbed.wire_frames import frames_over_wire

    bad = MeshRun().rank_of(tp=1, pp=0, dp=1)
    mesh = MeshRun(faults=[MeshFault("rank_shift", step=30, rank=bad), MeshFault("nonfinite", step=100, rank=bad)])
    records = [r for s in range(120) for r in mesh.records(s)]
    out = {}
    for how in ("direct", "v1", "v2"):
        pipe = DetectionPipeline(wall=lambda: 1000.0)
        frames = [mesh.frame(s) for s in range(120)] if how == "direct" else frames_over_wire(records, how)
        assert (frames[-1].coords == mesh.coord_array()).all()
        out[how] = [(e.change, e.incident.to_dict()) for f in frames for e in pipe.process_frame(f)]
    assert out["v1"] == out["v2"]

    def key(events):
        return [(c, d["kind"], d["first_step"], d["ranks"], d.get("coords")) for c, d in events]

    assert key(out["direct"]) == key(out["v2"])
    kinds = {d["kind"]: d for _, d in out["v2"]}
    drift = kinds["silent_drift"]
    assert drift["ranks"] == [bad] and drift["coords"] == [mesh.coords(bad)] and drift["first_step"] < 30 + 50
    # the NaN on the drifting rank, within the window of its drift's onset, is that fault's related
    # evidence, with its rank and coordinates (issue 24: one fault, one incident), not a second incident
    assert "nonfinite" not in kinds
    (nan,) = [r for r in drift["evidence"]["related"] if r["kind"] == "nonfinite"]
    assert (nan["ranks"], nan["coords"], nan["first_step"]) == ([bad], [mesh.coords(bad)], 100)


def test_a_mixed_message_with_malformed_coordinates_is_dead_lettered_with_its_reason():
    """A batch mixing records with coordinates, without, and one whose coordinates name no mesh dim:
    the message goes to the dead-letter topic whole, with the reason; the steps sent before and
    after are judged as usual and raise nothing."""
    from sdcwatch.core.record import encode, encode_batch
    from memory_source import MemorySource
    from sdcwatch.service.loop import DetectorService
    from sdcwatch.telemetry import MemoryBus, MemoryTransport

    mesh = MeshRun()
    bus = MemoryBus()
    tr = MemoryTransport(bus)
    for s in range(40):
        tr.send(mesh.records(s))
    good, plain, broken = mesh.records(40)[:3]
    plain = dataclasses.replace(plain, coords={})
    raw = encode(broken)
    assert raw[-5] == DIMS.index("tp")  # the last coordinate: u8 dim | u32 index
    batch = encode_batch([good, plain, broken])
    batch = batch[: -len(raw)] + raw[:-5] + bytes([len(DIMS) + 3]) + raw[-4:]  # a dim that does not exist
    bus.append(TELEMETRY_TOPIC, b"mesh/40", batch)
    for s in range(40, 60):
        tr.send(mesh.records(s)[3:] if s == 40 else mesh.records(s))
    svc = DetectorService(MemorySource(bus), poll_timeout=0.01)
    step_until(svc.step, lambda: svc.source.lag() == 0, 120, "the source drained")
    svc.pipeline.flush()
    src = svc.source
    assert src.dead_letters == 1 and src.dead_letter_reasons == {"malformed": 1}
    assert "coord" in src.dead_letter_log[0].reason and "dim" in src.dead_letter_log[0].reason
    assert svc.pipeline.records_total == 60 * mesh.world - 3
    assert [i for i in svc.pipeline.incidents() if i.kind != "missing_rank"] == []
    svc.close()


def test_hsdp_shard_fingerprints_are_voted_across_the_replicas_of_each_shard():
    """HSDP with 3 replicas x 2 shards: each shard's parameter fingerprint differs by design; a
    flipped bit on one rank is named by the vote among that shard's 3 replicas."""
    from detector_synth import SyntheticRun

    run = SyntheticRun(world=6, ranks_per_host=2)
    coords = np.full((6, len(DIMS)), -1)
    coords[:, DIMS.index("dp_replicate")] = np.arange(6) // 2
    coords[:, DIMS.index("dp_shard")] = np.arange(6) % 2
    det = ReplicaDivergenceDetector()

    def frame(step, flip=None):
        f = run.frame(step)
        f.coords = coords
        f.fingerprints[:, 0] += (np.arange(6) % 2).astype(np.uint64)  # one fingerprint per shard
        if flip is not None:
            f.fingerprints[flip, 0] ^= np.uint64(1 << 40)
        return f

    assert det.update(frame(1)) == []
    [found] = det.update(frame(2, flip=3))
    assert found.ranks == (3,) and found.metric == "param_fp"
    assert "at dp_replicate=1,dp_shard=1" in found.message
    flat = frame(3)
    flat.coords = None  # over all ranks: two shards' fingerprints, 3 against 3, no majority
    assert [f.ranks for f in det.update(flat)] == [()]


def test_group_keys_of_huge_coordinates_do_not_collide():
    """Coordinates whose mixed-radix key would overflow 64 bits (allowed up to the world size on
    every dim) are still grouped exactly."""
    from sdcwatch.detectors.peers import group_keys

    big = (1 << 20) - 1
    row = [big] * len(DIMS)
    coords = np.array([row, row, row, row])
    coords[1, DIMS.index("dp_replicate")] = 0  # another replica of the same piece
    coords[2, DIMS.index("pp")] = 0
    coords[3, DIMS.index("tp")] = 0
    ids = group_keys(coords, KEYS["peer"])
    assert ids[0] == ids[1] and len({int(ids[0]), int(ids[2]), int(ids[3])}) == 3


def test_a_nan_made_in_the_last_stage_is_not_blamed_on_the_earlier_stages_whose_gradients_it_reached():
    origin = MeshRun().rank_of(tp=0, pp=1, dp=3)
    mesh = MeshRun(faults=[MeshFault("nonfinite", step=30, rank=origin)])
    [f] = NonFiniteDetector().update(mesh.frame(30))
    assert f.ranks == (origin,) and f.metric == "attn_logit_max"
    followers = [mesh.rank_of(tp=t, pp=p, dp=3) for p in range(2) for t in range(2)]
    assert f.evidence["pipeline_followers"] == sorted(set(followers) - {origin})


def test_a_nan_only_in_gradients_began_on_the_latest_stage_that_shows_it():
    """A bad gradient made in the backward pass of stage 1 reaches stage 0's gradients, not the
    other way round."""
    mesh = MeshRun()
    frame = mesh.frame(12)
    g = frame.scalar_names.index("grad_norm_local")
    late, early = mesh.rank_of(tp=1, pp=1, dp=0), mesh.rank_of(tp=1, pp=0, dp=0)
    frame.scalars[[late, early], g] = np.nan
    [f] = NonFiniteDetector().update(frame)
    assert f.ranks == (late,) and f.evidence["pipeline_followers"] == [early]
