#!/usr/bin/env python3
"""sdcwatch's in-rank probes on a GPU: step-time overhead (eager and compiled), compile health,
host syncs, and injected faults found at their step, on a Llama-style model written here.

Needs only what a stock CUDA PyTorch image has (torch >= 2.11, triton, numpy) and a plain checkout:
no broker (an in-memory transport), no install (``import sdcwatch.*`` is mapped onto the checkout
from pyproject's package-dir when sdcwatch is not importable). From the repository root::

    OUT=/tmp/out python3 bench/gpu/bench_gpu.py            # one H100: under 6 minutes
    python3 bench/gpu/bench_gpu.py --smoke                 # CPU, toy sizes, well under a minute

Progress lines go out as it runs; one markdown table is printed last and the JSON is written to
``$OUT/bench_gpu.json`` (or ``--json PATH``). ``bench/gpu/README.md`` says what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.abc
import importlib.util
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
T0 = time.perf_counter()
CONFIGS = ("clean", "scalars-only", "default", "forward-checksums")


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """``env`` set in ``os.environ`` for the block, the earlier values (or their absence) back after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def say(msg: str) -> None:
    """One progress line, flushed: a run killed half-way still shows how far it got."""
    print(f"[bench_gpu {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# -- sdcwatch from the checkout ----------------------------------------------------------------------


def package_dirs(pyproject: Path) -> dict[str, str]:
    """``[tool.setuptools.package-dir]`` of pyproject.toml: package name -> folder."""
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib

        return dict(tomllib.loads(text)["tool"]["setuptools"]["package-dir"])
    except ModuleNotFoundError:  # Python 3.10: the table is plain "key" = "value" lines
        section = re.search(r"^\[tool\.setuptools\.package-dir\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        if section is None:
            raise RuntimeError(f"{pyproject}: no [tool.setuptools.package-dir] table") from None
        return dict(re.findall(r'^\s*"([\w.]+)"\s*=\s*"([^"]+)"', section.group(1), re.M))


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the packages pyproject maps to folders (``sdcwatch.core`` -> ``core/``); their
    subpackages and modules are then found by the ordinary path machinery."""

    def __init__(self, root: Path, dirs: dict[str, str]) -> None:
        self.dirs = {name: root / folder for name, folder in dirs.items()}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        folder = self.dirs.get(fullname)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def use_checkout(root: Path = ROOT) -> str:
    """Make ``import sdcwatch.*`` resolve to this checkout; returns where sdcwatch comes from."""
    try:
        import sdcwatch.core.errors  # noqa: F401

        where = Path(getattr(sys.modules["sdcwatch"], "__file__", None) or "/").resolve()
        if root in where.parents:
            return f"checkout {root} (installed editable)"
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "sdcwatch" or m.startswith("sdcwatch.")]:
        del sys.modules[name]  # a partial import, or another copy of sdcwatch: this checkout is measured
    sys.meta_path.insert(0, CheckoutFinder(root, package_dirs(root / "pyproject.toml")))
    import sdcwatch.core.errors  # noqa: F401

    return f"checkout {root} (mapped from pyproject's package-dir)"


SOURCE = use_checkout()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC  # noqa: E402
from sdcwatch.service.ingest import IngestDecoder  # noqa: E402
from sdcwatch.service.pipeline import DetectionPipeline  # noqa: E402
from sdcwatch.telemetry.probes.output_faults import output_faults  # noqa: E402
from sdcwatch.telemetry.probes.presets import PROBE_PRESETS  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport  # noqa: E402
from sdcwatch.testbed.faults import FaultInjector  # noqa: E402
from sdcwatch.testbed.faultspec import FaultSpec  # noqa: E402
from torch import nn  # noqa: E402

# -- the model: Llama-style, as torchtitan writes it ----------------------------------------------


@dataclass
class ModelShape:
    d_model: int
    layers: int
    seq: int
    vocab: int
    head_dim: int
    tied: bool = False

    @property
    def ffn(self) -> int:  # Llama's SwiGLU width: 8/3 d rounded up to a multiple of 256
        return (int(8 * self.d_model / 3) + 255) // 256 * 256


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.heads = s.d_model // s.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(s.d_model, s.d_model, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(s.d_model, s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.d_model, bias=False)
        self.w3 = nn.Linear(s.d_model, s.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(s.d_model), Attention(s)
        self.ffn_norm, self.feed_forward = RMSNorm(s.d_model), FeedForward(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(s.vocab, s.d_model)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.d_model)
        self.output = nn.Linear(s.d_model, s.vocab, bias=False)
        if s.tied:
            self.output.weight = self.tok_embeddings.weight
        freqs = 1.0 / (10000.0 ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
        angles = torch.outer(torch.arange(s.seq).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos.to(h.dtype), self.sin.to(h.dtype)
        for block in self.layers:
            h = block(h, cos, sin)
        return self.output(self.norm(h))


# -- the plan ------------------------------------------------------------------------------------


@dataclass
class Plan:
    device: str
    dtype: str
    d_models: list[int]
    batch: dict[int, int]
    layers: int
    seq: int
    vocab: int
    head_dim: int
    tied: bool
    warmup: int
    steps: int
    modes: list[str]
    configs: list[str]
    compiled_configs: list[str]
    fault_modes: list[str]
    fault_d_model: int
    fault_steps: int
    sync_steps: int
    budget_s: float
    smoke: bool
    json_path: str | None = None
    clip: bool = False
    """Clip gradients in every loop (``--clip``): the clean replica with torch's clipping, the watched
    one with :meth:`Watch.clip_grad_norm_` (torch's clipping, bit for bit)."""
    scope: str = "model"
    """What torch.compile compiles: "model" (the whole model, one frame) or "blocks" (each block on
    its own, as torchtitan does)."""

    def shape(self, d: int) -> ModelShape:
        return ModelShape(d, self.layers, self.seq, self.vocab, min(self.head_dim, d), self.tied)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def batches(spec: str, d_models: list[int]) -> dict[int, int]:
    """``--batch``: one number for every width, or ``2048:8,4096:4``."""
    if ":" not in spec:
        return {d: int(spec) for d in d_models}
    got = {int(k): int(v) for k, v in (kv.split(":") for kv in spec.split(","))}
    missing = [d for d in d_models if d not in got]
    if missing:
        raise SystemExit(f"--batch names no batch for d_model {missing}")
    return got


def parse_plan(argv: list[str] | None) -> Plan:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (the test runs this)")
    ap.add_argument("--d-models", default=None, help="widths, e.g. 2048,4096 (smoke: 64)")
    ap.add_argument("--batch", default=None, help="sequences a step: N or 2048:8,4096:4 (default: fits 80 GB)")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4; smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; smoke 64)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 32000; smoke 256)")
    ap.add_argument("--tied", action="store_true", help="tie the output layer to the embedding")
    ap.add_argument("--dtype", default="bfloat16", help="parameter dtype (bfloat16, float16, float32)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per replica (default 32; smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps, step 0 sampled (default 3; smoke 2)")
    ap.add_argument("--cudagraphs", action="store_true", help="also compiled with mode='reduce-overhead'")
    ap.add_argument(
        "--clip",
        action="store_true",
        help="clip gradients to norm 1 in every loop (torch's clipping; the watched one through watch.clip_grad_norm_)",
    )
    ap.add_argument(
        "--compile-scope",
        choices=("model", "blocks"),
        default="model",
        help="compile the whole model (one frame) or each block on its own, as torchtitan does",
    )
    ap.add_argument("--configs", default=",".join(CONFIGS[1:]), help="probe presets timed against clean")
    ap.add_argument(
        "--compiled-configs", default=None, help="presets timed compiled (default: --configs; smoke: scalars-only)"
    )
    ap.add_argument("--fault-modes", default=None, help="eager,compiled (default; smoke: eager), or none")
    ap.add_argument("--fault-d-model", type=int, default=None, help="width of the fault runs (default: the smallest)")
    ap.add_argument(
        "--budget-s", type=float, default=None, help="skip the sections left once past this (default 330; smoke 120)"
    )
    ap.add_argument("--json", default=None, help="where the JSON goes (default $OUT/bench_gpu.json when OUT is set)")
    a = ap.parse_args(argv)
    smoke = a.smoke
    d_models = [int(x) for x in (a.d_models or ("64" if smoke else "4096,2048")).split(",")]
    configs = [c for c in a.configs.split(",") if c]
    compiled = a.compiled_configs or ("scalars-only" if smoke else ",".join(configs))
    for c in configs + compiled.split(","):
        if c not in PROBE_PRESETS:
            raise SystemExit(f"--configs: {c!r} is not a preset ({', '.join(PROBE_PRESETS)})")
    modes = ["eager", "compiled"] + (["cudagraphs"] if a.cudagraphs else [])
    fault_modes = (a.fault_modes if a.fault_modes is not None else ("eager" if smoke else "eager,compiled")).split(",")
    fault_modes = [m for m in fault_modes if m and m != "none"]
    if set(fault_modes) - set(modes):
        raise SystemExit(f"--fault-modes: {', '.join(sorted(set(fault_modes) - set(modes)))} is not one of {modes}")
    plan = Plan(
        device="cpu" if smoke or not torch.cuda.is_available() else "cuda",
        dtype=a.dtype,
        d_models=d_models,
        batch=batches(a.batch or ("4" if smoke else "4096:4,2048:8"), d_models),
        layers=a.layers or (2 if smoke else 4),
        seq=a.seq or (64 if smoke else 2048),
        vocab=a.vocab or (256 if smoke else 32000),
        head_dim=16 if smoke else 128,
        tied=a.tied,
        warmup=a.warmup if a.warmup is not None else (2 if smoke else 3),
        steps=a.steps or (4 if smoke else 32),
        modes=modes,
        configs=configs,
        compiled_configs=[c for c in compiled.split(",") if c],
        fault_modes=fault_modes,
        fault_d_model=a.fault_d_model or min(d_models),
        fault_steps=8 if smoke else 16,
        sync_steps=3,
        scope=a.compile_scope,
        clip=a.clip,
        budget_s=a.budget_s if a.budget_s is not None else (120.0 if smoke else 330.0),
        smoke=smoke,
    )
    if plan.fault_d_model not in plan.batch:
        plan.batch[plan.fault_d_model] = min(plan.batch.values())
    plan.json_path = a.json or (os.path.join(os.environ["OUT"], "bench_gpu.json") if os.environ.get("OUT") else None)
    return plan


# -- one model replica, optionally watched -----------------------------------------------------


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, ValueError, TypeError):  # fused AdamW not built for this device or dtype
        return torch.optim.AdamW(model.parameters(), lr=1e-4)


