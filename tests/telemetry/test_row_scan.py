"""The fused row scan of a product's output (row sums, largest |value|, count of NaN/Inf/near-INF): the
Triton kernel, run by Triton's interpreter on the CPU, against the torch reference on fresh random
inputs with NaN, Inf, near-INF and exponent flips planted; the reference against torch's own
reductions; ``sdcwatch::row_scan`` as one call in a graph ``torch.compile`` builds."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.telemetry.probes.forward_order import NEAR_INF  # noqa: E402
from sdcwatch.telemetry.probes.row_scan import (  # noqa: E402
    near_inf_limit,
    row_scan,
    row_scan_reference,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: name -> (shape of the tensor made, how it is laid out): odd R and n, a loop over several column
#: blocks with a ragged tail (n past the kernel's 4096/2048-element block), and the degenerate shapes
SHAPES = {
    "odd3d": (3, 5, 77),
    "wide": (130, 1000),
    "ragged_loop": (6, 4200),
    "one": (1, 1),
    "no_cols": (4, 0),
    "no_rows": (0, 8),
    "transposed": (77, 12),  # passed as its .t(): the last dim is not contiguous
    "strided_rows": (40, 300),  # passed as [:, 17:150]: rows 300 apart, no copy
}


def scan_peaks(sums: torch.Tensor, peaks: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """(3,) float32: [largest |row sum|, largest |value|, count of bad elements] (NaN kept; zeros for
    no rows): a reduction of the scan's outputs, as a step would run it in compiled code."""
    if sums.numel() == 0:
        return torch.zeros(3, dtype=torch.float32, device=sums.device)
    return torch.stack([sums.abs().amax().float(), peaks.amax().float(), bad.sum(dtype=torch.float32)])


KINDS = ("nan", "+inf", "-inf", "near_inf", "below_near_inf", "flip", "inf_pair", "clean")
EXPONENT_TOP_BIT = {torch.float32: (torch.int32, 1 << 30), torch.bfloat16: (torch.int16, 1 << 14)}
EXPONENT_TOP_BIT[torch.float16] = (torch.int16, 1 << 14)

CHILD = """
import sys, time, torch
from sdcwatch.telemetry.probes.row_scan import row_scan
cases = torch.load(sys.argv[1])
start = time.perf_counter()
torch.save({name: row_scan(y, use_triton=True) for name, y in cases.items()}, sys.argv[2])
print(f"{time.perf_counter() - start:.2f}")
"""


def _below(limit: float, dtype: torch.dtype) -> torch.Tensor:
    """The largest value of ``dtype`` under ``limit`` (the bits of a positive float count up)."""
    int_dtype, _ = EXPONENT_TOP_BIT[dtype]
    return (torch.tensor(limit, dtype=dtype).view(int_dtype) - 1).view(dtype)


