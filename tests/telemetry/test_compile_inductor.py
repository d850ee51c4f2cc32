"""The probes compiled by inductor end to end (code generation included): no graph break, one extra
graph, the checks measured, and ``forward-checksums`` finding flips at their step.

A module of its own (the other compile tests: test_compile.py, test_compile_frameworks.py) so that
another worker runs those while inductor compiles its kernels, which no cache holds on a fresh clone.
"""

from __future__ import annotations

import pytest
import torch
from compiled_training import Records, compiled_settings, reference, train
from sdcwatch.telemetry.probes.presets import PROBE_PRESETS
from sdcwatch.telemetry.probes.watch import attach


@pytest.fixture(autouse=True)
def _settings(monkeypatch):
    import torch._inductor.config as inductor

    # inductor's pool of compile processes (one a core) starts a Python each and competes for the
    # cores with the suite's other workers: its kernels are compiled in this process
    with inductor.patch(compile_threads=1):
        yield from compiled_settings(monkeypatch)


@pytest.mark.slow
def test_inductor_reference_model():
    # the graphs Dynamo captures do not depend on the backend they are handed to: the model
    # without sdcwatch is counted with aot_eager, which generates no code
    bare_graphs, *_ = train(reference, watch=False)
    graphs, breaks, reasons, records = train(reference, watch=True, backend="inductor")
    assert breaks == 0, reasons
    assert graphs <= 2 * bare_graphs
    assert max(records[16]["layers"]["gemm_fwd"]) <= 1
    assert max(records[16]["layers"]["gemm_bwd"]) > 0


@pytest.mark.slow
def test_compiled_forward_checksums_find_flips_at_their_step():
    """Compiled by inductor, ``forward-checksums`` (the sums of each weight taken by the seal after
    the optimizer step, the row reductions fused by inductor) names a product whose output had an
    exponent flipped at that step, and a weight flipped in memory after its seal at the next forward,
    with no violation on the clean steps around them."""
    from sdcwatch.telemetry.probes.output_faults import output_faults
    from sdcwatch.testbed.faults import FaultInjector
    from sdcwatch.testbed.faultspec import FaultSpec

    torch._dynamo.reset()
    model, loss_of, batch = reference()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = Records()
    compiled = torch.compile(model)
    w = attach(model, records, optimizer=opt, config=PROBE_PRESETS["forward-checksums"])
    flip_out, flip_weight = 5, 9  # neither a multiple of 16: forward-only steps
    injector = FaultInjector([FaultSpec(kind="bitflip", step=flip_out, rank=0, target="blocks.1.mlp.fc", bit=29)])
    injector.attach(model, opt)
    for m in model.modules():
        for hook in output_faults(m):
            hook.hook = torch.compiler.disable(hook.hook)  # a faulty device is not traced
    names = w.checksums.names
    for step in range(12):
        injector.begin_step(step)
        loss = loss_of(compiled, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == flip_weight - 1:  # after the seal: the weight the next forward reads is not the sealed one
            with torch.no_grad():
                model.blocks[0].mlp.proj.weight.view(torch.int32)[3, 5] ^= 1 << 30  # the top exponent bit
        w.step(step, loss=loss)
        injector.end_step()
    w.close()
    assert injector.injections and injector.injections[0].step == flip_out
    fwd = {s: records.by_step[s]["layers"]["gemm_fwd"] for s in range(1, 12)}
    bad = {s: [names[i] for i, r in enumerate(v) if not r <= 1] for s, v in fwd.items()}
    assert bad[flip_out] == ["blocks.1.mlp.fc"], bad
    assert "blocks.0.mlp.proj" in bad[flip_weight], bad
    assert all(not bad[s] for s in range(1, flip_weight) if s != flip_out), bad
