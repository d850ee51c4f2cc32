"""One contract, run on every detector class the package registers (a new detector is tested by
being written): deterministic for a seed, silent in warm-up, finds its fault family, silent on
clean data, and snapshot + restore equal to an uninterrupted run."""

from __future__ import annotations

import json

import pytest
from detector_synth import Fault, SyntheticRun, findings_key
from sdcwatch.detectors import DETECTORS, Detector, SplitDetector

ALL = pytest.mark.parametrize("cls", DETECTORS, ids=lambda c: c.name)
RANK_LOCAL = {"nonfinite", "rank_shift", "replica", "straggler", "missing", "checksum"}


def run(det, frames):
    out = []
    for fr in frames:
        out += det.update(fr)
    return out


def test_every_detector_is_registered():
    assert {c.name for c in DETECTORS} >= {
        "nonfinite",
        "spike",
        "rank_outlier",
        "replica",
        "straggler",
        "missing_rank",
        "river_hst",
        "checksum",
        "lr_jump",
    }


@ALL
def test_declares_a_known_fault_family_and_warmup(cls):
    from detector_synth import FAMILIES

    assert cls.fault in FAMILIES
    assert int(cls().warmup_steps) >= 0


@ALL
def test_deterministic_for_a_seed(cls):
    synth = SyntheticRun(seed=7, faults=[Fault(cls.fault, step=150)])
    frames = [synth.frame(s) for s in range(220)]
    a, b = run(cls(), frames), run(cls(), frames)
    assert findings_key(a) == findings_key(b)


#: Whether each of sdcwatch's detectors has a warm-up (steps during which it only learns): said here,
#: not read from it, so one whose warm-up disappears or appears fails instead of skipping a check. A
#: new detector is not listed: its own warm-up decides which checks it gets (its test says which).
HAS_WARMUP = {
    "nonfinite": False,
    "checksum": False,
    "spike": True,
    "lr_jump": True,
    "rank_outlier": True,
    "replica": False,
    "straggler": True,
    "missing_rank": False,
    "guard": False,
    "river_hst": True,
}


def _warms_up(cls) -> bool:  # a listed one is not built at collection (river's import costs seconds)
    return HAS_WARMUP[cls.name] if cls.name in HAS_WARMUP else int(cls().warmup_steps) > 0


WITH_WARMUP = pytest.mark.parametrize("cls", [c for c in DETECTORS if _warms_up(c)], ids=lambda c: c.name)
WITHOUT_WARMUP = pytest.mark.parametrize("cls", [c for c in DETECTORS if not _warms_up(c)], ids=lambda c: c.name)


@ALL
def test_keeps_its_warmup_or_its_absence(cls):
    assert (int(cls().warmup_steps) > 0) == HAS_WARMUP.get(cls.name, int(cls().warmup_steps) > 0)


@WITH_WARMUP
def test_silent_during_warmup(cls):
    """Its fault, injected in the second half of the warm-up, gives no finding before it ends."""
    det = cls()
    n = int(det.warmup_steps)
    assert n >= 1, f"{cls.name} is said to have a warm-up but has none"
    fault = Fault(cls.fault, step=n // 2, length=max(1, n - n // 2))
    assert fault.step < n, "the fault must fall inside the warm-up"
    synth = SyntheticRun(seed=1, faults=[fault])
    checked = 0
    for s in range(n):
        assert det.update(synth.frame(s)) == [], f"finding during warm-up at step {s}"
        checked += 1
    assert checked == n


@WITHOUT_WARMUP
def test_judges_from_its_first_step_without_a_warmup(cls):
    """No warm-up: its fault, there from the very first step, is found as soon as it can be."""
    det = cls()
    assert int(det.warmup_steps) == 0
    fault = Fault(cls.fault, step=0)
    synth = SyntheticRun(seed=3, faults=[fault])
    found = [f for s in range(50) for f in det.update(synth.frame(s))]
    assert found, "no finding for a fault present from step 0"
    # at once, or after the few steps that make it (missing_rank: absent from `after` steps in a row)
    assert min(f.step for f in found) <= 10, "a detector without a warm-up waited as if it had one"


@ALL
def test_finds_its_injected_fault(cls):
    det = cls()
    onset = int(det.warmup_steps) + 100
    fault = Fault(cls.fault, step=onset)
    synth = SyntheticRun(seed=3, faults=[fault])
    found = [f for s in range(onset + 50) for f in det.update(synth.frame(s))]
    assert found, "no finding for the injected fault"
    assert min(f.step for f in found) >= onset, "finding before the fault"
    first = min(f.step for f in found)
    assert first - onset <= 50
    if cls.fault in RANK_LOCAL:
        assert any(fault.rank in f.ranks for f in found), "the faulty rank is not named"


@ALL
def test_silent_on_clean_data(cls):
    det = cls()
    synth = SyntheticRun(seed=11)
    found = [f for s in range(int(det.warmup_steps) + 500) for f in det.update(synth.frame(s))]
    assert found == []


@ALL
def test_snapshot_restore_equals_uninterrupted_run(cls):
    synth = SyntheticRun(seed=5, faults=[Fault(cls.fault, step=int(cls().warmup_steps) + 40)])
    n = int(cls().warmup_steps) + 90
    frames = [synth.frame(s) for s in range(n)]
    whole = run(cls(), frames)
    cut = n - 60  # in the middle of warm-up's end and the fault
    first = cls()
    part = run(first, frames[:cut])
    state = json.loads(json.dumps(first.snapshot(), allow_nan=False))
    second = cls()
    second.restore(state)
    part += run(second, frames[cut:])
    assert findings_key(part) == findings_key(whole)
    assert whole, "the fault should have produced findings (else the comparison proves little)"


SPLIT = pytest.mark.parametrize("cls", [c for c in DETECTORS if issubclass(c, SplitDetector)], ids=lambda c: c.name)


def test_every_detector_but_the_river_baseline_splits_in_two_halves():
    assert {c.name for c in DETECTORS if not issubclass(c, SplitDetector)} == {"river_hst"}
    assert all(issubclass(c, Detector) for c in DETECTORS)


@SPLIT
def test_halves_across_the_wire_equal_update(cls):
    """observe -> step summary bytes -> judge, in two detector objects, finds exactly what update finds."""
    from sdcwatch.service.summary import StepSummary, decode_summary, encode_summary

    synth = SyntheticRun(seed=9, faults=[Fault(cls.fault, step=int(cls().warmup_steps) + 30)])
    whole, spatial, temporal = cls(), cls(), cls()
    expected, got = [], []
    for s in range(int(cls().warmup_steps) + 90):
        fr = synth.frame(s)
        expected += whole.update(fr)
        summary = StepSummary(
            fr.run,
            fr.step,
            fr.world,
            int(fr.present.sum()),
            hosts=fr.hosts,
            observations={cls.name: spatial.observe(fr)},
        )
        back = decode_summary(encode_summary(summary))
        got += temporal.judge(back, back.observations[cls.name])
    assert expected, "the fault was not found at all"
    assert findings_key(got) == findings_key(expected)
    assert [f.message for f in got] == [f.message for f in expected]
