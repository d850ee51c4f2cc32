"""What the emitter's sender thread holds between sends: the records and notes spooled while the bus
is down (:class:`RecordSpool`), the layer names due ahead of each key window and the rank's GPU due
once (:class:`NamesOutbox`), the checkpoint notes' counts (:class:`NoteCounts`).
"""

from __future__ import annotations

import collections
import logging
import struct
from typing import Any, Callable, Mapping, Sequence

from sdcwatch.core.errors import RecordError
from sdcwatch.core.messages import decode_message
from sdcwatch.core.rank_notes import (
    MAX_GPU_BYTES,
    MAX_PATH_BYTES,
    CheckpointNote,
    LayerNames,
    RankDevice,
    clean_names,
    clean_text,
)
from sdcwatch.core.record import KEY_WINDOW, encode
from sdcwatch.core.record_layout import PackedRecord
from sdcwatch.core.record_type import Record

__all__ = ["RecordSpool", "NamesOutbox", "NoteCounts", "MAX_NOTES"]

log = logging.getLogger("sdcwatch.telemetry")

_STEP = struct.Struct("<Q")  # a v2 row starts with its step
_LEN = struct.Struct("<I")


class RecordSpool:
    """Records held while the bus is down, as bytes, oldest first, counted in records: chunks of up to
    ``chunk`` rows of one layout in one ``bytearray`` each (a full buffer is a few hundred Python
    objects, not hundreds of thousands). A checkpoint note waits, uncounted, in a chunk of its own.
    """

    __slots__ = ("run", "host", "chunk", "count", "_chunks")

    def __init__(self, run: str, host: str, chunk: int) -> None:
        self.run, self.host, self.chunk = run, host, chunk
        self.count = 0
        self._chunks: collections.deque = collections.deque()  # [schema, None or "note", bytearray or list, records]

    def put(self, rec: Record | PackedRecord | CheckpointNote) -> None:
        if isinstance(rec, CheckpointNote):
            self._chunks.append([None, "note", [rec], 0])
            return
        if isinstance(rec, PackedRecord):
            schema, data = rec.schema, rec.row
        else:
            schema, data = None, encode(rec)
            data = _LEN.pack(len(data)) + data
        last = self._chunks[-1] if self._chunks else None
        if last is None or last[1] is not None or last[0] is not schema or last[3] >= self.chunk:
            last = [schema, None, bytearray(), 0]
            self._chunks.append(last)
        last[2] += data
        last[3] += 1
        self.count += 1

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def take(self) -> list[Record | PackedRecord | CheckpointNote]:
        """The oldest chunk's items, unpacked (a v1 record that does not decode again is left out)."""
        schema, note, buf, n = self._chunks.popleft()
        self.count -= n
        if note is not None:
            return buf
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


class NamesOutbox:
    """One rank's layer names (:meth:`Emitter.set_names`), packed once into a :class:`LayerNames`
    message; a copy stamped with the step of each key window's first record goes ahead of its
    records (a refused send goes again with the next batch). The rank's GPU (``gpu``: read at the
    first record, when the job has set its device up) goes once, ahead of the first records, and
    again only if refused. Nothing here raises into the sender.
    """

    def __init__(self, run: str, rank: int, world: int, gpu: Callable[[], str] | None = None) -> None:
        self.run, self.rank, self.world = run, rank, world
        self._gpu = gpu  # None once read
        self.names: LayerNames | None = None
        self._window: int | None = None  # the key window the names last went out in
        self._due: list[LayerNames | RankDevice] = []
        self.sent = 0  # layer-names messages the transport took
        self.device: RankDevice | None = None  # the rank's GPU, once read (None: a CPU rank, or not yet)

    def set(self, names: Mapping[str, Sequence[str]]) -> None:
        """New lists (they grow as the probes discover modules); sent from the next record on."""
        try:
            self.names = LayerNames.build(self.run, self.rank, self.world, 0, clean_names(names))
            self._window = None
        except Exception as exc:  # a bound the lists break: the records still go, unnamed
            log.warning("sdcwatch emitter (rank %s): layer names not sent: %s", self.rank, exc)

    def note(self, step: int) -> None:
        """A record of ``step`` is about to go: the names go first if its window has not had them
        (and the rank's GPU, before the first record)."""
        if self._gpu is not None:
            self._say_gpu(step)
        names = self.names
        if names is not None and step // KEY_WINDOW != self._window:
            self._window = step // KEY_WINDOW
            self._due.append(names.at(step))

    def _say_gpu(self, step: int) -> None:
        read, self._gpu = self._gpu, None
        try:
            gpu = clean_text(read(), MAX_GPU_BYTES)
            if gpu:
                self.device = RankDevice(self.run, self.rank, self.world, step, gpu)
                self._due.append(self.device)
        except Exception as exc:  # the records still go, their host credited without a GPU
            log.warning("sdcwatch emitter (rank %s): GPU identity not sent: %s", self.rank, exc)

    def send(self, transport: Any) -> None:
        """Send the copies due (call before the records they precede)."""
        if not self._due:
            return
        due, self._due = self._due, []
        try:
            transport.send(due)
            self.sent += sum(1 for m in due if type(m) is LayerNames)
        except Exception:
            self._window = None
            self._due = [m for m in due if type(m) is RankDevice]  # the names go again with their window


#: Checkpoint notes a rank holds for its sender at most (a job saves one every few hundred steps).
MAX_NOTES = 64


class NoteCounts:
    """One rank's checkpoint notes ``sent`` and ``dropped``; ``queued`` is written by the training
    thread only, ``taken`` and ``settled`` (sent or dropped) by the sender only: no count is lost."""

    __slots__ = ("sent", "dropped", "queued", "taken", "settled")

    def __init__(self) -> None:
        self.sent = self.dropped = self.queued = self.taken = self.settled = 0

    def __len__(self) -> int:
        """Notes queued or held, not yet sent or dropped."""
        return self.queued - self.settled

    def build(self, item: tuple, run: str, rank: int, world: int) -> CheckpointNote | None:
        """The note of a queued ``(step, path)``; None (counted as dropped) when it is invalid."""
        step, path = item
        self.taken += 1
        try:
            return CheckpointNote(run, rank, world, step, clean_text(path, MAX_PATH_BYTES))
        except (RecordError, TypeError, ValueError) as exc:
            self.settle(dropped=1)
            log.warning("sdcwatch emitter (rank %s): checkpoint note at step %r not sent: %s", rank, step, exc)
            return None

    def settle(self, sent: int = 0, dropped: int = 0) -> None:
        self.sent += sent
        self.dropped += dropped
        self.settled += sent + dropped
