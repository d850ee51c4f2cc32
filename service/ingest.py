"""Batched ingest: the rows of every v2 message of one (schema, run) read with one ``numpy.frombuffer``
and checked against the :class:`~sdcwatch.core.limits.RecordLimits` on whole columns; every other kind
goes through :func:`~sdcwatch.core.messages.decode_message` (docs/messages.md, "The service's ingest")."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from sdcwatch.core.columnar import MAGIC_V2, MessageHeader, check_rows, parse_header
from sdcwatch.core.control import START_MAGIC
from sdcwatch.core.errors import RecordError
from sdcwatch.core.limits import COUNTER_SCALARS, LimitError, RecordLimits, reason_of
from sdcwatch.core.messages import decode_message
from sdcwatch.core.record_layout import Schema, row_to_record
from sdcwatch.core.record_type import Record
from sdcwatch.service.auth import Authenticator

__all__ = [
    "bad_rows",
    "SchemaRegistry",
    "RecordColumns",
    "IngestDecoder",
    "Rejected",
    "count_records",
    "as_records",
]


def bad_rows(
    limits: RecordLimits, rows: np.ndarray, schema: Schema, n_hosts: np.ndarray
) -> tuple[np.ndarray, list[RecordError]]:
    """(mask of the rows past ``limits`` or malformed, the error of each, in row order): the claims
    :meth:`RecordLimits.check` bounds for a v1 record, checked on whole columns."""
    world = rows["world"]
    rank = rows["rank"]
    values = len(schema.scalars) + schema.n_layer_values
    checks = [
        (
            "world",
            "world",
            world > limits.max_world,
            lambda i: f"{world[i]} ranks claimed, the limit is {limits.max_world} (limits.max_world)",
        ),
        (
            "step_size",
            "world",
            world.astype(np.int64) * values > limits.max_step_values,
            lambda i: (
                f"{world[i]} ranks x {values} values a step, the limit is {limits.max_step_values} "
                "(limits.max_step_values)"
            ),
        ),
        ("malformed", "world", world < 1, lambda i: f"{world[i]} out of range [1, 2**32)"),
        ("malformed", "rank", rank >= world, lambda i: f"{rank[i]} out of range [0, {world[i]})"),
        ("malformed", "step", rows["step"] >= (1 << 63), lambda i: f"{rows['step'][i]} out of range [0, 2**63)"),
        (
            "malformed",
            "host",
            rows["host"] >= n_hosts,
            lambda i: f"index {rows['host'][i]} beyond the message's {n_hosts[i]} hosts",
        ),
        (
            "malformed",
            "time",
            ~np.isfinite(rows["time"]),
            lambda i: f"must be a finite number, got {rows['time'][i]!r}",
        ),
    ]
    if schema.coords:
        top = rows["coords"].max(axis=1)
        checks.append(
            (
                "malformed",
                "coords",
                top >= world,
                lambda i: f"{top[i]} out of range [0, {world[i]}): no mesh dim outnumbers the ranks",
            )
        )
    sc = rows["scalars"]
    for name in COUNTER_SCALARS:
        if name in schema.scalars:
            col = sc[:, schema.scalars.index(name)]
            with np.errstate(invalid="ignore"):
                bad = ~((col >= 0.0) & (col <= limits.max_counter))  # NaN fails both comparisons
            checks.append(
                (
                    "counter",
                    f"scalars.{name}",
                    bad,
                    lambda i, col=col: (
                        f"a counter must be finite, >= 0 and <= {limits.max_counter:g}, got {float(col[i])!r}"
                    ),
                )
            )
    mask = np.zeros(len(rows), bool)
    for _, _, bad, _ in checks:
        mask |= bad
    errors: list[RecordError] = []
    for i in np.flatnonzero(mask):
        for code, field, bad, why in checks:
            if bad[i]:
                errors.append(RecordError(field, why(i)) if code == "malformed" else LimitError(field, why(i), code))
                break
    return mask, errors


class SchemaRegistry:
    """The layouts this service has learnt, per run: at most ``per_run`` a run (its oldest forgotten
    first) and ``max_schemas`` in all, past which the least recently used run that ``holds`` (the
    pipeline's runs) does not claim is forgotten whole (docs/service.md, "Run lifecycle")."""

    def __init__(
        self,
        limits: RecordLimits | None = None,
        max_schemas: int = 1024,
        *,
        per_run: int = 64,
        holds: Callable[[str], bool] | None = None,
    ) -> None:
        self.limits = limits if limits is not None else RecordLimits()
        self.max_schemas = max_schemas
        self.per_run = per_run
        self.holds = holds
        self._runs: dict[str, dict[int, Schema]] = {}  # run -> its layouts, least recently used run first
        self._count = 0
        self.forgotten = 0  # layouts forgotten to keep the bounds

    def get(self, schema_id: int, run: str) -> Schema | None:
        """The layout ``schema_id`` of ``run`` (None if not learnt); the run counts as used."""
        layouts = self._runs.get(run)
        sch = layouts.get(schema_id) if layouts is not None else None
        if sch is not None:
            self._runs[run] = self._runs.pop(run)  # most recently used last
        return sch

    def learn(self, schema_id: int, text: bytes, run: str) -> Schema:
        """Check and remember a schema ``run`` sent inline; raises RecordError when it is bad or its id is wrong."""
        layouts = self._runs.get(run)
        known = layouts.get(schema_id) if layouts is not None else None
        if known is not None and known.text == text:
            self._runs[run] = self._runs.pop(run)
            return known
        sch = Schema.from_text(text)
        if sch.id != schema_id:
            raise RecordError(
                "schema id", f"{schema_id:#018x} is not the hash of the schema sent with it ({sch.id:#018x})"
            )
        self.limits.check_shape(sch.layers, len(sch.scalars))
        self._add(run, sch)
        return sch

    def _add(self, run: str, sch: Schema) -> None:
        layouts = self._runs.pop(run, None)
        if layouts is None:
            layouts = {}
        elif sch.id in layouts:
            self._count -= 1
            del layouts[sch.id]
        elif len(layouts) >= self.per_run:
            del layouts[next(iter(layouts))]  # the run's oldest layout
            self._count -= 1
            self.forgotten += 1
        self._runs[run] = layouts
        layouts[sch.id] = sch
        self._count += 1
        self._trim(run)

    def _trim(self, keep: str) -> None:
        """Forget the least recently used runs not held until at most ``max_schemas`` layouts remain."""
        holds = self.holds
        for _ in range(len(self._runs)):  # each run looked at once at most
            if self._count <= self.max_schemas:
                return
            run = next(iter(self._runs))
            layouts = self._runs.pop(run)
            if run == keep or (holds is not None and holds(run)):
                self._runs[run] = layouts  # held: looked at again only after the others
                continue
            self._count -= len(layouts)
            self.forgotten += len(layouts)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, group: tuple[int, str]) -> bool:
        """Whether ``(schema_id, run)`` (a header's ``group``) is known."""
        schema_id, run = group
        layouts = self._runs.get(run)
        return layouts is not None and schema_id in layouts

    def runs(self) -> int:
        """Runs with layouts learnt."""
        return len(self._runs)

    def snapshot(self) -> dict[str, Any]:
        """Every run's layouts (JSON-safe): ``{"runs": {run: [schema text, ...]}}``."""
        return {
            "runs": {
                run: [s.text.decode() for s in list(layouts.values())] for run, layouts in list(self._runs.items())
            }
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take back a :meth:`snapshot`. Raises ValueError for any other shape, RecordError for a bad schema."""
        runs = state.get("runs") if isinstance(state, dict) else None
        if not isinstance(runs, dict):
            raise ValueError("saved schemas: expected {'runs': {run: [schema text, ...]}}")
        for run, texts in runs.items():
            if not isinstance(run, str) or not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ValueError(f"saved schemas of run {run!r}: expected a list of schema texts")
            for t in texts:
                self._add(run, Schema.from_text(t.encode()))


class RecordColumns:
    """Records of one run and one schema as columns: ``rows`` is a structured array (``Schema.dtype``),
    ``hosts`` the host table of their messages, ``host`` each row's index into it."""

    __slots__ = ("run", "schema", "rows", "hosts", "host")

    def __init__(self, run: str, schema: Schema, rows: np.ndarray, hosts: np.ndarray, host: np.ndarray) -> None:
        self.run, self.schema, self.rows, self.hosts, self.host = run, schema, rows, hosts, host

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, idx: np.ndarray | slice) -> "RecordColumns":
        return RecordColumns(self.run, self.schema, self.rows[idx], self.hosts, self.host[idx])

    def to_records(self, idx: Sequence[int] | np.ndarray | None = None) -> list[Record]:
        """Expand to :class:`Record` objects (state snapshots, JSON capture, tests)."""
        rows = self.rows if idx is None else self.rows[idx]
        host = self.host if idx is None else self.host[idx]
        st = self.schema.struct
        out = []
        for vals, h in zip(st.iter_unpack(np.ascontiguousarray(rows).tobytes()), host.tolist()):
            vals = list(vals)
            vals[4] = 0  # the host index, here into a one-entry table
            out.append(row_to_record(self.schema, self.run, (str(self.hosts[h]),), vals))
        return out


