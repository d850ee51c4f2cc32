"""Which probe parts torch.compile (inductor) takes on this machine: the bench model's blocks compiled
one by one with a preset attached, a few steps each, in variants (the fused Triton row scan on or
off, the weight-gradient check in compiled backwards on or off), printing graphs, breaks and the full
error of a variant that fails. Writes the first working variant's environment to ``--env`` (a shell
file the benchmark's run sources), so one device session can find the failing part and still measure.

    python3 bench/gpu/compile_check.py [--d-model 1024] [--env compile_env.sh]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_gpu  # noqa: E402  (its bootstrap makes sdcwatch importable from the checkout)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VARIANTS = [
    ("as shipped", {}),
    ("torch row sums", {"SDCWATCH_TRITON": "0"}),
    ("eager weight-gradient check", {"SDCWATCH_COMPILED_GRAD_CHECK": "0"}),
    ("both off", {"SDCWATCH_TRITON": "0", "SDCWATCH_COMPILED_GRAD_CHECK": "0"}),
]


def attempt(d: int, preset: str, env: dict, device: str) -> str:
    from sdcwatch.telemetry.probes.presets import PROBE_PRESETS
    from sdcwatch.telemetry.probes.watch import attach
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with bench_gpu.environment(env):  # read when the probes are attached
        torch.manual_seed(0)
        shape = bench_gpu.ModelShape(d_model=d, layers=2, seq=512, vocab=4096, head_dim=128 if d >= 512 else 16)
        with torch.device(device):
            model = bench_gpu.Llama(shape).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        class Sink:
            def emit(self, step, **kw):
                pass

        watch = attach(model, Sink(), optimizer=opt, config=PROBE_PRESETS[preset])
        for block in model.layers:
            block.compile()
        for step in range(3):
            tokens = torch.randint(0, shape.vocab, (2, shape.seq + 1), device=device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            watch.step(step, loss=loss)
        watch.close()
        return f"ok: {counters['stats']['unique_graphs']} graphs, {sum(counters['graph_break'].values())} breaks"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--env", default=None, help="write the first working variant's environment here")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = None
    for name, env in VARIANTS:
        for preset in ("default", "forward-checksums"):
            try:
                outcome = attempt(a.d_model, preset, env, device)
            except Exception:
                outcome = "FAILED"
                tail = traceback.format_exc().splitlines()
                print("\n".join(line[:400] for line in tail[-45:]), flush=True)
            print(f"[compile_check] {name} / {preset}: {outcome}", flush=True)
            if not outcome.startswith("ok"):
                break
        else:
            chosen = chosen or env
            break
    if a.env:
        Path(a.env).write_text("".join(f"export {k}={v}\n" for k, v in (chosen or {}).items()))
    print(f"[compile_check] environment for the benchmark: {chosen}", flush=True)
    return 0 if chosen is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
