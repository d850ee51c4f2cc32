"""Step summaries: what the spatial stage learns of one aligned step, for the temporal stage, and
their order. The wire form (prefix ``SDCY``): docs/messages.md, "Step summaries"; a bad message
raises :class:`SummaryError`, which the source dead-letters.
"""

from __future__ import annotations

import base64
import heapq
import json
import math
import struct
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from sdcwatch.core.errors import SummaryError
from sdcwatch.core.messages import SUMMARY_MAGIC
from sdcwatch.core.validate import check_positive

__all__ = ["StepSummary", "SummaryOrder", "encode_summary", "decode_summary", "SUMMARY_VERSION"]

SUMMARY_VERSION = 1
_HEAD = struct.Struct(">I")
_MAX_HELD = 256  # a run's summaries held for an earlier step at most: past it the earliest goes on


@dataclass
class StepSummary:
    """One run's step as the temporal stage sees it; ``hosts`` and ``coords`` are sent when they
    changed (None: the temporal stage keeps the last ones)."""

    run: str
    step: int
    world: int
    n_present: int
    complete: bool = True
    hosts: tuple[str, ...] | None = None  # the run's host table (index = rank)
    dropped: dict[int, float] = field(default_factory=dict)  # rank -> records its emitter dropped
    # cross-rank quantiles for the exporter, every few steps (detectors.frame.frame_stats)
    stats: dict[str, Any] | None = None
    observations: dict[str, Any] = field(default_factory=dict)  # detector name -> what its observe returned
    frame: Any = None  # the aligned step itself when both stages run in one process (never sent)
    ended: bool = False  # the run's end (every rank's marker), after its last steps; ``step`` is the last
    coords: np.ndarray | None = None  # (world, mesh dims) coordinate table
    names: dict[str, Any] | None = None  # layer names, ``{world, tables, ranks}`` (LayerNameBook.stamp)

    @classmethod
    def end_of(cls, run: str, last_step: int, world: int) -> "StepSummary":
        """The summary that tells the temporal stage ``run`` ended (after its last steps' summaries)."""
        return cls(run=run, step=max(last_step, 0), world=max(world, 1), n_present=0, complete=False, ended=True)


# -- codec ---------------------------------------------------------------------------------------


def _pack(obj: Any, blobs: list[bytes]) -> Any:
    """JSON-ready copy of ``obj`` with numpy arrays moved to ``blobs`` and floats kept exact."""
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        blobs.append(a.tobytes())
        return {"__nd__": len(blobs) - 1, "dtype": a.dtype.str, "shape": list(a.shape)}
    if isinstance(obj, dict):
        return (
            {"__map__": [[_pack(k, blobs), _pack(v, blobs)] for k, v in obj.items()]}
            if any(not isinstance(k, str) for k in obj)
            else {k: _pack(v, blobs) for k, v in obj.items()}
        )
    if isinstance(obj, (list, tuple)):
        return [_pack(v, blobs) for v in obj]
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else {"__f__": repr(f)}
    return obj


def _check_stats(stats: Any) -> None:
    """``stats`` is None or ``frame_stats``'s form (a forged shape is dead-lettered here, not met later)."""
    if stats is None:
        return

    def arrays(x: Any) -> bool:
        return isinstance(x, dict) and all(isinstance(v, np.ndarray) for v in x.values())

    pieces = stats.get("pieces") if isinstance(stats, dict) else None
    ok = isinstance(stats, dict) and arrays(stats.get("scalars")) and arrays(stats.get("layers"))
    if ok and pieces is not None:
        ok = (
            isinstance(pieces, dict)
            and isinstance(pieces.get("names"), list)
            and arrays(pieces.get("scalars"))
            and arrays(pieces.get("layers"))
            and isinstance(pieces.get("n_layers"), np.ndarray)
            and isinstance(pieces.get("omitted"), int)
        )
    if not ok:
        raise SummaryError("stats", "must hold scalars and layers statistics (and a pieces object) as arrays")


