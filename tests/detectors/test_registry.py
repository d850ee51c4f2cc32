"""The registry finds the detectors by itself (a class with ``@register`` in any module of the
package, baselines included), in the order their ``order`` values give, which is the pipeline's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import sdcwatch.detectors
from sdcwatch.detectors.registry import (
    baseline_classes,
    default_classes,
    default_detectors,
    detector_class,
    detector_classes,
    detector_metrics,
    register,
)


def _registered_in_source() -> dict[str, int]:
    """Class name -> its ``order``, for every class the package's source decorates with ``@register``."""
    out = {}
    for folder in sdcwatch.detectors.__path__:
        for path in sorted(Path(folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ClassDef):
                    continue
                for deco in node.decorator_list:
                    if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "register":
                        out[node.name] = next(k.value.value for k in deco.keywords if k.arg == "order")
    return out


def test_every_class_decorated_in_the_package_is_registered():
    in_source = _registered_in_source()
    registered = {*detector_classes(), *default_classes(), *baseline_classes().values()}
    assert len(in_source) >= 10
    assert {c.__name__ for c in registered} == set(in_source)


def test_the_pipeline_runs_the_detectors_in_the_order_their_numbers_give():
    assert [c.name for c in default_classes()] == [
        "nonfinite",
        "checksum",
        "spike",
        "lr_jump",
        "rank_outlier",
        "replica",
        "straggler",
        "missing_rank",
        "guard",
    ]
    assert [type(d).name for d in default_detectors()] == [c.name for c in default_classes()]
    assert [c.name for c in detector_classes()] == [c.name for c in default_classes()] + ["river_hst"]
    assert list(baseline_classes()) == [
        "river_hst"
    ]  # the other baselines are the campaign's (sdcwatch.testbed.campaign)
    orders = _registered_in_source()
    for group in (detector_classes(), default_classes(), list(baseline_classes().values())):
        assert [orders[c.__name__] for c in group] == sorted(orders[c.__name__] for c in group)


def test_a_detector_is_found_by_name_own_or_baseline():
    assert detector_class("missing_rank").__module__ == "sdcwatch.detectors.missing_rank"
    assert detector_class("river_hst").__module__ == "sdcwatch.detectors.river_hst"
    for name in ("no_such_detector", "zclip"):  # zclip: a campaign baseline, not one of the product's
        with pytest.raises(KeyError):
            detector_class(name)


def test_an_order_or_a_name_already_taken_is_refused():
    assert detector_class("spike").name == "spike"  # the package's detectors are registered
    taken = type("Twin", (), {"name": "twin"})
    with pytest.raises(ValueError, match="order 30 is taken by spike"):
        register(order=30)(taken)
    same_name = type("Spike2", (), {"name": "spike"})
    with pytest.raises(ValueError, match="the name is taken"):
        register(order=99_999)(same_name)
    assert "twin" not in {c.name for c in detector_classes()}


def test_the_metrics_detectors_declare_are_gathered_once_and_a_clash_is_refused(monkeypatch):
    from sdcwatch.core.metric_spec import MetricSpec
    from sdcwatch.detectors import registry
    from sdcwatch.detectors.rank_outlier import RANK_OUTLIER_SCORE

    names = [spec.name for spec in detector_metrics()]
    assert names.count(RANK_OUTLIER_SCORE.name) == 1  # rank_outlier and river_hst share it
    assert {"sdcwatch_detector_spike_score", "sdcwatch_pipeline_missing_ranks"} <= set(names)
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))  # forgotten after the test
    other = MetricSpec(RANK_OUTLIER_SCORE.name, "gauge", ("run",), "Another number.", read=lambda d: 0.0)
    register(order=99_998)(type("Clash", (), {"name": "clash", "metrics": (other,)}))
    with pytest.raises(ValueError, match="declared otherwise by another detector"):
        detector_metrics()
