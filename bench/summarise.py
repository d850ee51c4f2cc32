"""The committed record of the benchmarks: one markdown summary per benchmark in ``bench/results/``,
made from the raw JSON results the benchmarks write there (build artefacts, not committed).

    python bench/summarise.py [RESULT.json ...]   (default: every JSON in bench/results/)

Each result becomes one section of its benchmark's page (``campaign.md``, ``overhead.md``, ...),
headed by the result's name, with the command that produced it and the machine, then its numbers
as tables; a section of a result not at hand is kept as it was. Lists longer than :data:`LONG`
(every trial, every step) stay in the JSON: the page says how many there were.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterable

__all__ = ["benchmark_of", "command_of", "section", "update_page", "main"]

RESULTS = Path(__file__).resolve().parent / "results"
#: Longer lists are raw samples (trials, steps, runs): counted on the page, kept in the JSON.
LONG = 24
#: Entries of a list whose nested fields the page shows too (repeats of a run, not trials).
FEW = 8
#: The benchmark of a result whose command does not name its script, by the result's name.
BENCHMARK_BY_NAME = {
    "detectors": "detectors",
    "elastic": "elastic",
    "emitter": "emitter",
    "gemm_canary_cost": "gemm_canary",
    "gpu_h100_row_scan": "row_scan",
    "gpu_h200_profile": "gpu_profile",
    "gpu_h": "gpu",
    "ingest": "ingest",
}
#: The command of a result that does not record it, as bench/README.md gives it.
COMMAND_BY_NAME = {
    "detectors": "python bench/bench_detectors.py --out bench/results/detectors.json",
    "elastic": "python bench/bench_elastic.py --out bench/results/elastic.json",
    "emitter": "python bench/bench_emitter.py --out bench/results/emitter.json",
    "gemm_canary_cost_b32": "python bench/bench_gemm_canary.py --batch-size 32 --rounds 20 --out FILE",
    "gpu_h100": "python3 bench/gpu/bench_gpu.py --budget-s 185 --compiled-configs default,forward-checksums "
    "--fault-modes none",
    "gpu_h100_blocks": "SDCWATCH_COMPILED_GRAD_CHECK=0 python3 bench/gpu/bench_gpu.py --budget-s 240 "
    "--compile-scope blocks",
    "gpu_h100_row_scan": "python3 bench/bench_row_scan.py",
    "gpu_h200": "python3 bench/gpu/bench_gpu.py --compiled-configs scalars-only,default,forward-checksums "
    "--fault-modes compiled --fault-d-model 4096",
    "gpu_h200_clip": "python3 bench/gpu/bench_gpu.py --compiled-configs default,forward-checksums --fault-modes none",
    "gpu_h200_profile": "python3 bench/gpu/profile_probes.py --d-model 4096 "
    "--variants clean,scalars-only,default,forward-checksums",
    "ingest": "sdcwatch bench ingest --ranks 1024 16384 100000 --steps 5 --json",
    "ingest_per_message_1": "sdcwatch bench ingest --ranks 16384 --per-message 1 --json",
    "ingest_signed": "sdcwatch bench ingest --ranks 16384 --signed --json",
    "ingest_signed_1": "sdcwatch bench ingest --ranks 16384 --signed --per-message 1 --json",
}
_SCRIPT = re.compile(r"sdcwatch bench (\w+)|bench/(?:gpu/)?(?:bench_)?(\w+)\.py")


def command_of(name: str, result: Any) -> str:
    """The command that produced ``result`` (recorded in it, else as bench/README.md gives it)."""
    recorded = result.get("command") if isinstance(result, dict) else None
    return recorded or COMMAND_BY_NAME.get(name, "not recorded")


def benchmark_of(name: str, result: Any) -> str:
    """The benchmark (its page's name) that ``result``, called ``name``, comes from."""
    for prefix, benchmark in BENCHMARK_BY_NAME.items():
        if name.startswith(prefix):
            return benchmark
    found = _SCRIPT.search(command_of(name, result))
    if not found:
        raise ValueError(f"{name}: no command names its benchmark; add it to BENCHMARK_BY_NAME")
    return (found.group(1) or found.group(2)).removeprefix("bench_")


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _scalar(value: Any) -> bool:
    return not isinstance(value, (dict, list)) or (
        isinstance(value, list) and len(value) <= LONG and all(_scalar(v) and not isinstance(v, list) for v in value)
    )


def _records(value: Any) -> dict[str, dict] | None:
    """``value`` as rows of a table (a dict of dicts, or a short list of dicts); None if it is not one."""
    if isinstance(value, list) and value and len(value) <= LONG and all(isinstance(v, dict) for v in value):
        value = {str(i): v for i, v in enumerate(value)}
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        if any(_scalar(x) for v in value.values() for x in v.values()):
            return value
    return None


def _table(rows: dict[str, dict], first: str) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows.values() for k, v in row.items() if _scalar(v)))
    lines = [f"| {first} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for key, row in rows.items():
        lines.append(f"| {key} | " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return lines


def _blocks(value: Any, path: str) -> Iterable[list[str]]:
    """The tables of ``value`` at ``path``: its scalars as one, rows of records as another, and so on down."""
    if isinstance(value, list) and not _scalar(value) and _records(value) is None:
        yield [f"`{path}`: {len(value)} entries (in the raw JSON)"]
        return
    rows = _records(value) if path else None  # the result itself: its parts under their names
    if rows is not None:
        yield [f"`{path}`:", "", *_table(rows, "")]
        if isinstance(value, list) and len(value) > FEW:  # samples (trials): their nested fields stay in the JSON
            return
        for key, row in rows.items():
            for k, v in row.items():
                if not _scalar(v):
                    yield from _blocks(v, f"{path}.{key}.{k}" if path else f"{key}.{k}")
        return
    if not isinstance(value, dict):
        yield [f"`{path}`: {_cell(value)}"]
        return
    scalars = {k: v for k, v in value.items() if _scalar(v)}
    if scalars:
        head = [f"`{path}`:", ""] if path else []
        yield [*head, "| key | value |", "|---|---|", *(f"| {k} | {_cell(v)} |" for k, v in scalars.items())]
    for k, v in value.items():
        if not _scalar(v):
            yield from _blocks(v, f"{path}.{k}" if path else k)


def section(name: str, result: Any) -> str:
    """The page section of one result: its name, command, machine and tables."""
    lines = [f"## {name}", "", f"Command: `{command_of(name, result)}`", ""]
    body = dict(result) if isinstance(result, dict) else {"runs": result}
    body.pop("command", None)
    for block in _blocks(body, ""):
        lines += [*block, ""]
    return "\n".join(lines).rstrip() + "\n"


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^(?=## )", text, flags=re.M)
    return {p.split("\n", 1)[0][3:].strip(): p.rstrip() + "\n" for p in parts if p.startswith("## ")}


def update_page(page: Path, results: dict[str, Any]) -> None:
    """Write ``page`` with a section per result of ``results``, keeping its other sections."""
    kept = _sections(page.read_text()) if page.exists() else {}
    kept.update({name: section(name, result) for name, result in results.items()})
    head = (
        f"# {page.stem}: benchmark results\n\n"
        "Made by `python bench/summarise.py` from the JSON each run wrote (not committed); one section a run, "
        "with its command.\n"
    )
    page.write_text(head + "".join("\n" + kept[name] for name in sorted(kept)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="*", type=Path, help="result JSON files (default: bench/results/*.json)")
    args = ap.parse_args(argv)
    pages: dict[str, dict[str, Any]] = {}
    for path in args.results or sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        pages.setdefault(benchmark_of(path.stem, result), {})[path.stem] = result
    for benchmark, results in sorted(pages.items()):
        page = RESULTS / f"{benchmark}.md"
        update_page(page, results)
        print(f"{page.relative_to(RESULTS.parent.parent)}: {', '.join(sorted(results))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
