"""A non-finite incident stays where the bad value first appeared: rank, metric and layer, also
after the NaN has spread to every rank and every layer; ``act_max`` is placed by its layer."""

from __future__ import annotations

import math

from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import LAYER_METRICS
from sdcwatch.detectors import NonFiniteDetector, StepFrame
from sdcwatch.service.incidents import IncidentBook

WORLD, LAYERS = 4, 3


def frame(step, bad=(), act=None, modules=None):
    """Clean records, with NaN at each (rank, metric, layer) in ``bad`` (layer None: a scalar);
    ``act`` = {rank: (act_max, act_max_layer)}, ``modules`` = {rank: act_max_module}."""
    records = []
    for rank in range(WORLD):
        scalars = {"loss": 2.0, "grad_norm_local": 1.0, "grad_norm_global": 1.0, "nonfinite": 0.0}
        layers = {m: [1.0] * LAYERS for m in LAYER_METRICS}
        for r, metric, layer in bad:
            if r == rank:
                if layer is None:
                    scalars[metric] = math.nan
                else:
                    layers[metric][layer] = math.nan
        if act and rank in act:
            scalars["act_max"], scalars["act_max_layer"] = act[rank]
        if modules and rank in modules:
            scalars["act_max_module"] = float(modules[rank])
        records.append(Record.make(run="r", step=step, rank=rank, world=WORLD, scalars=scalars, layers=layers))
    return StepFrame.from_records("r", step, WORLD, records)


def test_the_incident_keeps_the_rank_and_layer_where_the_nan_began_after_it_spreads():
    det, book = NonFiniteDetector(), IncidentBook()
    first = frame(16, bad=[(1, "q_norm_mean", 1), (1, "loss", None)])
    events = book.add(det.update(first))
    assert [(e.change, e.incident.ranks, e.incident.metric, e.incident.layer) for e in events] == [
        ("opened", (1,), "q_norm_mean", 1)
    ]
    # next step every replica is NaN in every layer: more bad values, a higher score
    spread = [(r, m, layer) for r in range(WORLD) for m in LAYER_METRICS for layer in range(LAYERS)]
    later = book.add(det.update(frame(17, bad=spread + [(r, "loss", None) for r in range(WORLD)])))
    (inc,) = [i for i in book.current() if i.open]  # one incident: the spread is not a new one
    assert inc.score > events[0].incident.score and inc.peak_step == 17
    assert (inc.ranks, inc.metric, inc.layer, inc.first_step) == ((1,), "q_norm_mean", 1, 16)
    assert all(e.incident.layer == 1 and e.incident.ranks == (1,) for e in later)


def test_act_max_is_placed_in_the_layer_that_produced_it():
    (f,) = NonFiniteDetector().update(frame(5, act={2: (math.nan, 1.0)}))
    assert (f.ranks, f.metric, f.layer) == ((2,), "act_max", 1)
    (g,) = NonFiniteDetector().update(frame(5, act={2: (math.inf, -1.0)}))  # outside every layer
    assert (g.ranks, g.metric, g.layer) == ((2,), "act_max", None)


def test_the_lowest_layer_of_a_step_is_named_the_forward_pass_reached_it_first():
    (f,) = NonFiniteDetector().update(frame(5, bad=[(0, "attn_entropy", 2), (0, "q_norm_max", 1)]))
    assert (f.metric, f.layer) == ("q_norm_max", 1)


def test_one_process_names_where_it_ran_not_an_empty_rank():
    records = [
        Record.make(
            run="r", step=7, rank=0, world=1, host="h1", scalars={"loss": math.nan, "nonfinite": 1.0}, layers={}
        )
    ]
    (f,) = NonFiniteDetector().update(StepFrame.from_records("r", 7, 1, records))
    assert f.message == "non-finite value at step 7: loss = nan on rank 0 (host h1)"


def test_a_streak_keeps_the_leaf_module_it_began_in_also_across_a_restart():
    """The module of the origin's act_max travels with the streak and in the saved state."""
    det = NonFiniteDetector()
    (f,) = det.update(frame(5, act={2: (math.nan, 1.0)}, modules={2: 7}))
    assert (f.metric, f.layer, f.evidence["act_max_module"]) == ("act_max", 1, 7)
    again = NonFiniteDetector()
    again.restore(det.snapshot())
    spread = frame(6, bad=[(r, "loss", None) for r in range(WORLD)], act={2: (math.nan, 0.0)}, modules={2: 3})
    (g,) = again.update(spread)
    assert (g.ranks, g.metric, g.layer, g.evidence["act_max_module"]) == ((2,), "act_max", 1, 7)


def test_a_finite_value_past_the_limit_is_called_near_inf_not_non_finite():
    """3.6e10 is a number: the message says it is a near-INF value, as the README's limit names it."""
    records = [
        Record.make(run="r", step=20, rank=0, world=1, host="h1", scalars={"loss": 2.0, "grad_norm_global": 3.6e10})
    ]
    (f,) = NonFiniteDetector().update(StepFrame.from_records("r", 20, 1, records))
    assert f.message == "near-INF value at step 20: grad_norm_global = 3.6e+10 on rank 0 (host h1)"