class Replica:
    """A model and its optimizer; with a preset, sdcwatch attached over an in-memory bus."""

    def __init__(self, plan: Plan, d: int, config: str, mode: str, seed: int = 0, faults: list | None = None) -> None:
        torch.manual_seed(seed)
        with torch.device(plan.device):
            self.model = Llama(plan.shape(d)).to(plan.torch_dtype)
        self.opt = optimizer(self.model)
        self.mode = mode
        if mode != "eager":
            how = "reduce-overhead" if mode == "cudagraphs" else None
            if (
                plan.scope == "blocks"
            ):  # each block on its own, as torchtitan does: compile time does not grow with depth
                for block in self.model.layers:
                    block.compile(mode=how)
            else:
                self.model.compile(mode=how)
        self.bus = self.emitter = self.watch = self.injector = None
        if config != "clean":
            self.bus = MemoryBus()
            self.emitter = Emitter(MemoryTransport(self.bus), run=f"bench-{config}", rank=0, world=1, host="bench")
            self.watch = attach(self.model, self.emitter, optimizer=self.opt, config=PROBE_PRESETS[config])
        if faults:
            self.injector = FaultInjector(faults).attach(self.model, self.opt)
            if mode != "eager":  # a faulty device is not traced: the injector's hooks run eagerly
                for m in self.model.modules():
                    for hook in output_faults(m):
                        hook.hook = torch.compiler.disable(hook.hook)
        self.step_no = 0
        self.clip = plan.clip

    def step(self, tokens: torch.Tensor) -> None:
        s = self.step_no
        if self.injector is not None:
            self.injector.begin_step(s)
        if self.mode == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        if self.clip:  # as most LLM loops do
            if self.watch is not None:
                self.watch.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.watch is not None:
            self.watch.step(s, loss=loss)
        if self.injector is not None:
            self.injector.end_step()
        self.step_no += 1

    def close(self) -> list[dict]:
        """Close the watch and the emitter; the incidents the detectors open over its records."""
        if self.watch is None:
            return []
        self.watch.close()
        self.emitter.close(timeout=10.0)
        return detect(self.bus)


