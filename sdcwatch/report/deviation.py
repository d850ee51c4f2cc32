"""How far each rank strays from the others: robust z-scores over ranks, and means over ranks.

The deviation score is computed here from the records with numpy (robust z against the
cross-rank median and MAD); it deliberately does not reuse the detectors, so the picture is an
independent view of the data the detectors saw. No plotting here, so the numbers can be checked
(and tested) apart from how they are drawn.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, NamedTuple

import numpy as np

from sdcwatch.core.vocabulary import DEVIATION_METRICS
from sdcwatch.report.data import RunData

MIN_RANKS = 3  # a median and a MAD over fewer ranks say nothing about which one is odd


def robust_z(values: np.ndarray) -> np.ndarray:
    """Robust z of each rank against the others at every step: ``(x - median) / (1.4826 MAD)``.

    ``values`` is (steps, ranks) with NaN for a missing rank. The scale has a floor (a millionth
    of the median's magnitude) so ranks that agree to the last bit do not divide by zero. An
    infinite value scores +Inf (the most deviant thing a rank can report); NaN is read as
    "no value" and stays NaN (see :func:`rank_deviation` for NaN a rank reported).

    >>> import numpy as np
    >>> z = robust_z(np.array([[1.0, 1.1, 0.9, 1.0, 5.0]]))
    >>> int(np.argmax(z[0])), bool(z[0, 4] > 10)
    (4, True)
    """
    x = np.asarray(values, dtype=np.float64)
    finite = np.where(np.isfinite(x), x, np.nan)
    with np.errstate(all="ignore"), quiet_nan_warnings():
        med = np.nanmedian(finite, axis=1, keepdims=True)
        mad = np.nanmedian(np.abs(finite - med), axis=1, keepdims=True) * 1.4826
        scale = np.maximum(mad, np.maximum(np.abs(med) * 1e-6, 1e-12))
        z = (finite - med) / scale
    return np.where(np.isinf(x), np.inf, z)


class Deviation(NamedTuple):
    """How far each rank strays from the others, per step (see :func:`rank_deviation`)."""

    score: np.ndarray  # (S, R) largest |robust z| over the metrics; +Inf: non-finite on this rank only
    metrics: list[str]  # the metrics that were available
    widespread: np.ndarray  # (S, R) bool: non-finite together with most ranks (the run broke, not the rank)


def rank_deviation(data: RunData) -> Deviation:
    """Per rank and step, the largest |robust z| over :data:`DEVIATION_METRICS`.

    A value only this rank (or a minority) reported as NaN/Inf scores +Inf: that is how SDC
    looks on the step it strikes. Once most ranks are non-finite (the corruption has spread
    through the all-reduce) the value no longer says which rank is odd: it scores nothing and
    is flagged in ``widespread``. NaN where the rank sent no record.
    """
    used = [m for m in DEVIATION_METRICS if m in data.scalars]
    present = data.present
    score = np.full(present.shape, np.nan)
    widespread = np.zeros(present.shape, dtype=bool)
    n_present = present.sum(axis=1, keepdims=True)
    for name in used:
        raw = data.scalars[name]
        nonfinite = present & ~np.isfinite(raw)
        most = nonfinite.sum(axis=1, keepdims=True) * 2 > n_present
        z = np.abs(robust_z(np.where(present & np.isfinite(raw), raw, np.nan)))
        z = np.where(nonfinite & ~most, np.inf, z)
        score = np.fmax(score, z)
        widespread |= nonfinite & most
    score[~present] = np.nan
    widespread &= np.isnan(score)  # a rank that still stands out on another metric is scored
    return Deviation(score, used, widespread)


@contextlib.contextmanager
def quiet_nan_warnings() -> Iterator[None]:
    """All-NaN slices (a step nobody reported) are expected; keep numpy quiet about them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _mean_over_ranks(data: RunData, name: str) -> np.ndarray:
    """Mean over the ranks that reported; a NaN one rank reported makes the step NaN (a gap)."""
    values = data.scalars[name]
    count = data.present.sum(axis=1)
    total = np.where(data.present, values, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def global_series(data: RunData) -> tuple[tuple[str, np.ndarray, np.ndarray | None], ...]:
    """(label, series, per-rank values for the spread band or None) for loss and gradient norm."""
    out = []
    if "loss_global" in data.scalars and np.any(data.present & ~np.isnan(data.scalars["loss_global"])):
        out.append(("global loss", _mean_over_ranks(data, "loss_global"), data.scalars.get("loss")))
    elif "loss" in data.scalars:
        out.append(("loss (mean over ranks)", _mean_over_ranks(data, "loss"), data.scalars["loss"]))
    if "grad_norm_global" in data.scalars and np.any(data.present & ~np.isnan(data.scalars["grad_norm_global"])):
        out.append(
            ("global gradient norm", _mean_over_ranks(data, "grad_norm_global"), data.scalars.get("grad_norm_local"))
        )
    elif "grad_norm_local" in data.scalars:
        out.append(
            (
                "gradient norm (mean of local)",
                _mean_over_ranks(data, "grad_norm_local"),
                data.scalars["grad_norm_local"],
            )
        )
    return tuple(out)
