"""Parallel coordinates: layouts, canonical dims, peer and replica keys."""

from __future__ import annotations

import pytest
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.mesh import DIMS, Layout, check_coords, format_coords, parse_coords, peer_key, replica_key


def test_a_layout_numbers_ranks_with_tensor_parallel_fastest_whatever_the_order_written():
    a, b = Layout.parse("tp=2,pp=2,dp=4"), Layout.parse("dp=4, pp=2, tp=2")
    assert a == b and a.world == 16 and str(a) == "pp=2,dp_replicate=4,tp=2"
    coords = [a.coords(r) for r in range(16)]
    assert coords[0] == {"pp": 0, "dp_replicate": 0, "tp": 0}
    assert coords[1] == {"pp": 0, "dp_replicate": 0, "tp": 1}  # a tensor-parallel pair is adjacent
    assert coords[8] == {"pp": 1, "dp_replicate": 0, "tp": 0}  # pipeline stage outermost
    assert [a.rank_of(c) for c in coords] == list(range(16))
    assert len({tuple(c.items()) for c in coords}) == 16


def test_peer_groups_of_a_3d_layout_hold_one_model_piece_each():
    lay = Layout.parse("tp=2,pp=2,dp=4")
    groups: dict = {}
    for r in range(lay.world):
        groups.setdefault(peer_key(lay.coords(r)), []).append(r)
    assert len(groups) == 4 and all(len(g) == 4 for g in groups.values())  # 4 pieces x 4 replicas
    assert groups[(("pp", 0), ("tp", 1))] == [1, 3, 5, 7]


def test_replica_key_separates_fsdp_shards_and_joins_hsdp_replicas():
    lay = Layout.parse("dp_replicate=2,dp_shard=2")
    keys = [replica_key(lay.coords(r)) for r in range(4)]
    assert keys == [(("dp_shard", 0),), (("dp_shard", 1),), (("dp_shard", 0),), (("dp_shard", 1),)]
    assert {peer_key(lay.coords(r)) for r in range(4)} == {()}  # all four hold the same model


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "dim=number"),
        ("tp", "not dim=number"),
        ("tp=two", "not a whole number"),
        ("warp=2", "unknown mesh dim 'warp'"),
        ("tp=2,tensor=2", "given twice"),
        ("tp=0", "size must be"),
    ],
)
def test_bad_layouts_say_what_is_wrong(text, problem):
    with pytest.raises(ConfigError, match=problem):
        Layout.parse(text)


def test_coordinates_are_checked_and_put_in_canonical_order():
    assert list(parse_coords("tp=1, dp=3, pp=0")) == ["pp", "dp_replicate", "tp"]
    assert check_coords({"fsdp": 1, "replicate": 0}) == {"dp_replicate": 0, "dp_shard": 1}
    with pytest.raises(ConfigError, match="coords.tp"):
        check_coords({"tp": -1})
    with pytest.raises(ConfigError, match="outside the layout"):
        Layout.parse("tp=2").coords(2)
    assert format_coords({"tp": 1, "pp": 0}) == "pp=0,tp=1" and format_coords({}) == ""
    assert set(DIMS) == {"pp", "dp_replicate", "dp_shard", "cp", "ep", "tp"}
