"""The seal's one-read weight sums (column sums and the sum of the rows' norms): the Triton kernel,
run by Triton's interpreter on the CPU, against float64 references on fresh random weights in fp32,
bf16 and fp16 (ragged shapes, planted NaN, Inf and exponent flips); torch's reductions everywhere
else, bit for bit what the seal took before."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.telemetry.probes.gemm_state import SealedWeight  # noqa: E402
from sdcwatch.telemetry.probes.weight_sums import weight_sums, weight_sums_reference  # noqa: E402
from sdcwatch.telemetry.probes.weight_sums_kernel import grid_of  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: ragged against the kernel's 32 x 128 tiles, several row splits, one element, a tall and a wide one
SHAPES = [(1, 1), (33, 130), (300, 77), (64, 257), (2000, 3), (5, 3000)]

CHILD = """
import sys, torch
from sdcwatch.telemetry.probes.weight_sums import weight_sums
cases = torch.load(sys.argv[1])
torch.save({k: weight_sums(w, torch.float32, use_triton=True) for k, w in cases.items()}, sys.argv[2])
"""


def _cases(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for shape in SHAPES:
        for name, dtype in DTYPES.items():
            w = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
            out[f"{shape}-{name}"] = w
            if w.numel() > 10:
                bad = w.clone()
                flat = bad.view(-1)
                flat[3] = float("nan")
                flat[-2] = float("inf")
                out[f"{shape}-{name}-bad"] = bad
                flipped = w.clone()
                as_int = flipped.view(torch.int32 if dtype == torch.float32 else torch.int16).view(-1)
                as_int[7] ^= 1 << (30 if dtype == torch.float32 else 14)  # the top exponent bit
                out[f"{shape}-{name}-flip"] = flipped
    return out


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here (pip install triton, or the dev extra): the kernel cannot run")
    seed = int(time.time()) % 100_000
    cases = _cases(seed)
    folder = tmp_path_factory.mktemp("weight_sums")
    src, dst = folder / "cases.pt", folder / "out.pt"
    torch.save(cases, src)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(dst)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return seed, cases, torch.load(dst)


def _close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> bool:
    """Equal to float32 rounding of a sum of this scale; NaN and infinities where the reference has them."""
    got, want = got.double(), want.double()
    same_special = torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = ~(want.isnan() | want.isinf())
    within = (got - want).abs() <= 1e-5 * scale.double() + 1e-30
    return same_special and bool((within | ~finite).all())


def test_the_kernel_matches_float64_references(interpreted):
    seed, cases, outs = interpreted
    for name, w in cases.items():
        cols, norms = outs[name]
        assert cols.dtype == torch.float32 and cols.shape == (w.shape[1],), name
        assert norms.dtype == torch.float32 and norms.shape == (), name
        w64 = w.double()
        # the rows' squares summed in float32, as on a GPU: past float32's largest value they are inf
        squares = (w64 * w64).sum(1)
        squares = torch.where(squares > torch.finfo(torch.float32).max, float("inf"), squares)
        want_cols, want_norms = w64.sum(0), squares.sqrt().sum()
        scale = w64.abs().nan_to_num(posinf=0).sum(0)
        assert _close(cols, want_cols, scale), (seed, name)
        assert _close(norms.reshape(1), want_norms.reshape(1), want_norms.nan_to_num(nan=1, posinf=1).reshape(1)), (
            seed,
            name,
        )


def test_a_flipped_exponent_moves_both_sums(interpreted):
    """What the seal is for: a weight flipped in memory changes its column sum far past rounding."""
    seed, cases, outs = interpreted
    for name in cases:
        if name.endswith("-flip"):
            clean = outs[name[: -len("-flip")]]
            assert not torch.allclose(outs[name][0], clean[0], rtol=1e-3), (seed, name)


def test_the_grid_covers_every_row_and_column_once():
    for m, n in [(1, 1), (33, 130), (14336, 4096), (4096, 14336), (32000, 4096), (7, 100000)]:
        col_blocks, splits, per = grid_of(m, n)
        assert col_blocks * 128 >= n > (col_blocks - 1) * 128
        assert per % 32 == 0 and splits * per >= m > (splits - 1) * per


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_keeps_torchs_reductions_bit_for_bit(dtype):
    """Off CUDA the seal's sums are torch's reductions, as before the kernel: CPU records unchanged."""
    w = torch.randn(70, 33).to(dtype)
    cols, norms = weight_sums(w, torch.float32)
    ref_cols, ref_norms = weight_sums_reference(w, torch.float32)
    assert torch.equal(cols, ref_cols) and torch.equal(norms, ref_norms)
    sealed = SealedWeight(w, None)
    assert torch.equal(sealed.v, w.sum(0, dtype=torch.float32))
    k = torch.linalg.vector_norm(w, dim=1, dtype=torch.float32).sum() * w.shape[1] ** 0.5
    assert torch.equal(sealed.k, k)
