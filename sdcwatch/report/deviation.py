"""How far each rank strays from the others: robust z-scores over ranks (the spread floored at its
typical value, the score calibrated on the run), and means over ranks; computed with numpy, not with
the detectors, so the page is an independent view of the data they saw.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, NamedTuple

import numpy as np

from sdcwatch.core.vocabulary import DEVIATION_METRICS
from sdcwatch.report.data import RunData

MIN_RANKS = 3  # a median and a MAD over fewer ranks say nothing about which one is odd
# the calibrated score of what a typical rank of the run exceeds on 1 cell in 200; the bar counts |z| above it
Z_FLAG = 3.5
Z_ALARM = 5.5  # where the heat map's colours turn red: alarming
TYPICAL_BLOCK = 32  # steps over which the typical cross-rank spread is taken
CALIBRATION_QUANTILE = 99.5  # the percentile of a rank's scores the calibration reads
HEATMAP_COLUMNS = 720  # at most this many step columns; longer runs are binned (max per bin)


def robust_z(values: np.ndarray, floor: np.ndarray | None = None) -> np.ndarray:
    """Robust z of each rank against the others at every step: ``(x - median) / (1.4826 MAD)``, the
    scale at least a millionth of the median's magnitude and ``floor`` (steps,). ``values`` is
    (steps, ranks), NaN for a missing rank; an infinite value scores +Inf.

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
        if floor is not None:
            scale = np.fmax(scale, np.asarray(floor, dtype=np.float64).reshape(-1, 1))
        z = (finite - med) / scale
    return np.where(np.isinf(x), np.inf, z)


def typical_spread(values: np.ndarray, block: int = TYPICAL_BLOCK) -> np.ndarray:
    """(steps,) the typical cross-rank spread (1.4826 MAD) around each step: the median of the
    per-step spreads of its block of ``block`` steps (NaN where no step of the block has one).

    >>> import numpy as np
    >>> x = np.tile([1.0, 2.0, 3.0, 4.0], (8, 1)); x[3] = [2.0, 2.0, 2.0, 9.0]  # one step's MAD is 0
    >>> typical_spread(x, block=4).round(2).tolist()
    [1.48, 1.48, 1.48, 1.48, 1.48, 1.48, 1.48, 1.48]
    """
    x = np.where(np.isfinite(values), values, np.nan)
    with quiet_nan_warnings():
        med = np.nanmedian(x, axis=1, keepdims=True)
        spread = np.nanmedian(np.abs(x - med), axis=1) * 1.4826
        pad = (-len(spread)) % block
        blocks = np.pad(spread, (0, pad), constant_values=np.nan).reshape(-1, block)
        return np.repeat(np.nanmedian(blocks, axis=1), block)[: len(spread)]


def bin_columns(score: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bin the step axis to at most :data:`HEATMAP_COLUMNS` columns, keeping each bin's worst score;
    returns (the columns, the first step of each)."""
    if len(steps) <= HEATMAP_COLUMNS:
        return score, steps
    starts = np.linspace(0, len(steps), HEATMAP_COLUMNS, endpoint=False).astype(int)
    with quiet_nan_warnings():
        binned = np.fmax.reduceat(score, starts, axis=0)
    return binned, steps[starts]


def calibration_anchor(score: np.ndarray, steps: np.ndarray) -> float:
    """The raw score a typical rank of the run exceeds on 1 heat-map cell in 200: each rank's
    :data:`CALIBRATION_QUANTILE` percentile over the columns the heat map draws, the median over
    ranks (so one faulty rank, or a minority, does not set it), never below :data:`Z_FLAG`."""
    columns, _ = bin_columns(score, steps)
    finite = np.where(np.isfinite(columns), columns, np.nan)
    with quiet_nan_warnings():
        per_rank = np.nanpercentile(finite, CALIBRATION_QUANTILE, axis=0)
        typical = float(np.nanmedian(per_rank)) if np.isfinite(per_rank).any() else Z_FLAG
    return max(Z_FLAG, typical)


class Deviation(NamedTuple):
    """How far each rank strays from the others, per step (see :func:`rank_deviation`)."""

    score: np.ndarray  # (S, R) largest |robust z| over the metrics, calibrated; +Inf: non-finite on this rank only
    metrics: list[str]  # the metrics that were available
    widespread: np.ndarray  # (S, R) bool: non-finite together with most ranks (the run broke, not the rank)
    anchor: float = Z_FLAG  # the raw |z| scored Z_FLAG (see calibration_anchor)

    @property
    def z(self) -> np.ndarray:
        """(S, R) the score before calibration: the largest |robust z| itself (the spread floored)."""
        return self.score * (self.anchor / Z_FLAG)


def rank_deviation(data: RunData) -> Deviation:
    """Per rank and step, the largest |robust z| over :data:`DEVIATION_METRICS`, calibrated on the run.
    A NaN/Inf only a minority reported scores +Inf; one most ranks reported (spread through the
    all-reduce) scores nothing and is flagged ``widespread``. NaN where the rank sent no record."""
    used = [m for m in DEVIATION_METRICS if m in data.scalars]
    present = data.present
    score = np.full(present.shape, np.nan)
    widespread = np.zeros(present.shape, dtype=bool)
    n_present = present.sum(axis=1, keepdims=True)
    for name in used:
        raw = data.scalars[name]
        nonfinite = present & ~np.isfinite(raw)
        most = nonfinite.sum(axis=1, keepdims=True) * 2 > n_present
        values = np.where(present & np.isfinite(raw), raw, np.nan)
        z = np.abs(robust_z(values, floor=typical_spread(values)))
        z = np.where(nonfinite & ~most, np.inf, z)
        score = np.fmax(score, z)
        widespread |= nonfinite & most
    score[~present] = np.nan
    widespread &= np.isnan(score)  # a rank that still stands out on another metric is scored
    anchor = calibration_anchor(score, data.steps) if used else Z_FLAG
    return Deviation(score * (Z_FLAG / anchor), used, widespread, anchor)


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
    for glob, local, labels in (
        ("loss_global", "loss", ("global loss", "loss (mean over ranks)")),
        ("grad_norm_global", "grad_norm_local", ("global gradient norm", "gradient norm (mean of local)")),
    ):  # the global value where some rank reported one, else the mean of the local ones
        if glob in data.scalars and np.any(data.present & ~np.isnan(data.scalars[glob])):
            out.append((labels[0], _mean_over_ranks(data, glob), data.scalars.get(local)))
        elif local in data.scalars:
            out.append((labels[1], _mean_over_ranks(data, local), data.scalars[local]))
    return tuple(out)