class _Arrays:
    """The array bytes after a summary's head, read in the order their references come (0, 1, ...)."""

    def __init__(self, raw: bytes, pos: int) -> None:
        self.raw, self.pos, self.n = raw, pos, 0

    def read(self, spec: dict[str, Any]) -> np.ndarray:
        if spec["__nd__"] != self.n:
            raise SummaryError("arrays", "array references are not 0..n-1")
        dtype = np.dtype(spec["dtype"])
        count = int(np.prod(spec["shape"], dtype=np.int64))
        size = count * dtype.itemsize
        if self.pos + size > len(self.raw):
            raise SummaryError("arrays", f"array {self.n} needs {size} bytes, {len(self.raw) - self.pos} left")
        out = np.frombuffer(self.raw, dtype, count, self.pos).reshape(spec["shape"]).copy()
        self.pos, self.n = self.pos + size, self.n + 1
        return out

    def unpack(self, obj: Any) -> Any:
        """The inverse of :func:`_pack`, in its order."""
        if isinstance(obj, dict):
            if "__nd__" in obj:
                return self.read(obj)
            if "__f__" in obj:
                return float(obj["__f__"])
            if "__map__" in obj:
                return {self.unpack(k): self.unpack(v) for k, v in obj["__map__"]}
            return {k: self.unpack(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.unpack(v) for v in obj]
        return obj


def encode_summary(s: StepSummary) -> bytes:
    """One bus message for ``s`` (its ``frame`` stays behind)."""
    blobs: list[bytes] = []
    head = {
        "run": s.run,
        "step": s.step,
        "world": s.world,
        "n_present": s.n_present,
        "complete": s.complete,
        "hosts": None if s.hosts is None else list(s.hosts),
        "dropped": _pack(s.dropped, blobs),
        "stats": _pack(s.stats, blobs),
        "observations": _pack(s.observations, blobs),
    }
    if s.ended:
        head["ended"] = True
    if s.coords is not None:
        head["coords"] = _pack(np.asarray(s.coords, dtype=np.int32), blobs)
    if s.names is not None:  # checked again by the temporal stage's book, like a names message
        head["names"] = s.names
    j = json.dumps(head, separators=(",", ":"), allow_nan=False).encode("utf-8")
    body = zlib.compress(b"".join([_HEAD.pack(len(j)), j, *blobs]), 1)
    return SUMMARY_MAGIC + bytes([SUMMARY_VERSION]) + body


def decode_summary(data: bytes | bytearray | memoryview) -> StepSummary:
    """Inverse of :func:`encode_summary`; raises SummaryError naming what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SummaryError("summary", f"expected bytes, got {type(data).__name__}")
    buf = bytes(data)
    if buf[:4] != SUMMARY_MAGIC:
        raise SummaryError("magic", f"not an sdcwatch step summary (starts with {buf[:4]!r})")
    if len(buf) < 5 or buf[4] != SUMMARY_VERSION:
        raise SummaryError("version", f"unknown step-summary version {buf[4] if len(buf) > 4 else None!r}")
    try:
        raw = zlib.decompress(buf[5:])
    except zlib.error as exc:
        raise SummaryError("body", f"not zlib data: {exc}") from None
    if len(raw) < 4:
        raise SummaryError("head", "truncated")
    (n,) = _HEAD.unpack_from(raw)
    try:
        head = json.loads(raw[4 : 4 + n])
    except ValueError as exc:
        raise SummaryError("head", f"not JSON: {exc}") from None
    try:
        arrays = _Arrays(raw, 4 + n)
        s = StepSummary(
            run=str(head["run"]),
            step=int(head["step"]),
            world=int(head["world"]),
            n_present=int(head["n_present"]),
            complete=bool(head["complete"]),
            hosts=None if head["hosts"] is None else tuple(str(h) for h in head["hosts"]),
            dropped={int(k): float(v) for k, v in arrays.unpack(head["dropped"]).items()},
            stats=arrays.unpack(head["stats"]),
            observations=arrays.unpack(head["observations"]),
            ended=head.get("ended") is True,
            names=head.get("names"),
        )
        if s.names is not None and not isinstance(s.names, dict):
            raise SummaryError("names", f"must be an object, got {type(s.names).__name__}")
        _check_stats(s.stats)
        if head.get("coords") is not None:
            coords = arrays.unpack(head["coords"])
            if not isinstance(coords, np.ndarray) or coords.ndim != 2 or coords.shape[0] != s.world:
                raise SummaryError("coords", f"must be a (world, dims) array for world {s.world}")
            s.coords = coords.astype(np.int64)
        if arrays.pos != len(raw):
            raise SummaryError("arrays", f"{len(raw) - arrays.pos} trailing bytes")
    except SummaryError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SummaryError("head", f"malformed: {type(exc).__name__}: {exc}") from None
    if s.world < 1 or s.step < 0 or not s.run:
        raise SummaryError("head", f"bad identity: run={s.run!r} step={s.step} world={s.world}")
    return s


# -- ordering ------------------------------------------------------------------------------------


@dataclass
class _Held:
    heap: list = field(default_factory=list)  # (step, arrival, seq, summary)
    steps: set = field(default_factory=set)
    last: int | None = None  # last step released
    gaps: deque = field(default_factory=lambda: deque(maxlen=8))  # between recent released steps

    @property
    def stride(self) -> int:
        """The run's usual distance between steps (a run logging every N steps has N): the smallest recent gap."""
        return min(self.gaps) if self.gaps else 1


class SummaryOrder:
    """Puts each run's summaries back in step order (several spatial instances publish them).

    A summary is released when it follows the last released step by the run's usual stride, after
    ``grace`` seconds, or when more than 256 of its run wait. Late summaries (a step already released)
    and redelivered ones are counted and dropped.
    """

    def __init__(self, grace: float = 2.0, *, clock: Callable[[], float] = time.monotonic):
        check_positive("order", grace=grace)
        self.grace, self.clock = float(grace), clock
        self._runs: dict[str, _Held] = {}
        self._seq = 0
        self.late = 0
        self.duplicates = 0

    def add(self, summaries: list[StepSummary]) -> list[StepSummary]:
        now = self.clock()
        for s in summaries:
            h = self._runs.setdefault(s.run, _Held())
            if h.last is not None and s.step <= h.last:
                self.late += 1
                continue
            if s.step in h.steps:
                self.duplicates += 1
                continue
            h.steps.add(s.step)
            self._seq += 1
            heapq.heappush(h.heap, (s.step, now, self._seq, s))
        return self.poll(now)

    def poll(self, now: float | None = None) -> list[StepSummary]:
        """Summaries ready to go, in step order per run."""
        now = self.clock() if now is None else now
        out: list[StepSummary] = []
        for h in self._runs.values():
            while h.heap:
                step, arrived, _, s = h.heap[0]
                in_order = h.last is not None and step - h.last <= h.stride
                if not (in_order or now - arrived >= self.grace or len(h.heap) > _MAX_HELD):
                    break
                heapq.heappop(h.heap)
                h.steps.discard(step)
                if h.last is not None:
                    h.gaps.append(step - h.last)
                h.last = step
                out.append(s)
        return out

    def flush(self) -> list[StepSummary]:
        """Everything held, in step order (end of input)."""
        return self.poll(now=math.inf)

    def forget(self, run: str) -> None:
        """Drop ``run`` and what it holds (the run was evicted)."""
        self._runs.pop(run, None)

    def held(self, run: str) -> int:
        """Summaries of ``run`` waiting for earlier steps."""
        h = self._runs.get(run)
        return 0 if h is None else len(h.heap)

    def snapshot(self) -> dict[str, Any]:
        """Per run: the last step released, the stride, and the summaries still waiting (encoded)."""
        return {
            run: {
                "last": h.last,
                "stride": h.stride,
                "held": [base64.b64encode(encode_summary(item[3])).decode("ascii") for item in sorted(h.heap)],
            }
            for run, h in self._runs.items()
        }

    def restore(self, state: dict[str, Any]) -> None:
        self._runs = {run: _Held(last=d["last"], gaps=deque([int(d["stride"])], maxlen=8)) for run, d in state.items()}
        now = self.clock()
        for run, d in state.items():
            h = self._runs[run]
            for blob in d.get("held", []):
                s = decode_summary(base64.b64decode(blob))
                self._seq += 1
                h.steps.add(s.step)
                heapq.heappush(h.heap, (s.step, now, self._seq, s))