def detect(bus: MemoryBus) -> list[dict]:
    """The service's in-process path: decode the topic as the service does, run the detectors;
    each incident as it was last changed (its peak and last step may move after it opened)."""
    items, rejected = IngestDecoder().decode(("t", k, v) for k, v in bus.messages(TELEMETRY_TOPIC))
    pipe = DetectionPipeline()
    latest = {e.incident.id: e.incident for e in pipe.process(items) + pipe.flush() + pipe.expire()}
    out = [
        dict(
            kind=i.kind,
            step=i.first_step,
            peak_step=i.peak_step,
            last_step=i.last_step,
            ranks=list(i.ranks),
            metric=i.metric,
            layer=i.layer,
            layer_name=i.layer_name,
            detector=i.detector,
        )
        for i in latest.values()
    ]
    return out + [dict(kind="rejected", reason=r.reason) for r in rejected[:3]]


def token_batches(plan: Plan, d: int, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator(device=plan.device).manual_seed(1234 + d)
    shape = (plan.batch[d], plan.seq + 1)
    return [torch.randint(0, plan.vocab, shape, generator=g, device=plan.device) for _ in range(n)]


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- measuring -----------------------------------------------------------------------------------


class StepClock:
    """Step times: CUDA events on a GPU (read once at the end), the wall clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[Any, Any]] = []

    def step(self, rep: "Replica", tokens: torch.Tensor) -> None:
        """One timed training step of ``rep``."""
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            rep.step(tokens)
            b.record()
        else:
            a = time.perf_counter()
            rep.step(tokens)
            b = time.perf_counter()
        self.marks.append((a, b))

    def ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return [(b - a) * 1e3 for a, b in self.marks]


class CompileCounters:
    """Dynamo's counters over windows of steps: graph breaks (and why), graphs, recompiles (a frame
    compiled again inside the windows: its first compile there is not one), recompile-limit hits."""

    def __init__(self) -> None:
        self.limit_hits = 0
        self.first_hit = ""
        log = logging.getLogger("torch._dynamo.convert_frame")
        handler = logging.Handler()
        handler.emit = self._on_log
        log.addHandler(handler)
        log.propagate = False  # counted and kept in the JSON, not printed over the progress lines

    def _on_log(self, record: logging.LogRecord) -> None:
        if "hit config." in str(record.msg):
            self.limit_hits += 1
            self.first_hit = self.first_hit or record.getMessage()[:400]

    def snapshot(self) -> dict:
        from torch._dynamo.utils import counters

        try:
            from torch._dynamo.convert_frame import FRAME_COMPILE_COUNTER as frames
        except ImportError:
            frames = None
        return dict(
            breaks=dict(counters["graph_break"]),
            graphs=counters["stats"]["unique_graphs"],
            frames=None if frames is None else dict(frames),
            limit_hits=self.limit_hits,
        )

    def over(self, *windows: tuple[dict, dict]) -> dict:
        """The counts added inside ``windows`` (pairs of snapshots), summed."""
        reasons: dict[str, int] = {}
        compiles: dict[Any, int] = {}
        graphs = hits = 0
        for a, b in windows:
            for k, v in b["breaks"].items():
                if v > a["breaks"].get(k, 0):
                    reasons[k] = reasons.get(k, 0) + v - a["breaks"].get(k, 0)
            for f, n in (b["frames"] or {}).items():
                if n > (a["frames"] or {}).get(f, 0):
                    compiles[f] = compiles.get(f, 0) + n - (a["frames"] or {}).get(f, 0)
            graphs += b["graphs"] - a["graphs"]
            hits += b["limit_hits"] - a["limit_hits"]
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:5]
        frames_known = all(a["frames"] is not None for a, _ in windows)
        return dict(
            graph_breaks=sum(reasons.values()),
            graphs=graphs,
            recompiles=sum(compiles.values()) - len(compiles) if frames_known else None,
            recompile_limit_hits=hits,
            break_reasons=[f"{n}x {' '.join(r.split())[:200]}" for r, n in top],
            recompile_limit_message=self.first_hit if hits else "",
        )


def sync_check(rep: Replica, tokens: list[torch.Tensor], steps: int) -> str:
    """A few steps under ``torch.cuda.set_sync_debug_mode("error")``: "0", or what raised."""
    if not torch.cuda.is_available() or next(rep.model.parameters()).device.type != "cuda":
        return "n/a (cpu)"
    errors = rep.watch.errors if rep.watch is not None else 0
    torch.cuda.synchronize()
    result = "0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(steps):
                rep.step(tokens[i % len(tokens)])
            if rep.watch is not None:
                rep.watch.flush()  # the records of those steps, read on the sender thread, in the window
        except Exception as exc:
            result = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    dropped = (rep.watch.errors if rep.watch is not None else 0) - errors
    if result == "0" and dropped:
        said = [str(w.message)[:200] for w in caught if issubclass(w.category, RuntimeWarning)]
        result = f"{dropped} record(s) dropped by the probes" + (f": {said[0]}" if said else "")
    return result


# -- the sections --------------------------------------------------------------------------------


@dataclass
class Results:
    plan: dict
    timing: list[dict] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    sections: list[dict] = field(default_factory=list)
    machine: dict = field(default_factory=dict)


def time_config(
    plan: Plan, d: int, mode: str, config: str, clean: Replica, data: list, counters: CompileCounters
) -> dict:
    """One preset against the clean replica, interleaved step by step in this process."""
    cuda = plan.device == "cuda"
    if mode != "eager":
        torch._dynamo.reset()  # this preset's compile from a fresh start, as its user would see it
    before = counters.snapshot()
    t0 = time.perf_counter()
    rep = Replica(plan, d, config, mode)
    for i in range(plan.warmup):
        rep.step(data[i % len(data)])
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    mid = counters.snapshot()
    for i in range(plan.warmup if mode != "eager" else 0):  # clean compiles again after the reset
        clean.step(data[i % len(data)])
    window = counters.snapshot()
    a, b = StepClock(cuda), StepClock(cuda)
    for i in range(plan.steps):
        a.step(clean, data[i % len(data)])
        b.step(rep, data[i % len(data)])
    clean_ms, ms = a.ms(), b.ms()
    after = counters.snapshot()
    row = dict(d_model=d, mode=mode, config=config, batch=plan.batch[d], warmup_s=round(warm_s, 1))
    row.update(summarise(clean_ms, ms))
    if mode != "eager":  # the preset's warm-up and timed steps; not the clean replica's compile between
        row.update(counters.over((before, mid), (window, after)))
    if config == "default":
        row["host_syncs_clean"] = sync_check(clean, data, plan.sync_steps)
        row["host_syncs"] = sync_check(rep, data, plan.sync_steps)
    row["probe_errors"] = rep.watch.errors
    incidents = rep.close()
    row["messages"] = rep.bus.size(TELEMETRY_TOPIC)
    row["false_alarms"] = incidents
    del rep
    release()
    return row


def summarise(clean_ms: list[float], ms: list[float]) -> dict:
    med_c, med = statistics.median(clean_ms), statistics.median(ms)
    pairs = [p / c for c, p in zip(clean_ms, ms) if c > 0]
    return dict(
        steps=len(ms),
        clean_ms_median=round(med_c, 3),
        ms_median=round(med, 3),
        clean_ms_mean=round(statistics.fmean(clean_ms), 3),
        ms_mean=round(statistics.fmean(ms), 3),
        overhead_pct=round(100 * (med / med_c - 1), 2),
        overhead_mean_pct=round(100 * (statistics.fmean(ms) / statistics.fmean(clean_ms) - 1), 2),
        pair_ratio_median=round(statistics.median(pairs), 4) if pairs else None,
    )


def timing_section(plan: Plan, d: int, mode: str, res: Results, counters: CompileCounters, budget: "Budget") -> None:
    configs = plan.configs if mode == "eager" else plan.compiled_configs
    data = token_batches(plan, d)
    if mode != "eager":
        torch._dynamo.reset()
    before = counters.snapshot()
    clean = Replica(plan, d, "clean", mode)
    t0 = time.perf_counter()
    for i in range(plan.warmup):
        clean.step(data[i % len(data)])
    if plan.device == "cuda":
        torch.cuda.synchronize()
    base = dict(d_model=d, mode=mode, config="clean", batch=plan.batch[d], warmup_s=round(time.perf_counter() - t0, 1))
    if mode != "eager":
        base.update(counters.over((before, counters.snapshot())))
    res.timing.append(base)
    say(f"d_model {d} {mode}: clean warm in {base['warmup_s']} s")
    last = 0.0  # seconds the previous preset took: the next one is expected to take as long
    for config in configs:
        if budget.over(last):
            res.timing.append(dict(d_model=d, mode=mode, config=config, skipped=budget.why()))
            continue
        t0 = time.perf_counter()
        try:
            row = time_config(plan, d, mode, config, clean, data, counters)
        except Exception as exc:
            row = dict(d_model=d, mode=mode, config=config, error=failure(exc))
            release()
        last = time.perf_counter() - t0
        res.timing.append(row)
        if "ms_median" in row:
            base.setdefault("ms_median", row["clean_ms_median"])
        if "host_syncs_clean" in row:
            base["host_syncs"] = row["host_syncs_clean"]
        say(f"d_model {d} {mode} {config}: {brief(row)}")
    del clean
    release()


FAULTS = (  # (kind, product, step offset from the run's fault step): one product output each
    ("bitflip", "layers.1.attention.wo", 0),
    ("nan", "layers.0.feed_forward.w2", 1),
    ("near_inf", "layers.1.attention.wq", -1),
)
#: What near_inf writes: the injector's default (1e10, the near-INF threshold) is 9.9992e9 once
#: rounded to bf16, below the threshold; 1e11 is near-INF in every dtype.
NEAR_INF = 1e11


def fault_specs(plan: Plan) -> list[FaultSpec]:
    top_exponent_bit = 8 * torch.empty((), dtype=plan.torch_dtype).element_size() - 2
    last = plan.layers - 1
    at = plan.fault_steps - 3  # not a multiple of 16: the default's sampled checksums are not there
    specs = []
    for kind, target, off in FAULTS:
        target = target.replace("layers.1.", f"layers.{min(1, last)}.")
        bit = top_exponent_bit if kind == "bitflip" else None
        magnitude = NEAR_INF if kind == "near_inf" else None
        specs.append(FaultSpec(kind=kind, step=at + off, rank=0, target=target, bit=bit, magnitude=magnitude, seed=7))
    return specs


def fault_run(plan: Plan, mode: str, config: str, spec: FaultSpec) -> dict:
    d = plan.fault_d_model
    data = token_batches(plan, d)
    if mode != "eager":
        torch._dynamo.reset()
    rep = Replica(plan, d, config, mode, seed=1, faults=[spec])
    for i in range(plan.fault_steps):
        rep.step(data[i % len(data)])
    hit = [j for j in rep.injector.injections if j.step == spec.step]
    before = after = None
    if hit and hit[0].before is not None:
        before, after = number(hit[0].before), number(hit[0].after)
    incidents = rep.close()
    row = dict(
        d_model=d,
        mode=mode,
        config=config,
        fault=spec.kind + (f" bit {spec.bit}" if spec.bit is not None else ""),
        target=spec.target,
        injected_step=spec.step,
        injected=bool(hit),
        value_before=before,
        value_after=after,
    )
    row.update(judge(spec.step, incidents))
    del rep
    release()
    return row


def number(t: torch.Tensor) -> float | str:
    """A 0-d tensor as a JSON number; NaN and infinities as their names."""
    x = float(t.float())
    return x if math.isfinite(x) else str(x)


def judge(step: int, incidents: list[dict]) -> dict:
    """Which incident names the fault: one opened at its step, else one already open whose peak
    moved to it, else the first opened after it."""
    at = [i for i in incidents if i.get("step") == step]
    peaked = [i for i in incidents if i.get("peak_step") == step and i["step"] < step]
    later = [i for i in incidents if isinstance(i.get("step"), int) and i["step"] > step]
    early = [i for i in incidents if isinstance(i.get("step"), int) and i["step"] < step]
    named = sorted(at, key=lambda i: i.get("layer_name") is None)[:1] or peaked[:1] or later[:1]
    out = dict(found_step=None, found=False, ranks=None, layer=None, incident=None, opened_before=None)
    if named:
        i = named[0]
        found_step = step if i in peaked else i["step"]
        found = i in at  # an incident of its own, opened at its step
        out.update(found_step=found_step, found=found, ranks=i["ranks"], incident=i["kind"])
        out["layer"] = i["layer_name"] or (f"{i['metric']}[{i['layer']}]" if i["layer"] is not None else i["metric"])
        out["opened_before"] = i["step"] if i in peaked else None
    out["false_alarms_before"] = early
    out["incidents"] = incidents
    return out


def fault_section(plan: Plan, mode: str, res: Results, budget: "Budget") -> None:
    last = 0.0
    for config in ("default", "forward-checksums"):
        for spec in fault_specs(plan):
            label = f"faults {mode} {config} {spec.kind}"
            d = plan.fault_d_model
            if budget.over(last):
                res.faults.append(dict(d_model=d, mode=mode, config=config, fault=spec.kind, skipped=budget.why()))
                continue
            t0 = time.perf_counter()
            try:
                row = fault_run(plan, mode, config, spec)
            except Exception as exc:
                row = dict(d_model=d, mode=mode, config=config, fault=spec.kind, target=spec.target, error=failure(exc))
                release()
            last = time.perf_counter() - t0
            res.faults.append(row)
            say(f"{label}: {brief(row)}")


# -- running it all --------------------------------------------------------------------------------


class Budget:
    """Seconds the whole run may take; a piece of work starts only if it is expected to fit."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def over(self, expected: float = 0.0) -> bool:
        return time.perf_counter() - T0 + expected > self.seconds

    def why(self) -> str:
        return f"budget {self.seconds:.0f} s spent"


