"""The emitter, the training loop's only contact with sdcwatch: ``emit()`` queues and returns, never
raising or blocking; a sender thread builds, orders, sends (or spools while the bus is down) and ends
the run with a marker (docs/messages.md, "The emitter and its transports").
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import struct
import threading
import time as _time
from typing import Any, Mapping, Sequence

from sdcwatch.core.columnar import WIRES
from sdcwatch.core.errors import ConfigError, RecordError, TransportError
from sdcwatch.core.mesh import check_coords
from sdcwatch.core.messages import end_marker as end_of_run
from sdcwatch.core.rank_notes import CheckpointNote
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.record_type import Record, validate
from sdcwatch.core.validate import check_choice, check_int, check_number
from sdcwatch.core.vocabulary import TELEMETRY_TOPIC
from sdcwatch.telemetry.wire.environment import RankEnvironment, initialised_cuda
from sdcwatch.telemetry.wire.outbox import MAX_NOTES, NamesOutbox, NoteCounts, RecordSpool
from sdcwatch.telemetry.wire.transports import KafkaTransport, key_for_transport

__all__ = ["Emitter", "NullEmitter"]

log = logging.getLogger("sdcwatch.telemetry")

_wall = _time.time  # one global lookup in emit()

#: Records the sender builds before it releases the GIL once (a few tens of microseconds of work):
#: bounds how long an emit() in the training thread can wait for the interpreter lock.
_YIELD_EVERY = 8
#: Seconds the sender sleeps every ``_YIELD_EVERY`` records it packs into the spool: long enough
#: for a training thread waiting on the lock to take it (it still packs ~50,000 records a second).
_HANDOVER = 0.0001


def _ended_normally(exc: BaseException | None) -> bool:
    """Whether a ``with Emitter()`` block left as a finished run does: no exception, Ctrl-C or
    ``sys.exit(0)`` (a run that raised should look stalled to the service)."""
    if exc is None or isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, SystemExit) and exc.code in (0, None)


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
    """Streams one record per step from this rank to the bus, without ever hurting training
    (docs/messages.md, "The emitter and its transports").

    Args:
        transport: where records go; default a :class:`KafkaTransport` to ``bootstrap``
            (``SDCWATCH_BOOTSTRAP``, then ``127.0.0.1:9092``) and ``topic``
            (``SDCWATCH_BUS_TELEMETRY_TOPIC``, then ``sdcwatch.telemetry``).
        run, rank, world, local_rank, host, coords: identity; defaults from ``env``
            (:meth:`RankEnvironment.identity`); ``coords``: {mesh dim: index} (:mod:`sdcwatch.core.mesh`).
        buffer: records held while the bus is slow or down; beyond it new ones are dropped and counted.
        batch: records per send.
        linger: seconds the sender waits for more records before sending a partial batch.
        end_marker: send the end-of-run marker on :meth:`close` (none when a ``with`` block is left
            on an exception other than Ctrl-C or ``sys.exit(0)``).
        wire: ``"v2"`` (default) or ``"v1"``; default ``SDCWATCH_WIRE``.
        key: the job key the transport signs with (a :class:`~sdcwatch.core.signing.JobKey` or
            ``"kid:secret"``); default ``SDCWATCH_KEY_FILE``'s or ``SDCWATCH_KEY``'s, else unsigned.
        env: the environment to read (a mapping or a :class:`RankEnvironment`); default the process's.
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
        env: Mapping[str, str] | RankEnvironment | None = None,
        end_marker: bool = True,
        coords: Mapping[str, int] | None = None,
        key: Any = None,
    ) -> None:
        check_int("buffer", buffer, lo=1)
        check_int("batch", batch, lo=1)
        check_number("linger", linger, lo=0, lo_open=True)
        environ = env if isinstance(env, RankEnvironment) else RankEnvironment.read(env)
        self.wire = check_choice("wire", wire or environ.wire or "v2", WIRES)
        self._layouts: dict = {}  # layout -> schema, this emitter's few record layouts
        self._identify(environ.identity(), run, rank, world, local_rank, host, coords)
        self.key = environ.job_key(key)
        if transport is None:
            transport = KafkaTransport(
                bootstrap or environ.bootstrap or "127.0.0.1:9092",
                topic or environ.telemetry_topic or TELEMETRY_TOPIC,
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
        # layer names, once per key window; the GPU once, read at the first record (the device set up by then)
        self.names = NamesOutbox(self.run, self.rank, self.world, _gpu_reader(environ))
        self.notes = NoteCounts()  # checkpoints saved: queued with the records, in their order
        self._queue: collections.deque = collections.deque()
        self._spool = RecordSpool(self.run, self.host, batch)  # packed, while the bus is down
        self._inflight: list[Record] = []
        self._held = 0  # records the sender holds: spooled or in flight
        # emit() counts what is kept exactly and without a lock from two numbers, each written by one
        # thread: the records it queued, and of those the ones sent or found invalid (queue length
        # plus held is off while the sender moves a record, so a full buffer would not keep the oldest)
        self._accepted = 0  # training thread
        self._freed = 0  # sender thread
        self._room = buffer  # the most records kept at once; 0 once closed
        self._taking = False  # the sender is moving records off the queue
        self._closed = False
        self._stop = threading.Event()
        self._warned_drop = False
        self._warned_invalid = False
        self._down_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"sdcwatch-emitter-{self.rank}", daemon=True)
        self._thread.start()

    def _identify(
        self, ident: dict[str, Any], run: Any, rank: Any, world: Any, local: Any, host: Any, coords: Any
    ) -> None:
        """Take the identity given, the environment's where not; fail here on one the service rejects."""
        self.run = run if run is not None else ident["run"]
        self.rank = rank if rank is not None else ident["rank"]
        self.world = world if world is not None else ident["world"]
        self.local_rank = local if local is not None else ident["local_rank"]
        self.host = host if host is not None else ident["host"]
        self.coords: dict[str, int] = {}
        self.set_coords(coords if coords is not None else ident["coords"])
        validate(Record(self.run, 0, self.rank, self.world, self.host, 0.0, self.local_rank))

    def set_coords(self, coords: Mapping[str, int]) -> None:
        """Put this rank's parallel coordinates ({mesh dim or alias: index}) on every record from now
        on (``attach(..., mesh=...)`` calls it); ConfigError naming a bad dim or index."""
        checked = check_coords(coords)
        for dim, index in checked.items():
            if index >= self.world:
                raise ConfigError(f"coords.{dim}", f"{index} out of range [0, {self.world}) (world size {self.world})")
        self.coords = checked

    def set_names(self, names: Mapping[str, Sequence[str]]) -> None:
        """This rank's layer names, ``{family: [module, ...]}`` (:mod:`sdcwatch.core.rank_notes`)."""
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
        """Queue this rank's record for ``step``. Returns at once; never raises. One count check and
        one append (a step calls it with cold caches: every bytecode counts); the rest is the sender's."""
        try:
            if self._accepted - self._freed < self._room:
                self._queue.append((step, _wall() if time is None else time, scalars, layers, fingerprints))
                self._accepted += 1
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
        """Tell the service this job saved a checkpoint after ``step`` at ``path`` ("": none to name).
        Returns at once; never raises. Queued with the records, in their order; past ``MAX_NOTES``
        waiting, or once closed, dropped and counted (``self.notes``)."""
        with contextlib.suppress(Exception):  # never into the training loop
            if self._closed or len(self.notes) >= MAX_NOTES:
                self.notes.dropped += 1
            else:
                self._queue.append((step, path))  # a 2-tuple: the sender tells it from a record
                self.notes.queued += 1

    @property
    def emitted(self) -> int:
        """emit() calls: records taken by the sender, queued, or dropped."""
        return self._taken + len(self._queue) - (self.notes.queued - self.notes.taken) + self.dropped

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until everything queued has been sent; False if ``timeout`` passed first."""
        deadline = None if timeout is None else _time.monotonic() + timeout
        # in this order: the sender sets _taking before it pops the queue and clears it only after
        # _held counts what it popped, so a record is always visible in one of the three
        while self._queue or self._taking or self._held or len(self.notes):
            if not self._thread.is_alive():
                return False
            if deadline is not None and _time.monotonic() >= deadline:
                return False
            _time.sleep(0.002)
        return True

    def close(self, timeout: float | None = 10.0, *, end_run: bool = True) -> None:
        """Flush for up to ``timeout`` seconds, send the end-of-run marker, stop, close the transport.

        Returns within ``timeout`` (and a fraction of a second): the transport is told the deadline.
        What could not be sent is counted as dropped; the marker goes only when ``end_run`` and
        everything emitted was sent (so it follows the rank's last record).
        """
        if self._closed:
            return
        start = _time.monotonic()
        deadline = None if timeout is None else start + max(0.0, timeout)
        if deadline is not None and hasattr(self.transport, "deadline"):
            with contextlib.suppress(Exception):
                self.transport.deadline = deadline
        flushed = self.flush(timeout)
        self._closed = True
        self._room = 0
        self._stop.set()
        # the transport's calls end by the deadline; a little grace for the sender to notice the stop
        self._thread.join(timeout=None if deadline is None else max(0.0, deadline - _time.monotonic()) + 0.5)
        if self._thread.is_alive():  # a connection attempt begun before close(): it ends on its own bound
            self._thread.join(timeout=getattr(self.transport, "connect_timeout_ms", 0) / 1000)
        self.notes.settle(dropped=len(self.notes))  # checkpoint notes the bus did not take in time
        left = len(self._queue) - (self.notes.queued - self.notes.taken) + self._held
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
        extra = {"host": self.host, "local_rank": self.local_rank, "dropped": self.dropped}
        try:
            self.transport.send([end_of_run(self.run, self._last_step, self.rank, self.world, **extra)])
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
        self._freed += 1
        if not self._warned_invalid:
            self._warned_invalid = True
            log.warning("sdcwatch emitter (rank %s): invalid record at step %s not sent: %s", self.rank, step, exc)

    def _take(self, put: Any, pause: float = 0.0) -> None:
        """Move up to a batch of records off the queue, built, to ``put``, sleeping ``pause`` seconds
        every few records."""
        q = self._queue
        self._taking = True
        try:
            n = 0
            while q and n < self.batch:
                item = q.popleft()
                if len(item) == 2:  # a checkpoint note, in its place among the records
                    note = self.notes.build(item, self.run, self.rank, self.world)
                    if note is not None:
                        put(note)
                    continue
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
            self._taking = False

    def _next_batch(self) -> None:
        """The next records to send, oldest first: the spool's (what waited out an outage), else the queue's."""
        if self._spool:
            self._spool_queue()  # what arrived meanwhile waits packed too, behind the spool
            before = self._spool.count
            batch = self._spool.take()
            lost = before - self._spool.count - _records_in(batch)
            if lost:
                self._held -= lost
                self.invalid += lost
                self._freed += lost
        else:
            batch = []
            self._take(batch.append)
        for rec in batch:
            self.names.note(rec.step)
        self._inflight = batch

    def _spool_queue(self) -> None:
        """Pack everything queued into the spool (the bus is down, or the spool not empty yet), pausing
        for real between a few records (``sleep(0)`` often takes the lock straight back)."""
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

    def _confirm(self, items: list) -> None:
        """Count what the bus took: records as sent (no longer held), checkpoint notes as sent."""
        records = _records_in(items)
        self.sent += records
        self._freed += records
        self._held -= records
        self.notes.settle(sent=len(items) - records)

    def _run(self) -> None:
        backoff = 0.05
        while True:
            if not self._inflight:
                if not self._queue and not self._spool:
                    if self._stop.is_set():
                        return
                    self._stop.wait(self.linger)
                    continue
                self._next_batch()
                self.max_pending = max(self.max_pending, len(self._queue) + self._held)
                if not self._inflight:
                    continue
            self.names.send(self.transport)
            try:
                self.transport.send(self._inflight)
            except Exception as exc:
                unsent = exc.unsent if isinstance(exc, TransportError) else None
                if unsent is not None:
                    kept = {id(x) for x in unsent}
                    self._confirm([x for x in self._inflight if id(x) not in kept])
                    self._inflight = list(unsent)
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
            self._confirm(self._inflight)
            self._inflight = []
            backoff = 0.05
            if self._down_since is not None:
                log.warning(
                    "sdcwatch emitter (rank %s): bus back after %.1fs; %d records dropped so far",
                    self.rank,
                    _time.monotonic() - self._down_since,
                    self.dropped,
                )
                self._down_since = None


def _gpu_reader(environ: RankEnvironment) -> Any:
    """What reads this rank's GPU in the sender thread: the device CUDA has current here (the
    training thread's, when it initialised CUDA already: a new thread's current device is 0)."""
    cuda = initialised_cuda()
    try:
        ordinal = cuda.current_device() if cuda is not None else None
    except Exception:
        ordinal = None
    return lambda: environ.gpu(initialised_cuda(), ordinal)


def _records_in(items: list) -> int:
    """Records among what the sender holds (checkpoint notes are not counted as records)."""
    return len(items) - sum(1 for x in items if type(x) is CheckpointNote)
