"""The emitter: the training loop's only contact with sdcwatch.

``emit()`` appends a tuple to a bounded queue and returns; a background thread builds records,
batches them and hands them to a transport. The training loop is never blocked and never sees an
exception: when the bus is down the sender keeps draining the queue into a spool of packed bytes
(:class:`RecordSpool`: a few Python objects however many records, so a collection pass never walks
them) up to ``buffer`` records; further records are dropped and counted (``dropped``, and as the
``emitter_dropped`` scalar in every later record), a single log line says so, and sending resumes
by itself, oldest first, when the bus is back. ``close()`` ends the rank's part of the run with an
end-of-run marker (:mod:`sdcwatch.telemetry.wire.end_marker`).

With a job key (``key=``, or ``SDCWATCH_KEY_FILE`` / ``SDCWATCH_KEY``: :mod:`sdcwatch.core.signing`)
the transport signs every message it sends, on the sender thread (the end-of-run marker in
``close()``): ``emit()`` does no more work.

``checkpoint(step, path)`` tells the service the job saved a checkpoint: a small message of its own
(:mod:`sdcwatch.core.checkpoints`) under the records' partition key, queued like a record and sent by
the same thread; it never raises or blocks either.

The sender packs each record in wire format v2 by default (one ``struct.pack`` of a fixed layout,
``sdcwatch.core.columnar``); ``wire="v1"`` (or ``SDCWATCH_WIRE=v1``) sends version 1 records
for services that predate v2. The end-of-run marker travels as a version 1 record either way.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import struct
import threading
import time as _time
from typing import Any, Mapping, Sequence

from sdcwatch.core.checkpoints import NoteOutbox
from sdcwatch.core.columnar import WIRES
from sdcwatch.core.errors import ConfigError, RecordError, TransportError
from sdcwatch.core.layer_names import NamesOutbox
from sdcwatch.core.mesh import check_coords
from sdcwatch.core.record import decode_message, encode
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.record_type import Record, validate
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC
from sdcwatch.telemetry.wire.identity import identity_from_env, job_key, key_for_transport

__all__ = ["Emitter", "NullEmitter", "RecordSpool"]

log = logging.getLogger("sdcwatch.telemetry")

_wall = _time.time  # one global lookup in emit()

#: Records the sender builds before it releases the GIL once (a few tens of microseconds of work):
#: bounds how long an emit() in the training thread can wait for the interpreter lock.
_YIELD_EVERY = 8
#: Seconds the sender sleeps every ``_YIELD_EVERY`` records it packs into the spool: long enough
#: for a training thread waiting on the lock to take it (it still packs ~50,000 records a second).
_HANDOVER = 0.0001


def _ended_normally(exc: BaseException | None) -> bool:
    """Whether a ``with Emitter()`` block left the way a finished run does: no exception, Ctrl-C
    (the operator stopped it) or ``sys.exit(0)``. A run that raised did not end normally, and the
    service should report it as stalled."""
    if exc is None or isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, SystemExit) and exc.code in (0, None)


_STEP = struct.Struct("<Q")  # a v2 row starts with its step
_LEN = struct.Struct("<I")


class RecordSpool:
    """Records held while the bus is down, as bytes: the oldest first, counted in records.

    A v2 record is its packed row already; a v1 record is kept as its encoded bytes. Rows go into
    chunks of up to ``chunk`` records that share a layout, one ``bytearray`` each, so a full buffer
    of 100,000 records is about a hundred Python objects (a collection pass is over in microseconds)
    instead of hundreds of thousands. Only the sender thread touches it.
    """

    __slots__ = ("run", "host", "chunk", "count", "_chunks")

    def __init__(self, run: str, host: str, chunk: int) -> None:
        self.run, self.host, self.chunk = run, host, chunk
        self.count = 0
        self._chunks: collections.deque = collections.deque()  # [schema or None, bytearray, records]

    def put(self, rec: Record | PackedRecord) -> None:
        if isinstance(rec, PackedRecord):
            schema, data = rec.schema, rec.row
        else:
            schema, data = None, encode(rec)
            data = _LEN.pack(len(data)) + data
        last = self._chunks[-1] if self._chunks else None
        if last is None or last[0] is not schema or last[2] >= self.chunk:
            last = [schema, bytearray(), 0]
            self._chunks.append(last)
        last[1] += data
        last[2] += 1
        self.count += 1

    def take(self) -> list[Record | PackedRecord]:
        """The oldest chunk's records (at most ``chunk``), unpacked for the transport (a v1 record
        that does not decode again is left out: the caller sees fewer than it counted)."""
        schema, buf, n = self._chunks.popleft()
        self.count -= n
        if schema is None:
            out, p = [], 0
            for _ in range(n):
                (size,) = _LEN.unpack_from(buf, p)
                try:
                    out.extend(decode_message(bytes(buf[p + 4 : p + 4 + size])))
                except RecordError:  # cannot happen to what encode() wrote; never kills the sender
                    pass
                p += 4 + size
            return out
        size, run, host = schema.row_size, self.run, self.host
        return [
            PackedRecord(run, host, _STEP.unpack_from(buf, p)[0], schema, bytes(buf[p : p + size]))
            for p in range(0, n * size, size)
        ]

    def clear(self) -> None:
        self._chunks.clear()
        self.count = 0


class NullEmitter:
    """Does nothing, cheaply: use it instead of ``if enabled:`` branches in the training loop."""

    emitted = sent = dropped = invalid = 0

    def emit(self, step: int, **kwargs: Any) -> None:
        pass

    def checkpoint(self, step: int, path: Any = "") -> None:
        pass

    def flush(self, timeout: float | None = 10.0) -> bool:
        return True

    def close(self, timeout: float | None = 10.0, *, end_run: bool = True) -> None:
        pass

    def __enter__(self) -> "NullEmitter":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Emitter:
    """Streams one record per step from this rank to the bus, without ever hurting training.

    Args:
        transport: where records go; default a :class:`KafkaTransport` to ``bootstrap``.
        run, rank, world, local_rank, host: identity; defaults from the environment
            (see :func:`identity_from_env`).
        bootstrap: Kafka address for the default transport; default ``SDCWATCH_BOOTSTRAP``,
            then ``127.0.0.1:9092``.
        topic: the telemetry topic for the default transport; default
            ``SDCWATCH_BUS_TELEMETRY_TOPIC`` (the variable ``sdcwatch serve`` reads the same topic
            from), then ``sdcwatch.telemetry``.
        buffer: records held while the bus is slow or down (queue, spool and the batch in flight);
            beyond it new records are dropped and counted. While the bus is down they wait as
            packed bytes (:class:`RecordSpool`), not as Python objects.
        batch: records per send.
        linger: seconds the sender waits for more records before sending a partial batch.
        end_marker: send the end-of-run marker on :meth:`close` (so the service closes the run
            instead of alerting that it stalled); leaving a ``with`` block on an exception (other
            than Ctrl-C or ``sys.exit(0)``) sends none.
        wire: ``"v2"`` (packed rows of a schema sent once; the default) or ``"v1"`` (self-describing
            records); default ``SDCWATCH_WIRE``, then ``v2``.
        coords: this rank's place in the job's device mesh, {dim: index} over
            ``pp, dp_replicate, dp_shard, cp, ep, tp`` (:mod:`sdcwatch.core.mesh`), so the service
            compares it only with ranks that hold the same model piece; default from
            ``SDCWATCH_COORDS`` or ``SDCWATCH_MESH`` (see :func:`identity_from_env`), else none
            (pure data parallel).
        key: the job key every message is signed with (a :class:`~sdcwatch.core.signing.JobKey`
            or ``"kid:secret"``); default from ``SDCWATCH_KEY_FILE`` or ``SDCWATCH_KEY``, else
            none (unsigned). The transport signs, on the sender thread; an unusable key raises
            ConfigError here, naming the variable and never the secret.
    """

    def __init__(
        self,
        transport: Any = None,
        *,
        run: str | None = None,
        rank: int | None = None,
        world: int | None = None,
        local_rank: int | None = None,
        host: str | None = None,
        bootstrap: str | None = None,
        topic: str | None = None,
        buffer: int = 100_000,
        batch: int = 1024,
        linger: float = 0.005,
        wire: str | None = None,
        env: Mapping[str, str] | None = None,
        end_marker: bool = True,
        coords: Mapping[str, int] | None = None,
        key: Any = None,
    ) -> None:
        if not isinstance(buffer, int) or buffer < 1:
            raise ConfigError("buffer", f"must be a positive integer, got {buffer!r}")
        if not isinstance(batch, int) or batch < 1:
            raise ConfigError("batch", f"must be a positive integer, got {batch!r}")
        if not linger > 0:
            raise ConfigError("linger", f"must be > 0 seconds, got {linger!r}")
        wire = wire or (os.environ if env is None else env).get("SDCWATCH_WIRE") or "v2"
        if wire not in WIRES:
            raise ConfigError("wire", f"must be one of {', '.join(WIRES)}, got {wire!r}")
        self.wire = wire
        self._layouts: dict = {}  # layout -> schema, this emitter's few record layouts
        ident = identity_from_env(env)
        self.run = run if run is not None else ident["run"]
        self.rank = rank if rank is not None else ident["rank"]
        self.world = world if world is not None else ident["world"]
        self.local_rank = local_rank if local_rank is not None else ident["local_rank"]
        self.host = host if host is not None else ident["host"]
        self.coords: dict[str, int] = {}
        self.set_coords(coords if coords is not None else ident["coords"])
        # fail early, in the constructor, on an identity the service would reject
        validate(Record(self.run, 0, self.rank, self.world, self.host, 0.0, self.local_rank))
        self.key = job_key(key, env)
        if transport is None:
            from sdcwatch.telemetry.wire.transports import KafkaTransport

            env_map = os.environ if env is None else env
            transport = KafkaTransport(
                bootstrap or env_map.get("SDCWATCH_BOOTSTRAP") or "127.0.0.1:9092",
                topic or env_map.get("SDCWATCH_BUS_TELEMETRY_TOPIC") or TELEMETRY_TOPIC,
                key=self.key,
            )
        self.transport = transport
        self.key = key_for_transport(self.key, transport, explicit=key is not None)
        self.buffer = buffer
        self.batch = batch
        self.linger = linger
        self._taken = 0  # records the sender took from the queue (sent, held or invalid)
        self.sent = 0  # records the transport confirmed
        self.dropped = 0  # records dropped because the buffer was full (or after close)
        self.invalid = 0  # records rejected as invalid (bad metric name or value type)
        self.max_pending = 0  # high-water mark of queued + in-flight records
        self.end_marker = end_marker
        self.ended = False  # the end-of-run marker was confirmed by the bus
        self._last_step: int | None = None  # last step built into a record (sender thread)
        self.names = NamesOutbox(self.run, self.rank, self.world)  # layer names, once per key window
        self.notes = NoteOutbox(self.run, self.rank, self.world)  # checkpoints saved, for the sender
        self._queue: collections.deque = collections.deque()
        self._spool = RecordSpool(self.run, self.host, batch)  # packed, while the bus is down
        self._inflight: list[Record] = []
        self._held = 0  # records the sender holds: spooled or in flight
        # records emit() may still queue: buffer minus what the sender holds; 0 once closed
        self._room = buffer
        self._taking = False  # the sender is moving records off the queue
        self._closed = False
        self._stop = threading.Event()
        self._warned_drop = False
        self._warned_invalid = False
        self._down_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"sdcwatch-emitter-{self.rank}", daemon=True)
        self._thread.start()

    def set_coords(self, coords: Mapping[str, int]) -> None:
        """Put this rank's parallel coordinates ({mesh dim: index}) on every record from now on.

        ``attach(..., mesh=...)`` calls it with a torch ``DeviceMesh``'s coordinates; dims may be
        given by alias (``dp``, ``fsdp``...). Raises ConfigError naming a bad dim or index.
        """
        checked = check_coords(coords)
        for dim, index in checked.items():
            if index >= self.world:
                raise ConfigError(f"coords.{dim}", f"{index} out of range [0, {self.world}) (world size {self.world})")
        self.coords = checked

    def set_names(self, names: Mapping[str, Sequence[str]]) -> None:
        """This rank's layer names, ``{family: [module, ...]}`` (:mod:`sdcwatch.core.layer_names`)."""
        self.names.set(names)

    # -- training-loop side -------------------------------------------------------------------

    def emit(
        self,
        step: int,
        *,
        layers: Mapping[str, Sequence[float]] | None = None,
        fingerprints: Mapping[str, int] | None = None,
        time: float | None = None,
        **scalars: float,
    ) -> None:
        """Queue this rank's record for ``step``. Returns at once; never raises.

        The hot path is one length check and one append (a training step calls it cold, its
        caches evicted by the step: every bytecode counts); the rest is the sender's work.
        """
        try:
            q = self._queue
            if len(q) < self._room:
                q.append((step, _wall() if time is None else time, scalars, layers, fingerprints))
            else:
                self._refuse()
        except Exception:  # never into the training loop
            self.dropped += 1

    def _refuse(self) -> None:
        """A record with no room (buffer full, or emitted after close): counted, warned once."""
        self.dropped += 1
        if not self._closed and not self._warned_drop:
            self._warned_drop = True
            log.warning(
                "sdcwatch emitter (rank %s): buffer of %d records full (bus down or slow); "
                "dropping records and counting them, training is unaffected",
                self.rank,
                self.buffer,
            )

    def checkpoint(self, step: int, path: Any = "") -> None:
        """Tell the service this job saved a checkpoint after ``step`` at ``path`` (a folder or file;
        "" when there is none to name). Returns at once; never raises. Sent by the sender thread,
        before the end-of-run marker; while the bus is down it waits (``self.notes``: sent, dropped)."""
        try:
            self.notes.add(step, path, not self._closed)
        except Exception:  # never into the training loop
            pass

    @property
    def emitted(self) -> int:
        """emit() calls: records taken by the sender, queued, or dropped."""
        return self._taken + len(self._queue) + self.dropped

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until everything queued has been sent; False if ``timeout`` passed first."""
        deadline = None if timeout is None else _time.monotonic() + timeout
        # Read in this order: the sender sets _taking before it pops the queue and clears it only
        # after _held counts what it popped (until the bus confirms it), so a record is always
        # visible in one of the three.
        while self._queue or self._taking or self._held or len(self.notes):
            if not self._thread.is_alive():
                return False
            if deadline is not None and _time.monotonic() >= deadline:
                return False
            _time.sleep(0.002)
        return True

    def close(self, timeout: float | None = 10.0, *, end_run: bool = True) -> None:
        """Flush for up to ``timeout`` seconds, send the end-of-run marker, stop, close the transport.

        Returns within ``timeout`` (plus a fraction of a second), with the sender thread gone: the
        transport is told the deadline (``transport.deadline``, where it has one), so a flush or a
        connection attempt ends by then (one attempt begun before ``close`` ends on its own bound,
        ``connect_timeout_ms``). What could not be sent is counted as dropped. The end-of-run marker
        goes only when everything emitted was sent (so it follows the rank's last record on the bus)
        and ``end_run`` is true.
        """
        if self._closed:
            return
        start = _time.monotonic()
        deadline = None if timeout is None else start + max(0.0, timeout)
        if deadline is not None and hasattr(self.transport, "deadline"):
            try:
                self.transport.deadline = deadline
            except Exception:
                pass
        flushed = self.flush(timeout)
        self._closed = True
        self._room = 0
        self._stop.set()
        # the transport's calls end by the deadline; a little grace for the sender to notice the stop
        self._thread.join(timeout=None if deadline is None else max(0.0, deadline - _time.monotonic()) + 0.5)
        if self._thread.is_alive():  # a connection attempt begun before close(): it ends on its own bound
            self._thread.join(timeout=getattr(self.transport, "connect_timeout_ms", 0) / 1000)
        self.notes.drop()  # checkpoint notes the bus did not take in time
        left = len(self._queue) + self._held
        if left:
            self.dropped += left
            self._taken -= self._held  # counted as dropped now, not as taken
            self._queue.clear()
            self._spool.clear()
            self._inflight = []
            self._held = 0
            log.warning(
                "sdcwatch emitter (rank %s): closed with %d records unsent (bus %s)",
                self.rank,
                left,
                getattr(self.transport, "bootstrap", "unavailable"),
            )
        elif flushed and end_run and self.end_marker and self._last_step is not None:
            self._send_end_marker()
        try:
            self.transport.close()
        except Exception as exc:
            log.warning("sdcwatch emitter (rank %s): closing transport failed: %s", self.rank, exc)

    @property
    def pending(self) -> int:
        """Records queued, spooled or in flight."""
        return len(self._queue) + self._held

    def __enter__(self) -> "Emitter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.close(end_run=_ended_normally(exc))

    def _send_end_marker(self) -> None:
        from sdcwatch.telemetry.wire.end_marker import end_marker

        try:
            self.transport.send(
                [
                    end_marker(
                        self.run,
                        self._last_step,
                        self.rank,
                        self.world,
                        host=self.host,
                        local_rank=self.local_rank,
                        dropped=self.dropped,
                    )
                ]
            )
            self.ended = True
        except Exception as exc:  # the run will look stalled to the service; say why here
            log.warning("sdcwatch emitter (rank %s): end-of-run marker not sent: %s", self.rank, exc)

    # -- sender thread ------------------------------------------------------------------------

    def _build(self, item: tuple) -> Record | PackedRecord | None:
        step, t, scalars, layers, fps = item
        scalars["emitter_dropped"] = float(self.dropped)  # emit() owns this kwargs dict: no copy
        try:
            if self.wire == "v2":
                if isinstance(step, bool) or not math.isfinite(t):
                    raise RecordError("step" if isinstance(step, bool) else "time", "must be a number")
                rec = PackedRecord.pack(
                    self.run,
                    self.host,
                    step,
                    self.rank,
                    self.world,
                    self.local_rank,
                    t,
                    scalars,
                    fps,
                    layers,
                    coords=self.coords,
                    schemas=self._layouts,
                )
            else:
                rec = Record(
                    self.run,
                    step,
                    self.rank,
                    self.world,
                    self.host,
                    t,
                    self.local_rank,
                    scalars,
                    dict(fps) if fps else {},
                    dict(layers) if layers else {},
                    self.coords,
                )
                validate(rec)
        except (RecordError, struct.error, TypeError, ValueError, OverflowError) as exc:
            self._note_invalid(step, exc)
            return None
        self._last_step = step
        return rec

    def _note_invalid(self, step: Any, exc: Exception) -> None:
        self.invalid += 1
        if not self._warned_invalid:
            self._warned_invalid = True
            log.warning("sdcwatch emitter (rank %s): invalid record at step %s not sent: %s", self.rank, step, exc)

    def _take(self, put: Any, pause: float = 0.0) -> None:
        """Move up to a batch of records off the queue, built, to ``put`` (a list's append, the spool's
        put), sleeping ``pause`` seconds every few records."""
        q = self._queue
        self._taking = True
        self._set_room(self.buffer - self._held - min(len(q), self.batch))  # those about to be taken stay counted
        try:
            n = 0
            while q and n < self.batch:
                item = q.popleft()
                self._taken += 1
                rec = self._build(item)
                if rec is not None:
                    try:
                        put(rec)
                    except (RecordError, struct.error, TypeError, ValueError, OverflowError) as exc:
                        self._note_invalid(rec.step, exc)  # a v1 value encode() refuses
                    else:
                        self._held += 1
                n += 1
                if n % _YIELD_EVERY == 0:
                    _time.sleep(pause)  # let the training thread have the GIL: its emit() must not wait for a batch
        finally:
            self._set_room(self.buffer - self._held)
            self._taking = False

    def _next_batch(self) -> None:
        """The next records to send, oldest first: the spool's (what waited out an outage), else the queue's."""
        if self._spool.count:
            self._spool_queue()  # what arrived meanwhile waits packed too, behind the spool
            before = self._spool.count
            batch = self._spool.take()
            lost = before - self._spool.count - len(batch)
            if lost:
                self._held -= lost
                self.invalid += lost
        else:
            batch = []
            self._take(batch.append)
        for rec in batch:
            self.names.note(rec.step)
        self._inflight = batch

    def _spool_queue(self) -> None:
        """Pack everything queued into the spool: the bus is down, or the spool is not empty yet.

        Nothing waits on it, so it pauses for real between a few records (a ``sleep(0)`` releases
        the interpreter lock but often takes it straight back): the training thread never waits.
        """
        while self._queue:
            self._take(self._spool.put, _HANDOVER)

    def _wait_down(self, seconds: float) -> bool:
        """Wait ``seconds`` before the next try, packing what emit() queues meanwhile; True: closing."""
        until = _time.monotonic() + seconds
        while True:
            self._spool_queue()
            left = until - _time.monotonic()
            if left <= 0:
                return False
            if self._stop.wait(min(left, max(self.linger, 0.005))):
                return True

    def _set_room(self, room: int) -> None:
        """What emit() may still queue (nothing once closed)."""
        self._room = 0 if self._closed else room

    def _run(self) -> None:
        backoff = 0.05
        while True:
            self.notes.send(self.transport)
            if not self._inflight:
                if not self._queue and not self._spool.count:
                    if self._stop.is_set():
                        return
                    self._stop.wait(self.linger)
                    continue
                self._next_batch()
                pending = len(self._queue) + self._held
                if pending > self.max_pending:
                    self.max_pending = pending
                if not self._inflight:
                    continue
            self.names.send(self.transport)
            try:
                self.transport.send(self._inflight)
            except Exception as exc:
                unsent = exc.unsent if isinstance(exc, TransportError) else None
                if unsent is not None:
                    done = len(self._inflight) - len(unsent)
                    self.sent += done
                    self._held -= done
                    self._inflight = list(unsent)
                    self._set_room(self.buffer - self._held)
                if self._down_since is None:
                    self._down_since = _time.monotonic()
                    log.warning(
                        "sdcwatch emitter (rank %s): bus unavailable, buffering (up to %d records): %s",
                        self.rank,
                        self.buffer,
                        exc,
                    )
                if self._wait_down(backoff):
                    return  # closing: close() counts what is left
                backoff = min(backoff * 2, 2.0)
                continue
            self.sent += len(self._inflight)
            self._held -= len(self._inflight)
            self._inflight = []
            self._set_room(self.buffer - self._held)
            backoff = 0.05
            if self._down_since is not None:
                log.warning(
                    "sdcwatch emitter (rank %s): bus back after %.1fs; %d records dropped so far",
                    self.rank,
                    _time.monotonic() - self._down_since,
                    self.dropped,
                )
                self._down_since = None
