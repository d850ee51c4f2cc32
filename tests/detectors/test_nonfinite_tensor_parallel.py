"""A bad value made in one tensor shard reaches its tensor-parallel peers in the same forward (the
row-parallel all-reduce): the non-finite detector names the rank where it was made, from the
order of the forward pass, as the real FSDP2 + TP run of ``tests/telemetry/test_fsdp_tp.py`` shows
it (records of a ``dp_shard=2 x tp=2`` job)."""

from __future__ import annotations

import math

from sdcwatch.core.record_type import Record
from sdcwatch.detectors.frame import StepFrame
from sdcwatch.detectors.nonfinite import NonFiniteDetector

NAN = math.nan
WORLD, TP = 4, 2


def _frame(bad: dict[int, dict[str, tuple]], coords: bool = True) -> StepFrame:
    """A step of 4 ranks (rank = dp_shard * 2 + tp), two blocks and 4 products; ``bad`` overrides
    the layer vectors of some ranks."""
    records = []
    for r in range(WORLD):
        layers = {
            "attn_logit_max": (0.2, 0.3),
            "stream_max": (1.0, 2.0),
            "gemm_out": (3.0, 1.0, 4.0, 1.0),
            "gemm_in": (2.0, 2.0, 2.0, 2.0),
        }
        layers.update(bad.get(r, {}))
        records.append(
            Record(
                run="tp",
                step=5,
                rank=r,
                world=WORLD,
                host=f"h{r}",
                time=1e9,
                local_rank=r,
                scalars={"loss": NAN if r < TP and bad else 3.0, "grad_norm_global": NAN if bad else 2.0},
                fingerprints={},
                layers=layers,
                coords={"dp_shard": r // TP, "tp": r % TP} if coords else {},
            )
        )
    return StepFrame.from_records("tp", 5, WORLD, records)


def test_a_nan_in_one_ranks_heads_is_blamed_on_it_not_on_its_tensor_parallel_peer():
    # rank 1's heads of block 0 made it; rank 0's logits are fine, its stream got it from the all-reduce
    frame = _frame(
        {
            1: {"attn_logit_max": (NAN, NAN), "stream_max": (NAN, NAN), "gemm_out": (3.0, NAN, NAN, NAN)},
            0: {"attn_logit_max": (0.2, NAN), "stream_max": (NAN, NAN), "gemm_out": (3.0, NAN, NAN, NAN)},
        }
    )
    [f] = NonFiniteDetector().update(frame)
    assert f.ranks == (1,) and f.metric == "attn_logit_max" and f.layer == 0, f.message
    assert f.evidence["tensor_parallel_followers"] == [0]
    assert "1 other rank(s) of its tensor-parallel group received it (all-reduce)" in f.message
    assert "the all-reduced values of 1 other rank(s) followed" in f.message  # its dp_shard peer, rank 3


def test_within_a_layer_the_product_that_made_it_decides():
    # a NaN in rank 0's column-parallel product 2 (an MLP input projection); rank 1 sees it first in
    # the row-parallel product 3 after it, whose input (its own) is fine
    frame = _frame(
        {
            0: {"stream_max": (NAN, NAN), "gemm_out": (3.0, 1.0, NAN, NAN), "gemm_in": (2.0, 2.0, 2.0, NAN)},
            1: {"stream_max": (NAN, NAN), "gemm_out": (3.0, 1.0, 4.0, NAN)},
        }
    )
    [f] = NonFiniteDetector().update(frame)
    assert f.ranks == (0,), f.message
    assert f.evidence["tensor_parallel_followers"] == [1]


def test_peers_with_the_same_first_bad_value_are_all_named_and_records_without_coordinates_as_before():
    both = {r: {"stream_max": (NAN, NAN)} for r in (0, 1)}
    [f] = NonFiniteDetector().update(_frame(both))
    assert f.ranks == (0, 1) and "tensor_parallel_followers" not in f.evidence
    heads = {1: {"attn_logit_max": (NAN, 0.3), "stream_max": (NAN, 2.0)}, 0: {"stream_max": (NAN, 2.0)}}
    [f] = NonFiniteDetector().update(_frame(heads, coords=False))
    assert f.ranks == (0, 1)  # no coordinates: no tensor-parallel group is known