def planted(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random rows at magnitudes 1e-3..1e3, each row but the clean ones with one kind of bad value planted."""
    *lead, n = shape
    rows = math.prod(lead)
    scale = 10.0 ** (torch.rand(rows, 1, generator=gen) * 6 - 3)
    y = (torch.randn(rows, n, generator=gen) * scale).to(dtype)
    offset = int(torch.randint(len(KINDS), (1,), generator=gen))
    int_dtype, top_bit = EXPONENT_TOP_BIT[dtype]
    for r in range(rows if n else 0):
        kind, col = KINDS[(r + offset) % len(KINDS)], int(torch.randint(n, (1,), generator=gen))
        sign = 1.0 if bool(torch.rand(1, generator=gen) < 0.5) else -1.0
        if kind == "nan":
            y[r, col] = float("nan")
        elif kind in ("+inf", "-inf"):
            y[r, col] = float(kind)
        elif kind == "near_inf":  # 1e10 where the dtype holds it (bf16 rounds it), inf in fp16
            y[r, col] = sign * NEAR_INF
        elif kind == "below_near_inf":  # the largest value not near-INF: not counted
            y[r, col] = sign * _below(near_inf_limit(dtype), dtype)
        elif kind == "flip":
            y[r].view(int_dtype)[col] ^= top_bit
        elif kind == "inf_pair" and n > 1:
            y[r, col], y[r, (col + 1) % n] = float("inf"), float("-inf")
    return y.reshape(shape)


def as_rows(y: torch.Tensor) -> torch.Tensor:
    return y.reshape(math.prod(y.shape[:-1]), y.shape[-1])


def laid_out(name: str, y: torch.Tensor) -> torch.Tensor:
    if name == "transposed":
        return y.t()
    if name == "strided_rows":
        return y[:, 17:150]
    return y


def assert_scan_matches(got, want, y: torch.Tensor, where: str) -> None:
    """``got`` is ``want``: peaks and bad counts exactly, sums to fp32 rounding with the same NaN/inf."""
    sums, peaks, bad = got
    ref_sums, ref_peaks, ref_bad = want
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.int32], where
    assert [t.shape for t in got] == [t.shape for t in want], where
    torch.testing.assert_close(peaks, ref_peaks, rtol=0, atol=0, equal_nan=True, msg=f"peaks {where}")
    assert torch.equal(bad, ref_bad), f"bad {where}: {bad.tolist()} != {ref_bad.tolist()}"
    assert torch.equal(sums.isnan(), ref_sums.isnan()), f"NaN sums {where}"
    inf = ref_sums.isinf()
    assert torch.equal(sums.isinf(), inf) and torch.equal(sums[inf], ref_sums[inf]), f"inf sums {where}"
    rows = as_rows(y).double()
    n = rows.shape[-1]
    # both sums are within n * 2**-24 * sum|v| of the exact one, whatever their order (rows summing
    # to a finite value hold only finite values)
    bound = 2 * n * 2.0**-24 * rows.abs().nan_to_num(0, 0, 0).sum(-1) + 1e-30
    fine = ref_sums.isfinite()
    gap = (sums.double() - ref_sums.double()).abs()
    assert bool((gap[fine] <= bound[fine]).all()), f"sums {where}: worst gap/bound {(gap / bound)[fine].max()}"


@pytest.fixture(scope="module")
def seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Each of the 65536 values of a 16-bit float (subnormals, infs, NaNs) as a row of its own."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, 1)


#: the whole bit space of the 16-bit floats, and 65536 random fp32 words, one value a row
WORDS = {"bf16-every_value", "fp16-every_value", "fp32-random_words"}
CASES = [f"{d}-{s}" for d in DTYPES for s in SHAPES] + sorted(WORDS)


@pytest.fixture(scope="module")
def cases(seed) -> dict[str, torch.Tensor]:
    """Case name -> a fresh planted tensor, as laid out for the scan."""
    gen = torch.Generator().manual_seed(seed)
    made = {f"{d}-{s}": laid_out(s, planted(shape, DTYPES[d], gen)) for d in DTYPES for s, shape in SHAPES.items()}
    made["bf16-every_value"], made["fp16-every_value"] = every_value(torch.bfloat16), every_value(torch.float16)
    words = torch.randint(-(1 << 31), 1 << 31, (1 << 16, 1), generator=gen, dtype=torch.int64)
    made["fp32-random_words"] = words.to(torch.int32).view(torch.float32)
    return made


@pytest.fixture(scope="module")
def interpreted(cases, seed, tmp_path_factory) -> dict[str, tuple]:
    """The kernel's outputs for every case, from a process that imported triton with TRITON_INTERPRET=1
    (triton.jit picks the interpreter when it decorates, its own library at import)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (the dev extra pins it): the kernel is not tested")
    folder = tmp_path_factory.mktemp("row_scan")
    torch.save(cases, folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder / "cases.pt"), str(folder / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"seed {seed}: the interpreted kernel failed\n{done.stderr[-4000:]}"
    print(f"interpreter: {done.stdout.strip()} s in the kernel, {time.perf_counter() - start:.1f} s in all")
    return torch.load(folder / "out.pt")


@pytest.mark.parametrize("name", CASES)
def test_the_kernel_matches_the_torch_reference(interpreted, cases, seed, name):
    y = cases[name]
    assert_scan_matches(interpreted[name], row_scan_reference(y), y, f"{name}, seed {seed}")


def test_the_cases_plant_every_kind_of_bad_value(cases, seed):
    """The wide case's rows hold each kind; the counts are what the plants make (guards the planting)."""
    for d, dtype in DTYPES.items():
        y = cases[f"{d}-wide"]
        bad = (~y.isfinite() | (y.abs() >= near_inf_limit(dtype))).sum()
        assert y.isnan().any() and (y == float("inf")).any() and (y == float("-inf")).any(), f"seed {seed}"
        assert int(bad) >= 130 * 5 // len(KINDS), f"{d}: {int(bad)} bad values, seed {seed}"
    assert cases["fp32-transposed"].stride(-1) != 1 and cases["bf16-strided_rows"].stride(0) == 300


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_is_torchs_own_reductions(cases, seed, dtype):
    """Bit for bit: ``y.sum(-1, dtype=float32)``, ``y.abs().amax(-1).float()``, and the count of
    non-finite elements and elements ``>= NEAR_INF`` as torch compares them in the tensor's dtype."""
    for shape in ("odd3d", "wide", "transposed", "strided_rows"):
        y = cases[f"{dtype}-{shape}"]
        want = (
            y.sum(-1, dtype=torch.float32).reshape(-1),
            y.abs().amax(-1).float().reshape(-1),
            (~y.isfinite() | (y.abs() >= NEAR_INF)).sum(-1).int().reshape(-1),
        )
        for got, ref in zip(row_scan_reference(y), want):
            torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True, msg=f"{shape}, seed {seed}")
        for got, ref in zip(row_scan(y), row_scan_reference(y)):  # the CPU's default is the reference
            torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


def test_near_inf_is_the_threshold_as_the_dtype_holds_it():
    assert [near_inf_limit(d) for d in DTYPES.values()] == [1e10, 9999220736.0, float("inf")]
    for dtype in DTYPES.values():
        y = torch.tensor([[NEAR_INF, 1.0], [float(_below(near_inf_limit(dtype), dtype)), -2.0]]).to(dtype)
        assert row_scan(y)[2].tolist() == [1, 0], dtype


def test_empty_rows_and_columns_give_zeros():
    for shape in ((4, 0), (0, 8), (2, 0, 3)):
        sums, peaks, bad = row_scan(torch.ones(shape))
        rows = math.prod(shape[:-1])
        assert sums.tolist() == peaks.tolist() == [0.0] * rows and bad.tolist() == [0] * rows
        assert scan_peaks(sums, peaks, bad).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(TypeError, match="floating"):
        row_scan(torch.ones(3, 4, dtype=torch.int32))


def test_scan_peaks_takes_the_largest_and_keeps_nan():
    sums = torch.tensor([3.0, -7.5, 2.0])
    peaks = torch.tensor([1.0, 4.0, 0.5])
    bad = torch.tensor([0, 2, 1], dtype=torch.int32)
    assert scan_peaks(sums, peaks, bad).tolist() == [7.5, 4.0, 3.0]
    assert scan_peaks(sums, peaks, bad).dtype == torch.float32
    sums[1], peaks[2] = float("nan"), float("nan")
    got = scan_peaks(sums, peaks, bad)
    assert got[:2].isnan().all() and got[2] == 3.0
    sums[1] = float("-inf")
    assert scan_peaks(sums, peaks, bad)[0] == float("inf")


def test_the_custom_op_is_row_scan_and_carries_no_gradient():
    x = torch.randn(6, 33, requires_grad=True)
    y = x * 2
    sums, peaks, bad = torch.ops.sdcwatch.row_scan(y)
    assert not (sums.requires_grad or peaks.requires_grad or bad.requires_grad)
    for got, ref in zip((sums, peaks, bad), row_scan_reference(y.detach())):
        assert torch.equal(got, ref)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_compiled_with_the_op_is_one_graph_without_a_break_or_recompile(seed):
    """inductor, fullgraph: the op is one opaque call; a second step with a NaN planted reuses the graph."""
    from torch._dynamo.utils import counters

    def step(y):
        sums, peaks, bad = torch.ops.sdcwatch.row_scan(y)
        return scan_peaks(sums, peaks, bad), sums

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    gen = torch.Generator().manual_seed(seed)
    for plant in (None, float("nan")):
        y = torch.randn(5, 7, 96, generator=gen).to(torch.bfloat16)
        if plant is not None:
            y[1, 2, 3] = plant
        for got, ref in zip(compiled(y), step(y)):
            torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True, msg=f"seed {seed}")
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_without_triton_the_modules_import_and_the_scan_is_the_reference():
    """Where triton does not import, both modules still do; the default is the torch reference and
    asking for the kernel says why it cannot run."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # import triton raises ImportError
        "import torch\n"
        "from sdcwatch.telemetry.probes import row_scan_kernel\n"
        "from sdcwatch.telemetry.probes.row_scan import row_scan, row_scan_reference, triton_available\n"
        "y = torch.randn(4, 9)\n"
        "assert not triton_available()\n"
        "assert all(torch.equal(a, b) for a, b in zip(row_scan(y), row_scan_reference(y)))\n"
        "try:\n"
        "    row_scan(y, use_triton=True)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "the row_scan kernel needs triton, which does not import here"
