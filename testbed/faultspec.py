"""Fault specs: what a silent-data-corruption fault is, parsed and checked (the injector that applies
them is :mod:`sdcwatch.testbed.faults`).

A fault is one JSON object (one per line in a file, or a list in a JSON array)::

    {"kind": "bitflip"|"nan"|"inf"|"near_inf"|"scale"|"noise"|"lr_spike"|"bad_batch",
     "rank": int|null, "step": int, "duration": int, "target": "blocks.1.attn.*",
     "where": "output"|"grad", "bit": int, "magnitude": float, "seed": int}

It is both the test instrument of sdcwatch and a feature: users inject faults into their own run
to check their alerting. What each kind does at a matched module, on the fault's rank and steps:

* ``bitflip``: flips bit ``bit`` of exactly one element (chosen by ``seed``) of the output (or of
  one parameter's gradient, ``where: "grad"``), once per step;
* ``nan`` / ``inf`` / ``near_inf``: sets exactly one element to NaN, +Inf or ``magnitude``
  (default 1e10, the ATTNChecker near-INF threshold);
* ``scale``: multiplies the whole tensor by ``magnitude``;
* ``noise``: adds Gaussian noise of standard deviation ``magnitude`` times the tensor's RMS
  (a chronically unhealthy unit: magnitudes of 1e-3..1e-2 are realistic);
* ``lr_spike``: multiplies the rank's optimizer learning rate by ``magnitude``;
* ``bad_batch``: replaces the rank's batch by garbage tokens.

``where: "grad"`` hits the gradient of the matched modules' own parameters as this rank computes
it, before any all-reduce. As an extension, ``where: "param"`` changes a parameter of the rank's
replica once, at ``step`` (a memory bit flip): replicas then disagree, which the fingerprints show.
Every random choice derives from ``(seed, step, rank)``: a fault is deterministic, and touches
nothing outside its rank, steps and target.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sdcwatch.core.errors import FaultSpecError

__all__ = ["FaultSpec", "KINDS", "TENSOR_KINDS", "ELEMENT_KINDS", "WHERE", "NEAR_INF", "parse_faults", "load_faults"]

#: Fault kinds.
KINDS = ("bitflip", "nan", "inf", "near_inf", "scale", "noise", "lr_spike", "bad_batch")
#: Kinds that touch a tensor of a module (the others touch the optimizer or the data).
TENSOR_KINDS = ("bitflip", "nan", "inf", "near_inf", "scale", "noise")
#: Kinds that change exactly one element.
ELEMENT_KINDS = ("bitflip", "nan", "inf", "near_inf")
WHERE = ("output", "grad", "param")
NEAR_INF = 1e10
_KEYS = ("kind", "rank", "step", "duration", "target", "where", "bit", "magnitude", "seed")


def _int(d: dict, key: str, where: str, *, lo: int | None = 0, default: Any = ...) -> Any:
    if key not in d or d[key] is None and default is None:
        if default is ...:
            raise FaultSpecError(key, "is required", where=where)
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise FaultSpecError(key, f"must be an integer, got {v!r}", where=where)
    if lo is not None and v < lo:
        raise FaultSpecError(key, f"must be >= {lo}, got {v}", where=where)
    return v


@dataclass(frozen=True)
class FaultSpec:
    """One validated fault. Build from JSON with :meth:`from_dict` or :func:`parse_faults`."""

    kind: str
    step: int
    rank: int | None = None
    """Rank to hit; ``None`` hits every rank."""
    duration: int = 1
    """Number of steps from ``step``; 0 means to the end of the run."""
    target: str = "*"
    """Glob over ``model.named_modules()`` names, e.g. ``"blocks.1.attn.*"``."""
    where: str = "output"
    bit: int | None = None
    magnitude: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _validate(self, "")

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "") -> "FaultSpec":
        """Validate a decoded JSON object; FaultSpecError names the bad key (and ``where``)."""
        if not isinstance(d, dict):
            raise FaultSpecError("fault", f"must be a JSON object, got {type(d).__name__}", where=where)
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            raise FaultSpecError(unknown[0], f"unknown key (known: {', '.join(_KEYS)})", where=where)
        kind = d.get("kind")
        if kind not in KINDS:
            raise FaultSpecError("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}", where=where)
        step = _int(d, "step", where)
        rank = _int(d, "rank", where, default=None)
        duration = _int(d, "duration", where, default=1)
        seed = _int(d, "seed", where, lo=None, default=0)
        bit = _int(d, "bit", where, default=None)
        target = d.get("target", "*" if kind in ("lr_spike", "bad_batch") else None)
        if kind in TENSOR_KINDS and target is None:
            raise FaultSpecError("target", f"is required for kind {kind!r} (a module-name glob)", where=where)
        if not isinstance(target, str) or not target:
            raise FaultSpecError("target", f"must be a non-empty module-name glob, got {target!r}", where=where)
        wh = d.get("where", "output")
        magnitude = d.get("magnitude")
        if magnitude is not None and (isinstance(magnitude, bool) or not isinstance(magnitude, (int, float))):
            raise FaultSpecError("magnitude", f"must be a number, got {magnitude!r}", where=where)
        spec = object.__new__(cls)
        for k, v in dict(
            kind=kind,
            step=step,
            rank=rank,
            duration=duration,
            target=target,
            where=wh,
            bit=bit,
            magnitude=None if magnitude is None else float(magnitude),
            seed=seed,
        ).items():
            object.__setattr__(spec, k, v)
        _validate(spec, where)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """The JSON object form (round-trips through :meth:`from_dict`)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k == "rank"}

    def hits(self, step: int, rank: int) -> bool:
        """Whether this fault is active on ``rank`` at ``step``."""
        if self.rank is not None and rank != self.rank:
            return False
        if step < self.step:
            return False
        return self.duration == 0 or step < self.step + self.duration

    @property
    def value(self) -> float:
        """The value a nan/inf/near_inf fault writes."""
        if self.kind == "nan":
            return math.nan
        if self.kind == "inf":
            return math.inf
        return NEAR_INF if self.magnitude is None else self.magnitude


