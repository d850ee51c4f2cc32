"""The fused row scan on a GPU: one Triton kernel reading a product's output once for its row sums,
largest |value| and count of NaN/Inf/near-INF, against the torch ops the probes run today for the
same three numbers (``y.sum(-1, dtype=float32).abs().amax()``, ``y.abs().amax()``, a non-finite count).

Checks the kernel against the torch reference on the device first (planted NaN, Inf, near-INF and an
exponent flip), then times each with CUDA events (median of ``--iters``), bf16 outputs of 16,384 rows
by 4,096 and 14,336 columns; GB/s counts the output's bytes read once. Needs only torch and triton
(the project's source tree is found next to this file when sdcwatch is not installed)::

    python bench/bench_row_scan.py [--iters 50] [--shapes 16384x4096 16384x14336] [--sweep] [--json FILE]

Writes JSON to ``$OUT/bench_row_scan.json`` when ``$OUT`` is set. On a machine without CUDA it says
so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch


def import_row_scan():
    """``sdcwatch.telemetry.probes.row_scan``, from the install or else from this source tree (whose
    folders are the subpackages of ``sdcwatch``: core/, telemetry/ ... beside sdcwatch/)."""
    try:
        from sdcwatch.telemetry.probes import row_scan
    except ImportError:
        root = Path(__file__).resolve().parents[1]
        package = types.ModuleType("sdcwatch")
        package.__path__ = [str(root / "sdcwatch"), str(root)]
        sys.modules["sdcwatch"] = package
        from sdcwatch.telemetry.probes import row_scan
    return row_scan


def scan_peaks(sums: torch.Tensor, peaks: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """(3,) float32: [largest |row sum|, largest |value|, count of bad elements] (NaN kept)."""
    return torch.stack([sums.abs().amax().float(), peaks.amax().float(), bad.sum(dtype=torch.float32)])


def planted(rows: int, cols: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(rows * 31 + cols)
    y = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32).to(dtype)
    y[1, 7], y[2, 9], y[3, 11], y[4, 13] = float("nan"), float("inf"), float("-inf"), 1e10
    y[5].view(torch.int16)[17] ^= 1 << 14  # the top exponent bit of one bf16/fp16 value
    return y


def check(rs, y: torch.Tensor) -> dict:
    """The kernel's three outputs against the torch reference on the device: peaks and counts exactly,
    sums within fp32 rounding of a sum in any order, NaN/inf where the reference has them."""
    sums, peaks, bad = rs.row_scan(y, use_triton=True)
    ref_sums, ref_peaks, ref_bad = rs.row_scan_reference(y)
    torch.testing.assert_close(peaks, ref_peaks, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(bad, ref_bad), "bad counts differ"
    assert torch.equal(sums.isnan(), ref_sums.isnan()) and torch.equal(sums.isinf(), ref_sums.isinf())
    fine = ref_sums.isfinite()
    bound = 2 * y.shape[-1] * 2.0**-24 * y.double().abs().nan_to_num(0, 0, 0).sum(-1) + 1e-30
    worst = ((sums.double() - ref_sums.double()).abs() / bound)[fine].max()
    assert float(worst) <= 1.0, f"a row sum is {float(worst):.2f} of its rounding bound away"
    peaks3 = scan_peaks(sums, peaks, bad)
    assert peaks3[1].isnan() and int(peaks3[2]) == int(ref_bad.sum())
    return {"sum_gap_over_bound": float(worst), "bad_total": int(ref_bad.sum())}


def cuda_ms(fn, iters: int, warmup: int = 5) -> float:
    """Median milliseconds of ``fn`` on the current stream, each call between its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def today(y: torch.Tensor):
    """The torch ops the probes use for these numbers now: three reductions over the output."""
    return y.sum(-1, dtype=torch.float32).abs().amax(), y.abs().amax(), (~torch.isfinite(y)).sum()