def failure(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}{where}"


def brief(row: dict) -> str:
    if "skipped" in row or "error" in row:
        return row.get("error") or f"skipped ({row['skipped']})"
    if "ms_median" in row:
        s = f"{row['ms_median']:.2f} ms vs {row['clean_ms_median']:.2f} ms clean ({row['overhead_pct']:+.1f}%)"
        if row.get("graph_breaks") is not None:
            s += f", {row['graph_breaks']} graph breaks, {row['graphs']} graphs, {row['recompiles']} recompiles"
        return s + (f", host syncs {row['host_syncs']}" if "host_syncs" in row else "")
    if "injected_step" in row:
        if row["incident"] is None:
            said = "missed"
        elif row["found"]:
            said = f"named at {row['found_step']}"
        elif row.get("opened_before") is not None:
            said = f"the peak of an incident opened at {row['opened_before']}"
        else:
            said = f"named late, at {row['found_step']}"
        return f"injected at {row['injected_step']}, {said}"
    return json.dumps(row)[:200]


def sections(plan: Plan) -> list[tuple[str, Callable]]:
    """The work in order of what matters most: the widest model first, then the faults."""
    out: list[tuple[str, Callable]] = []
    first_faults = True
    for d in sorted(plan.d_models, reverse=True):
        for mode in plan.modes:
            out.append((f"timing d_model {d} {mode}", lambda r, c, b, d=d, m=mode: timing_section(plan, d, m, r, c, b)))
        if first_faults and "eager" in plan.fault_modes:
            out.append(("faults eager", lambda r, c, b: fault_section(plan, "eager", r, b)))
            first_faults = False
    for mode in plan.fault_modes:
        if mode != "eager":
            out.append((f"faults {mode}", lambda r, c, b, m=mode: fault_section(plan, m, r, b)))
    return out