def _validate(s: FaultSpec, where: str) -> None:
    if s.kind not in KINDS:
        raise FaultSpecError("kind", f"must be one of {', '.join(KINDS)}, got {s.kind!r}", where=where)
    for key in ("step", "duration"):
        v = getattr(s, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FaultSpecError(key, f"must be an integer >= 0, got {v!r}", where=where)
    if s.rank is not None and (isinstance(s.rank, bool) or not isinstance(s.rank, int) or s.rank < 0):
        raise FaultSpecError("rank", f"must be null or an integer >= 0, got {s.rank!r}", where=where)
    if s.where not in WHERE:
        raise FaultSpecError("where", f"must be one of {', '.join(WHERE)}, got {s.where!r}", where=where)
    if s.kind in ("lr_spike", "bad_batch") and s.where != "output":
        raise FaultSpecError("where", f"does not apply to kind {s.kind!r}", where=where)
    if s.kind == "bitflip":
        if s.bit is None:
            raise FaultSpecError("bit", "is required for kind 'bitflip' (0..31 for float32)", where=where)
        if not 0 <= s.bit <= 63:
            raise FaultSpecError("bit", f"must be in 0..63, got {s.bit}", where=where)
    elif s.bit is not None:
        raise FaultSpecError("bit", f"only applies to kind 'bitflip', not {s.kind!r}", where=where)
    m = s.magnitude
    if m is not None and not math.isfinite(m):
        raise FaultSpecError("magnitude", f"must be finite, got {m!r}", where=where)
    if s.kind in ("scale", "noise", "lr_spike") and m is None:
        raise FaultSpecError("magnitude", f"is required for kind {s.kind!r}", where=where)
    if s.kind == "noise" and m is not None and m <= 0:
        raise FaultSpecError("magnitude", f"noise needs a relative size > 0, got {m}", where=where)
    if s.kind == "lr_spike" and m is not None and m <= 0:
        raise FaultSpecError("magnitude", f"lr_spike needs a factor > 0, got {m}", where=where)
    if s.kind in ("bitflip", "nan", "inf") and m is not None:
        raise FaultSpecError("magnitude", f"does not apply to kind {s.kind!r}", where=where)
    if s.where == "param" and s.duration != 1:
        raise FaultSpecError(
            "duration", "a 'param' fault is one change at 'step' (it persists by itself): use 1", where=where
        )


def parse_faults(text: str, *, source: str = "<faults>") -> list[FaultSpec]:
    """Parse a JSON array of faults, or JSON lines with one fault each (blank lines ignored).

    Errors raise FaultSpecError whose message starts with ``source:line`` (JSONL) or
    ``source[index]`` (array) and names the key.
    """
    if not isinstance(text, str):
        raise FaultSpecError("faults", f"expected text, got {type(text).__name__}", where=source)
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise FaultSpecError("json", f"not valid JSON: {exc}", where=source) from None
        return [FaultSpec.from_dict(d, where=f"{source}[{i}]") for i, d in enumerate(items)]
    specs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as exc:
            raise FaultSpecError("json", f"not valid JSON: {exc}", where=f"{source}:{lineno}") from None
        specs.append(FaultSpec.from_dict(d, where=f"{source}:{lineno}"))
    return specs


def load_faults(path: str | Path) -> list[FaultSpec]:
    """Read faults from a ``.json`` (array) or ``.jsonl`` file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise FaultSpecError("path", f"cannot read: {exc}", where=str(p)) from None
    return parse_faults(text, source=str(p))