def measure(rs, rows: int, cols: int, iters: int) -> dict:
    y = planted(rows, cols, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    rs.row_scan(y, use_triton=True)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start  # the kernel's compile for this shape's block sizes
    result = {"shape": [rows, cols], "dtype": "bfloat16", "first_call_s": first_call_s, "check": check(rs, y)}
    y = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)  # clean: timing alone
    gigabytes = y.numel() * y.element_size() / 1e9
    runs = {
        "torch_today": lambda: today(y),
        "torch_reference_rows": lambda: rs.row_scan_reference(y),
        "row_scan": lambda: rs.row_scan(y, use_triton=True),
        "row_scan+scan_peaks": lambda: scan_peaks(*rs.row_scan(y, use_triton=True)),
    }
    for name, fn in runs.items():
        ms = cuda_ms(fn, iters)
        result[name] = {"ms": ms, "GB/s": gigabytes / (ms / 1e3)}
    return result


#: (BLOCK_R, BLOCK_N, num_warps) tried by --sweep, next to launch_config's choice
SWEEP = [
    (1, 1024, 4),
    (1, 2048, 4),
    (1, 2048, 8),
    (1, 4096, 4),
    (1, 4096, 8),
    (1, 8192, 8),
    (1, 8192, 16),
    (2, 2048, 8),
]


def sweep(rows: int, cols: int, iters: int) -> list[dict]:
    """Each block shape of :data:`SWEEP` timed on a clean bf16 output; outputs checked against the default's."""
    from sdcwatch.telemetry.probes.row_scan import near_inf_limit
    from sdcwatch.telemetry.probes.row_scan_kernel import launch_config, launch_row_scan

    y = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    gigabytes = y.numel() * y.element_size() / 1e9
    limit = near_inf_limit(y.dtype)
    chosen = launch_config(rows, cols, y.element_size())
    outs = {}
    found = []
    for config in [chosen, *(c for c in SWEEP if c != chosen)]:
        bufs = (torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda"))
        bufs += (torch.empty(rows, device="cuda", dtype=torch.int32),)
        ms = cuda_ms(lambda: launch_row_scan(y, *bufs, limit, config), iters)
        outs[config] = bufs
        same = torch.equal(bufs[1], outs[chosen][1]) and torch.equal(bufs[2], outs[chosen][2])
        found.append({"config": list(config), "chosen": config == chosen, "ms": ms, "GB/s": gigabytes / (ms / 1e3)})
        assert same, f"config {config} disagrees with {chosen}"
    return found


def table(results: list[dict]) -> str:
    lines = [f"{'shape':>12} {'method':>22} {'ms':>8} {'GB/s':>7} {'today/this':>10}"]
    for r in results:
        base = r["torch_today"]["ms"]
        for name in ("torch_today", "torch_reference_rows", "row_scan", "row_scan+scan_peaks"):
            shape = "x".join(map(str, r["shape"]))
            ms, gbs = r[name]["ms"], r[name]["GB/s"]
            lines.append(f"{shape:>12} {name:>22} {ms:8.4f} {gbs:7.0f} {base / ms:10.2f}")
        lines.append(f"{'':>12} first call {r['first_call_s']:.2f} s; check {r['check']}")
        for found in r.get("sweep", []):
            mark = " (launch_config's)" if found["chosen"] else ""
            lines.append(f"{'':>12} sweep {found['config']}: {found['ms']:.4f} ms, {found['GB/s']:.0f} GB/s{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shapes", nargs="+", default=["16384x4096", "16384x14336"], help="ROWSxCOLS, bf16")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--sweep", action="store_true", help="also time other block shapes of the kernel")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_row_scan needs a CUDA device (the fused kernel runs on the GPU); none here: nothing to time")
        return 0
    rs = import_row_scan()
    import triton

    results = []
    for shape in args.shapes:
        rows, cols = map(int, shape.split("x"))
        results.append(measure(rs, rows, cols, args.iters))
        if args.sweep:
            results[-1]["sweep"] = sweep(rows, cols, args.iters)
    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "results": results,
    }
    print(f"{info['device']}, torch {info['torch']}, triton {info['triton']}")
    print(table(results))
    out = [args.json] if args.json else []
    if os.environ.get("OUT"):
        out.append(Path(os.environ["OUT"]) / "bench_row_scan.json")
    for path in out:
        path.write_text(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