def machine(plan: Plan) -> dict:
    info = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        host=platform.node(),
        cpu=platform.processor() or platform.machine(),
        sdcwatch=SOURCE,
        command=" ".join([Path(sys.executable).name, *sys.argv]),
    )
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if plan.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def main(argv: list[str] | None = None) -> int:
    plan = parse_plan(argv)
    if plan.device == "cpu" and not plan.smoke:
        say("no CUDA device: running on the CPU (use --smoke for the toy sizes)")
    torch.set_float32_matmul_precision("high")
    if plan.smoke:
        torch.set_num_threads(1)
    res = Results(plan={k: v for k, v in asdict(plan).items()}, machine=machine(plan))
    say(f"sdcwatch from {SOURCE}; torch {torch.__version__} on {res.machine.get('gpu', plan.device)}")
    counters = CompileCounters()
    budget = Budget(plan.budget_s)
    for name, run in sections(plan):
        if budget.over():
            res.sections.append(dict(name=name, status="skipped", why=budget.why()))
            say(f"{name}: skipped ({budget.why()})")
            continue
        t0 = time.perf_counter()
        say(f"{name}: start")
        try:
            run(res, counters, budget)
            res.sections.append(dict(name=name, status="ok", seconds=round(time.perf_counter() - t0, 1)))
        except Exception as exc:
            res.sections.append(dict(name=name, status="error", error=failure(exc)))
            say(f"{name}: error {failure(exc)}")
        release()
        write_json(plan, res)  # after every section: a run killed later still leaves these numbers
    write_json(plan, res)
    if plan.json_path:
        say(f"JSON written to {plan.json_path}")
    print(table(res), flush=True)
    return 0


