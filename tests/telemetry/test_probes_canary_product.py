"""Each rank says which product its per-product canary checked: ``gemm_canary_product``, the index in
``watch.gemm_canary.products`` of ``product_at(step)``, on every step that carries ``gemm_canary_fp``
and only then."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from reference_loop import train_reference  # noqa: E402
from sdcwatch.core.vocabulary import CANARY_PRODUCT  # noqa: E402
from sdcwatch.telemetry.probes.watch import attach  # noqa: E402
from sdcwatch.testbed.model import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(seq_len=16, d_model=32, n_layer=2, n_head=4)


class Recorder:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict, dict]] = []

    def emit(self, step, *, layers=None, fingerprints=None, **scalars) -> None:
        self.records.append((step, dict(fingerprints or {}), scalars))


def _train(steps: int, **settings) -> tuple[list, object]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = Recorder()
    watch = attach(model, rec, optimizer=opt, **settings)
    train_reference(model, opt, watch, steps, seed=1)
    watch.close()
    return rec.records, watch


@pytest.mark.parametrize("every", [1, 2])
def test_every_canary_step_names_its_product(every):
    records, watch = _train(5, gemm_canary_every=every)
    products = watch.gemm_canary.products
    for step, fps, scalars in records:
        if "gemm_canary_fp" in fps:
            assert scalars[CANARY_PRODUCT] == float(products.index(watch.gemm_canary.product_at(step)))
        else:
            assert CANARY_PRODUCT not in scalars
    assert sum("gemm_canary_fp" in fps for _, fps, _ in records) == len(range(0, 5, every))


def test_without_the_canary_nothing_is_sent():
    records, _ = _train(2, gemm_canary_every=0)
    assert records and all(CANARY_PRODUCT not in scalars for _, _, scalars in records)
