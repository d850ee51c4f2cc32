"""Fingerprints: exact (one flipped bit shows), equal for equal bits, cheap, stable."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdcwatch.telemetry.probes.fingerprint import (  # noqa: E402
    finalize,
    fingerprint,
    fingerprint_device,
    splitmix64,
)
from sdcwatch.testbed.faults import flip_bit  # noqa: E402

torch.set_num_threads(1)


def test_splitmix64_matches_reference_sequence():
    # first outputs of the reference splitmix64 generator seeded with 0 (Vigna)
    state = 0
    outs = []
    for _ in range(2):
        outs.append(splitmix64(state))
        state = (state + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    assert outs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_equal_bits_give_equal_fingerprints_whatever_the_layout():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 33, generator=g)
    strided = a.t().contiguous().t()  # same values, different memory layout
    assert not strided.is_contiguous()
    assert fingerprint(a) == fingerprint(a.clone()) == fingerprint(strided)
    assert 0 <= fingerprint(a) < 1 << 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(257, generator=g).to(dtype)
    base = fingerprint(a)
    bits = 8 * a.element_size()
    for index in (0, 1, 128, 256):
        for bit in range(bits):
            b = a.clone()
            flip_bit(b, index, bit)
            f = fingerprint(b)
            assert f != base, (index, bit)


def test_two_compensating_flips_in_the_plain_sum_are_still_seen():
    a = torch.zeros(8, dtype=torch.float32)
    b = a.clone()
    ints = b.view(torch.int32)
    ints[0] += 1 << 20
    ints[1] -= 1 << 20  # the plain sum of bit patterns is unchanged
    assert int(a.view(torch.int32).sum()) == int(b.view(torch.int32).sum())
    assert fingerprint(a) != fingerprint(b)


def test_order_of_tensors_matters_and_device_value_needs_no_sync():
    x, y = torch.ones(3), torch.zeros(3)
    raw = fingerprint_device([x, y])
    assert isinstance(raw, torch.Tensor) and raw.dtype == torch.int64 and raw.dim() == 0
    assert finalize(int(raw)) == fingerprint([x, y]) != fingerprint([y, x])


def test_fingerprint_of_a_module_is_stable_across_copies():
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 4)
    m2 = torch.nn.Linear(16, 4)
    m2.load_state_dict(m.state_dict())
    assert fingerprint(list(m.parameters())) == fingerprint(list(m2.parameters()))
    with torch.no_grad():
        m2.bias[1] += 1e-7 * abs(float(m2.bias[1])) + 1e-30
    assert fingerprint(list(m.parameters())) != fingerprint(list(m2.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8])
def test_one_tensors_fingerprint_is_the_combination_of_its_parts(dtype):
    """The one-tensor shortcut (the canary's) gives the value the general combination gives."""
    from sdcwatch.telemetry.probes.fingerprint import combine_parts, tensor_parts

    t = (1e3 * torch.randn(5, 7)).to(dtype)
    assert int(fingerprint_device([t])) == int(combine_parts([tensor_parts(t)]))
    assert int(fingerprint_device(iter([t]))) == int(fingerprint_device([t]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_fingerprint_is_the_concatenations_without_concatenating(dtype, monkeypatch):
    """param_fp / grad_fp: the fingerprint of the tensors laid end to end, summed tensor by tensor
    and chunk by chunk (no copy of the model), bit for bit what the concatenation gives; a flip in
    any chunk of any tensor changes it."""
    from sdcwatch.telemetry.probes import fingerprint as fp

    torch.manual_seed(3)
    tensors = [torch.randn(n).to(dtype) for n in (1000, 37, 4096, 1)] + [torch.randn(13, 11).to(dtype)]
    whole = int(fp.fingerprint_device([torch.cat([t.reshape(-1) for t in tensors])]))
    monkeypatch.setattr(fp, "FLAT_CHUNK", 100)  # every large tensor in several chunks
    assert int(fp.flat_fingerprint_device(tensors)) == whole
    flipped = [t.clone() for t in tensors]
    flip_bit(flipped[2], 3999, 3)  # in the tensor's last chunk
    assert int(fp.flat_fingerprint_device(flipped)) != whole