def write_json(plan: Plan, res: Results) -> None:
    res.machine["total_s"] = round(time.perf_counter() - T0, 1)
    if plan.json_path:
        Path(plan.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(plan.json_path).write_text(json.dumps(asdict(res), indent=1, default=str))


def table(res: Results) -> str:
    """The one markdown table: a row per timed preset, per fault run, per skipped or failed section."""
    m = res.machine
    head = [
        f"sdcwatch GPU benchmark on {m.get('gpu', 'cpu')}, torch {m['torch']}, {m['total_s']} s "
        f"(layers {res.plan['layers']}, seq {res.plan['seq']}, {res.plan['dtype']}, compiled: {res.plan['scope']})",
        "",
        "| part | d_model | mode | config | step ms (median) | vs clean | graph breaks / graphs / recompiles | host syncs | fault | named by the detectors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for r in res.timing:
        rows.append(timing_cells(r))
    for r in res.faults:
        rows.append(fault_cells(r))
    for s in res.sections:
        if s["status"] != "ok":
            rows.append(["section", "", "", s["name"], "", "", "", "", "", s.get("why") or s.get("error", "")])
    return "\n".join(head + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows])


def timing_cells(r: dict) -> list:
    cells = ["timing", r.get("d_model", ""), r.get("mode", ""), r.get("config", "")]
    if "ms_median" not in r:
        return cells + ["", "", "", "", "", r.get("error") or r.get("skipped", "")]
    vs = "" if r["config"] == "clean" else f"{r['overhead_pct']:+.2f}% (mean {r['overhead_mean_pct']:+.2f}%)"
    comp = "-" if r.get("graph_breaks") is None else f"{r['graph_breaks']} / {r['graphs']} / {r['recompiles']}"
    if r.get("recompile_limit_hits"):
        comp += f" (limit hit {r['recompile_limit_hits']}x)"
    alarms = r.get("false_alarms") or []
    note = f"{len(alarms)} incident(s) on the clean run" if alarms else ""
    if r.get("probe_errors"):
        note += f" {r['probe_errors']} probe error(s)"
    return cells + [f"{r['ms_median']:.2f}", vs, comp, r.get("host_syncs", "-"), "-", note.strip()]


def short(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def fault_cells(r: dict) -> list:
    cells = ["fault", r.get("d_model", ""), r.get("mode", ""), r.get("config", "")]
    if "injected_step" not in r:
        return cells + ["", "", "", "", r.get("fault", ""), r.get("error") or r.get("skipped", "")]
    what = f"{r['fault']} at {r['target']} step {r['injected_step']}"
    if r["value_after"] is not None:
        what += f" ({short(r['value_before'])} -> {short(r['value_after'])})"
    if not r["injected"]:
        found = "not injected"
    elif r["incident"] is None:
        found = "missed"
    else:
        where = f"step {r['found_step']}"
        if r.get("opened_before") is not None:
            where += f" (the peak of an incident opened at step {r['opened_before']})"
        elif not r["found"]:
            where += f" (late by {r['found_step'] - r['injected_step']})"
        found = f"{where}, rank {','.join(map(str, r['ranks'])) or '-'}, {r['layer']} ({r['incident']})"
    if r["false_alarms_before"]:
        found += f"; {len(r['false_alarms_before'])} incident(s) before the fault"
    return cells + ["", "", "", "", what, found]


if __name__ == "__main__":
    sys.exit(main())