def count_records(items: Sequence[Any]) -> int:
    """Records in a list of decoded items (records and column blocks; layer names and checkpoint notes are none)."""
    return sum(len(x) if isinstance(x, RecordColumns) else isinstance(x, Record) for x in items)


def as_records(items: Iterable[Any]) -> list[Record]:
    """Every item as :class:`Record` objects (column blocks expanded)."""
    out: list[Record] = []
    for x in items:
        if isinstance(x, RecordColumns):
            out.extend(x.to_records())
        elif isinstance(x, Record):
            out.append(x)
    return out


@dataclass(frozen=True)
class Rejected:
    """A message the decoder could not use, and why (the source dead-letters it)."""

    origin: str
    key: bytes | None
    value: bytes | None
    reason: str
    code: str = "malformed"  # the dead-letter reason code (one of DEAD_LETTER_REASONS)


def _rejected(origin: str, key: bytes | None, value: bytes | None, exc: RecordError, prefix: str = "") -> Rejected:
    return Rejected(origin, key, value, prefix + str(exc), reason_of(exc))


class IngestDecoder:
    """Decodes batches of bus messages (v1 and v2 mixed) into records and :class:`RecordColumns`."""

    def __init__(
        self,
        registry: SchemaRegistry | None = None,
        *,
        auth: Authenticator | None = None,
        schema_wait: float = 2.0,
        max_pending_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else SchemaRegistry()
        self.auth = auth  # verifies signed messages first (None: no keys, every message is read)
        self.limits = self.registry.limits
        self.schema_wait = schema_wait
        self.max_pending_bytes = max_pending_bytes
        self.clock = clock
        self._pending: deque[tuple[str, bytes | None, bytes, MessageHeader, float]] = deque()  # (..., since)
        self._pending_bytes = 0
        self._names: dict = {}  # layer-names payloads checked before (decode_names' cache)

    @property
    def pending(self) -> int:
        """Messages waiting for their schema."""
        return len(self._pending)

    def decode(self, messages: Iterable[tuple[str, bytes | None, Any]]) -> tuple[list, list[Rejected]]:
        """``(origin, key, value)`` messages -> (records and column blocks, rejected messages)."""
        items: list = []
        rejected: list[Rejected] = []
        v2: list[tuple[str, bytes | None, bytes, MessageHeader]] = []
        unsigned: list[tuple[int, int, int]] = []  # each unsigned message: (first item, past its last, v2 index)
        for origin, key, value in messages:
            if value is None:
                rejected.append(Rejected(origin, key, value, "empty message (null value)", "empty"))
                continue
            if not isinstance(value, bytes):
                value = bytes(value)
            at = len(items)
            try:
                message, head, signed = self._read(value, items, origin)
            except RecordError as exc:
                rejected.append(_rejected(origin, key, value, exc))
                continue
            if head is not None:
                v2.append((origin, key, message, head))
            if not signed and self.auth is not None:
                unsigned.append((at, len(items), len(v2) - 1 if head is not None else -1))
        if unsigned and self.auth.rebound:
            items, v2 = self._drop_unsigned(items, v2, unsigned, set(self.auth.rebound))
        now = self.clock()
        ready: dict[tuple[int, str], list] = {}
        waiting, self._pending, self._pending_bytes = self._pending, deque(), 0
        for m in [*waiting, *((*m, now) for m in v2)]:
            origin, key, value, head, since = m
            if head.group in self.registry:
                ready.setdefault(head.group, []).append(m)
            elif now - since >= self.schema_wait or self._pending_bytes + len(value) > self.max_pending_bytes:
                why = (
                    f"unknown schema {head.schema_id:#018x}: no message carrying it arrived within "
                    f"{self.schema_wait:g} s (or the wait buffer of {self.max_pending_bytes} bytes is full)"
                )
                rejected.append(_rejected(origin, key, value, LimitError("schema id", why, "unknown_schema")))
            else:
                self._pending.append(m)
                self._pending_bytes += len(value)
        for (schema_id, run), msgs in ready.items():
            cols = self._columns(self.registry.get(schema_id, run), run, msgs, rejected)
            if cols is not None:
                items.append(cols)
        return items, rejected

    @staticmethod
    def _drop_unsigned(
        items: list, v2: list, unsigned: list[tuple[int, int, int]], runs: set[str]
    ) -> tuple[list, list]:
        """``items`` and ``v2`` without what the ``unsigned`` messages said for ``runs``: runs bound to
        a key in this batch, whose unsigned records must not stand (``Authenticator.rebound``)."""
        drop_items = {k for i, end, _ in unsigned for k in range(i, end) if getattr(items[k], "run", None) in runs}
        drop_v2 = {j for _, _, j in unsigned if j >= 0 and v2[j][3].run in runs}
        return (
            [x for k, x in enumerate(items) if k not in drop_items],
            [m for k, m in enumerate(v2) if k not in drop_v2],
        )

    def _read(self, value: bytes, items: list, origin: str = "") -> tuple[bytes, MessageHeader | None, bool]:
        """One message, its signature checked first: decoded into ``items``, or for a v2 message its
        header alone (its rows are read with the others of its schema and run). Returns (the message
        without its envelope, the v2 header or None, whether it was signed); RecordError for a message
        to dead-letter."""
        auth, kid = self.auth, None
        if auth is not None:  # the signature first: nothing unverified reaches a decoder
            value, kid = auth.open(value, origin)
        if value[:4] != MAGIC_V2:
            if value[:4] == START_MAGIC:  # a guard's start: the nonce its run's decisions carry
                if auth is not None:
                    auth.note_start(value, kid)
                return value, None, kid is not None
            got = decode_message(value, self.limits, names_cache=self._names)
            if auth is not None:
                auth.bind({m.run for m in got}, kid)
            items.extend(got)
            return value, None, kid is not None
        if len(value) > self.limits.max_message_bytes:
            raise LimitError(
                "message",
                f"{len(value)} bytes, the limit is {self.limits.max_message_bytes} (limits.max_message_bytes)",
                "oversize",
            )
        head = parse_header(value)
        if auth is not None:
            auth.bind((head.run,), kid)
        if head.schema_text is not None:
            self.registry.learn(head.schema_id, head.schema_text, head.run)
        return value, head, kid is not None

    def expire(self) -> list[Rejected]:
        """Give up on messages whose schema did not come in time (call when idle)."""
        return self.decode(())[1] if self._pending else []

    def _columns(self, schema: Schema, run: str, msgs: list, rejected: list[Rejected]) -> RecordColumns | None:
        size = schema.row_size
        good = [m for m in msgs if len(m[2]) - m[3].rows_at == m[3].count * size]
        if len(good) < len(msgs):
            for origin, key, value, head, *_ in msgs:
                try:
                    check_rows(len(value) - head.rows_at, head, schema)
                except RecordError as exc:
                    rejected.append(_rejected(origin, key, value, exc))
        if not good:
            return None
        if len(good) == 1:
            origin, key, value, head = good[0][:4]
            rows = np.frombuffer(value, schema.dtype, offset=head.rows_at)
        else:
            rows = np.frombuffer(b"".join([memoryview(m[2])[m[3].rows_at :] for m in good]), schema.dtype)
        heads = [m[3] for m in good]
        counts = np.fromiter([h.count for h in heads], np.int64, len(heads))
        tables = [h.hosts for h in heads]
        n_hosts = np.repeat(np.fromiter(map(len, tables), np.int64, len(tables)), counts)
        bad, errors = bad_rows(self.limits, rows, schema, n_hosts)
        if bad.any():
            starts = np.cumsum(counts) - counts
            msg_of = np.searchsorted(starts, np.flatnonzero(bad), side="right") - 1
            bad_msgs: dict[int, tuple[int, RecordError]] = {}
            for m, exc, row in zip(msg_of.tolist(), errors, np.flatnonzero(bad).tolist()):
                bad_msgs.setdefault(m, (row - int(starts[m]), exc))
            for m, (row, exc) in bad_msgs.items():
                origin, key, value = good[m][:3]
                rejected.append(_rejected(origin, key, value, exc, prefix=f"record {row}: "))
            keep_msg = np.ones(len(good), bool)
            keep_msg[list(bad_msgs)] = False
            keep = np.repeat(keep_msg, counts)
            rows = rows[keep]
            counts = counts[keep_msg]
            tables = [t for t, k in zip(tables, keep_msg) if k]
            if not len(rows):
                return None
        start_of: dict[int, int] = {}  # one copy of each distinct host table (the tuples are shared)
        names: list[str] = []
        starts = []
        for t in tables:
            o = start_of.get(id(t))
            if o is None:
                o = start_of[id(t)] = len(names)
                names.extend(t)
            starts.append(o)
        host = rows["host"].astype(np.int64) + np.repeat(np.fromiter(starts, np.int64, len(starts)), counts)
        hosts = np.array(names or [""], dtype=object)
        return RecordColumns(run, schema, rows, hosts, host)
