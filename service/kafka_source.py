"""KafkaSource: a topic read in a consumer group by a reader thread that owns the consumer (polls,
decodes, dead-letters, commits, measures the lag); TopicReader: any topic read whole without a group
(the bus-reading commands). Both re-fetch a gap in a partition's offsets (:mod:`~sdcwatch.service.offset_gaps`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from sdcwatch.core.errors import ConfigError, TransportError
from sdcwatch.core.kafka import new_consumer, new_producer, security_settings
from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.messages import decode_message
from sdcwatch.core.record import encode, encode_batch
from sdcwatch.core.record_type import Record
from sdcwatch.core.vocabulary import DEADLETTER_TOPIC, TELEMETRY_TOPIC
from sdcwatch.service.bus import DEADLETTER_MAX_BYTES, FAST_JOIN, DeadLetterCounts, dead_letter_value, decode_batch
from sdcwatch.service.ingest import IngestDecoder, SchemaRegistry, count_records
from sdcwatch.service.offset_gaps import GAP_WAIT_S, OffsetGaps

__all__ = ["KafkaSource", "TopicReader", "DEAD_LETTER_BATCH"]

log = logging.getLogger("sdcwatch.detectors")


#: Records the pipeline refused that go to the dead-letter topic in one message (a v1 batch).
DEAD_LETTER_BATCH = 256

#: Share of the max poll interval the reader may spend on one poll's messages (gap re-fetch,
#: verification, decoding), at the cost a message has taken it lately: under any flood it polls
#: again well within the interval, so the group never evicts it (a rebalance re-reads records).
POLL_WORK_SHARE = 0.2


class KafkaSource(DeadLetterCounts):
    """Reads a topic in a consumer group, with a dead-letter topic for bad messages.

    The reader thread hands decoded batches to :meth:`poll` through a queue of at most
    ``queue_records`` records (past it, it pauses its partitions and keeps polling): whatever the
    service does between two polls, the consumer stays in its group. It takes at most
    ``max_poll_records`` messages a poll, fewer when they cost more (:data:`POLL_WORK_SHARE`).
    Commits, lag and the assignment are handled there too (kafka-python's consumer is not thread-safe).

    ``sole_member_after_s`` (stage both and temporal, which must read the whole topic): a member
    that has held only part of the topic's partitions for that long shares its group: :meth:`poll`
    raises ConfigError saying so, and it commits nothing meanwhile (:attr:`owns_topic` False), so
    the instance that stays re-reads what it took (docs/service.md). ``first_member``: this member
    created the topic, so none held it before: it stays like one that held the whole topic.
    ``connect_timeout``: seconds each client waits for the broker to answer (then TransportError).
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str = TELEMETRY_TOPIC,
        *,
        group: str = "sdcwatch-detectors",
        deadletter_topic: str = DEADLETTER_TOPIC,
        auto_offset_reset: str = "earliest",
        max_poll_records: int = 20_000,
        max_poll_interval_ms: int = FAST_JOIN["max_poll_interval_ms"],
        session_timeout_ms: int = FAST_JOIN["session_timeout_ms"],
        heartbeat_interval_ms: int = FAST_JOIN["heartbeat_interval_ms"],
        lag_interval: float = 1.0,
        decode: Callable[..., list] = decode_message,
        limits: RecordLimits | None = None,
        ingest: IngestDecoder | None = None,
        queue_records: int = 100_000,
        gap_wait_s: float = GAP_WAIT_S,
        sole_member_after_s: float | None = None,
        first_member: bool = False,
        connect_timeout: float = 30.0,
        **security: Any,
    ) -> None:
        security = security_settings(security)  # an unknown key fails before anything is opened
        self._sole_after = sole_member_after_s
        self.bootstrap = bootstrap
        self.topic = topic
        self.group = group
        self.deadletter_topic = deadletter_topic
        self.max_poll_records = max_poll_records
        self.lag_interval = lag_interval
        self.queue_records = queue_records
        self._max_poll_interval = max_poll_interval_ms / 1000
        self.decode = decode  # decode_summary_message for the temporal stage; telemetry goes through ingest
        self.ingest = ingest if ingest is not None else IngestDecoder(SchemaRegistry(limits))
        self.schemas = self.ingest.registry  # the wire-v2 layouts learnt (saved with the state)
        self.gaps = OffsetGaps(gap_wait_s)  # partition offsets that skip ahead: re-fetched first
        self._start_health()
        self._whole_once = first_member
        self._open_handover()
        self._connect(
            security,
            auto_offset_reset=auto_offset_reset,
            max_poll_interval_ms=max_poll_interval_ms,
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            bootstrap_timeout_ms=int(connect_timeout * 1000),
        )
        self._thread = threading.Thread(target=self._read, name=f"sdcwatch-reader-{topic}", daemon=True)
        self._thread.start()

    def _start_health(self) -> None:
        """The source's health, read by the service for /metrics (:meth:`health`)."""
        self._positioned: set = set()  # partitions whose fetch position was asked since their assignment
        self.records = 0
        self.dead_letters = 0
        self.dead_letter_reasons: dict[str, int] = {}
        self.partitions = 0  # partitions this member owns now
        self.rebalances = 0  # times the assignment changed after the first join
        self.unassigned_since: float | None = None  # monotonic time the member lost its partitions
        self._lag = 0
        self._lag_at = 0.0
        self._assignment: list[int] | None = None
        self._had_partitions = False
        self.owns_topic = self._sole_after is None  # every partition of the topic is this member's
        self.shared: str | None = None  # why this member must leave (it shares its group), once known
        self._whole_once = False  # this member held the whole topic since it started (or created it)
        self._partial_since: float | None = None
        self._commit_after = 0.0  # monotonic time before which no commit is tried (after a failed one)
        self.message_cost = 0.0  # seconds the reader spent on a message lately (its poll budget)
        self._saturated = False  # the reader's last poll took its whole budget: more waits on the bus

    def _open_handover(self) -> None:
        """Decoded batches to the service thread, requests (commits) to the reader, under one condition."""
        self._cond = threading.Condition()
        self._queue: deque[tuple[list, dict[Any, int], int]] = deque()  # (records and column blocks, offsets, records)
        self._queued_records = 0
        self._handed: dict[Any, int] = {}  # partition -> next offset of what poll() returned
        self._requests: deque[tuple[Callable[[], None], threading.Event]] = deque()
        self._stop = threading.Event()

    def _connect(
        self,
        security: dict[str, Any],
        *,
        auto_offset_reset: str,
        max_poll_interval_ms: int,
        session_timeout_ms: int,
        heartbeat_interval_ms: int,
        bootstrap_timeout_ms: int,
    ) -> None:
        """The group consumer of the topic and the dead-letter producer; TransportError when the
        bus cannot be reached within ``bootstrap_timeout_ms``."""
        from kafka.errors import KafkaError

        try:
            self._consumer = new_consumer(
                self.bootstrap,
                self.topic,
                security=security,
                group_id=self.group,
                enable_auto_commit=False,
                auto_offset_reset=auto_offset_reset,
                max_poll_records=self.max_poll_records,
                max_poll_interval_ms=max_poll_interval_ms,
                session_timeout_ms=session_timeout_ms,
                heartbeat_interval_ms=heartbeat_interval_ms,
                fetch_max_wait_ms=100,
                # producers that batch many ranks send messages of hundreds of kB, which the broker
                # batches further: fetch whole record batches of up to 16 MB a partition
                max_partition_fetch_bytes=16 << 20,
                bootstrap_timeout_ms=bootstrap_timeout_ms,
            )
            # a dead letter is kept whole up to DEADLETTER_MAX_BYTES: above the 1 MB default request
            self._dl_producer = new_producer(
                self.bootstrap,
                security,
                linger_ms=5,
                max_block_ms=5000,
                max_request_size=DEADLETTER_MAX_BYTES + (1 << 20),
                bootstrap_timeout_ms=bootstrap_timeout_ms,
            )
        except (KafkaError, OSError, ValueError) as exc:
            raise TransportError(f"cannot connect to Kafka at {self.bootstrap}: {exc}") from None

    # -- the service's side ---------------------------------------------------------------------

    def poll(self, timeout: float = 1.0, max_records: int | None = None) -> list:
        """Decoded records and v2 column blocks (whole messages, about ``max_records`` records);
        bad messages are dead-lettered."""
        if self.shared:
            raise ConfigError("bus.group", self.shared)
        limit = max_records or self.max_poll_records
        out: list = []
        n = 0
        with self._cond:
            if not self._queue:
                self._cond.wait(timeout)
            while self._queue and (not out or n + self._queue[0][2] <= limit):
                recs, offsets, count = self._queue.popleft()
                self._queued_records -= count
                self._handed.update(offsets)
                out.extend(recs)
                n += count
            self._cond.notify_all()
        self.records += n
        return out

    def catch_up(self, timeout: float) -> None:
        """Wait up to ``timeout`` while the reader's last poll took its whole budget (more is on the bus)
        and its queue has room: a record not read cannot be judged (a run's record behind a flood)."""
        with self._cond:
            self._cond.wait_for(
                lambda: not self._saturated or self._queued_records >= self.queue_records or self._stop.is_set(),
                timeout,
            )

    def health(self) -> dict[str, Any]:
        """The source's fields of the pipeline's view (see :class:`~sdcwatch.service.bus.Source`)."""
        counts = self.gaps.counts
        return {
            "dead_letters_total": self.dead_letters,
            "dead_letter_reasons": dict(self.dead_letter_reasons),
            "auth_runs_refused": dict(self.ingest.auth.refused) if self.ingest.auth is not None else {},
            "auth_redelivered": dict(self.ingest.auth.redelivered) if self.ingest.auth is not None else {},
            "consumer_partitions": self.partitions,
            "consumer_rebalances_total": self.rebalances,
            "waiting_for_schema": self.ingest.pending,
            "offset_gaps": {k: int(counts[k]) for k in ("refetched", "filled", "skipped")},
        }

    @property
    def assigned(self) -> bool:
        """Whether this member has joined its group and owns partitions (records can flow)."""
        return self.partitions > 0

    def commit(self, timeout: float = 10.0) -> None:
        """Commit everything returned by ``poll`` so far (call after processing it)."""
        if not self.owns_topic:  # a member sharing its group keeps the offsets for the one that stays
            return
        with self._cond:
            offsets = dict(self._handed)
        if offsets:
            self._on_reader(lambda: self._commit(offsets), timeout, "offset commit")

    def positions(self) -> dict[int, int]:
        """The offset after what ``poll`` returned, by partition: what ``commit`` commits."""
        with self._cond:
            return {tp.partition: offset for tp, offset in self._handed.items()}

    def lag(self) -> int:
        """Messages between what this service processed and the end of the topic (refreshed by the
        reader; the group's lag from its committed offsets while this member owns no partitions)."""
        return self._lag

    def dead_letter(self, records: Sequence[Record], reason: str, why: str) -> None:
        """Route records the pipeline refused to the dead-letter topic, :data:`DEAD_LETTER_BATCH` a
        message (a flood costs the loop a few sends, not one each); each record is counted."""
        for i in range(0, len(records), DEAD_LETTER_BATCH):
            part = records[i : i + DEAD_LETTER_BATCH]
            value = encode(part[0]) if len(part) == 1 else encode_batch(part)
            self._send_dead_letter(None, value, reason, why, "pipeline")
        with self._cond:
            self._count_dead_letter(reason, len(records))

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=self._max_poll_interval + 10)
        try:
            self._dl_producer.close(timeout=5)
        finally:
            self._consumer.close()

    # -- the reader thread ----------------------------------------------------------------------

    def _on_reader(self, fn: Callable[[], None], timeout: float, what: str) -> None:
        """Run ``fn`` on the reader thread (which owns the consumer) and wait for it."""
        done = threading.Event()
        with self._cond:
            self._requests.append((fn, done))
        if not done.wait(timeout):
            log.warning("%s: the reader did not answer within %.0fs", what, timeout)

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self._read_once()
            except Exception:  # the reader must outlive any one failure
                log.exception("group %s: reading %s failed; retrying", self.group, self.topic)
                self._stop.wait(1.0)

    def _read_once(self) -> None:
        while True:
            with self._cond:
                if not self._requests:
                    break
                fn, done = self._requests.popleft()
            try:
                fn()
            finally:
                done.set()
        consumer = self._consumer
        parts = consumer.assignment()
        with self._cond:
            full = self._queued_records >= self.queue_records
        if full:
            consumer.pause(*parts)
        elif consumer.paused():
            consumer.resume(*consumer.paused())
        self._learn_positions(parts)
        budget = self.poll_budget()
        batches = consumer.poll(timeout_ms=100 if not full else 50, max_records=budget)
        started = time.monotonic()
        saturated = sum(map(len, batches.values())) >= budget
        self._track_assignment()
        batches = self.gaps.refetch(consumer, batches, started)
        offsets: dict[Any, int] = {}
        out, rejected = decode_batch(
            (
                (f"{tp.topic}/{tp.partition}/{msg.offset}", msg.key, msg.value)
                for tp, msgs in batches.items()
                for msg in msgs
            ),
            self.decode,
            self.ingest,
        )
        for rj in rejected:
            log.debug("dead letter %s: %s", rj.origin, rj.reason)
            self._send_dead_letter(rj.key, rj.value, rj.code, rj.reason, rj.origin)
            with self._cond:
                self._count_dead_letter(rj.code)
        for tp, msgs in batches.items():
            if msgs:
                offsets[tp] = msgs[-1].offset + 1
        if offsets:
            count = count_records(out)
            with self._cond:
                self._queue.append((out, offsets, count))
                self._queued_records += count
                self._cond.notify_all()
            taken = sum(map(len, batches.values()))
            cost = (time.monotonic() - started) / taken
            self.message_cost = max(cost, 0.7 * self.message_cost + 0.3 * cost)  # up at once, down slowly
        with self._cond:
            self._saturated = saturated
            self._cond.notify_all()
        if time.monotonic() - self._lag_at >= self.lag_interval:
            self._refresh_lag()

    def poll_budget(self) -> int:
        """Messages the reader's next poll may take: ``max_poll_records``, or fewer when they cost
        more than :data:`POLL_WORK_SHARE` of the max poll interval (at least 100)."""
        if self.message_cost <= 0.0:  # nothing read yet: a first poll of a flood is a small one
            return min(self.max_poll_records, 1000)
        fits = int(POLL_WORK_SHARE * self._max_poll_interval / self.message_cost)
        return max(100, min(self.max_poll_records, fits))

    def _learn_positions(self, parts: Any) -> None:
        """The fetch position of each newly assigned partition (where its first message must be),
        asked once per assignment, briefly: the reader must keep polling to stay in its group."""
        self.gaps.keep_only(parts)
        self._positioned &= set(parts)
        for tp in parts:
            if tp in self._positioned:
                continue
            self._positioned.add(tp)
            try:
                position = self._consumer.position(tp, timeout_ms=1000)
            except Exception as exc:
                log.debug("position of %s unknown: %s", tp, exc)
                continue
            if position is not None:
                self.gaps.expect(tp, position)

    def _track_assignment(self) -> None:
        parts = sorted(tp.partition for tp in self._consumer.assignment())
        if self._sole_after is not None:
            self._check_sole(parts)
        if parts == self._assignment:
            return
        if self._had_partitions:  # the first join is not a rebalance
            self.rebalances += 1
        self._assignment = parts
        # positions after a rebalance are the group's committed offsets, not where this member
        # stopped: learn them afresh
        self.gaps.keep_only(())
        self._positioned.clear()
        self.partitions = len(parts)
        if parts:
            self._had_partitions = True
            self.unassigned_since = None
            log.info("group %s: assigned partitions %s of %s", self.group, parts, self.topic)
        else:
            self.unassigned_since = time.monotonic()
            if self._had_partitions:
                log.warning(
                    "group %s: this member lost its partitions of %s (evicted from the group or a "
                    "rebalance); no records flow until it is assigned again",
                    self.group,
                    self.topic,
                )

    def _check_sole(self, parts: list[int]) -> None:
        """Whether this member owns the whole topic; a member that never did and has held part of it
        for ``sole_member_after_s`` shares its group: :attr:`shared` says why and what to do."""
        total = len(self._consumer.partitions_for_topic(self.topic) or ())
        self.owns_topic = bool(parts) and len(parts) >= total
        now = time.monotonic()
        if self.owns_topic or not parts:  # the whole topic, or none (a standby, or joining)
            self._whole_once = self._whole_once or self.owns_topic
            self._partial_since = None
            return
        if self._partial_since is None:
            self._partial_since = now
        # of members that joined together (none ever whole), the one holding partition 0 stays: it waits
        # until the others have left and the group has rebalanced (within a max poll interval)
        late = 2 * self._max_poll_interval if 0 in parts else 0.0
        if now - self._partial_since < self._sole_after + late or self.shared:
            return
        why = (
            f"group {self.group}: this instance has held only partitions {parts} of the {total} of "
            f"{self.topic} for {now - self._partial_since:.0f} s: another instance shares its consumer group"
        )
        if self._whole_once:  # the instance that was here first stays (the newcomer leaves)
            log.error("%s; it should leave (stage both and temporal: one instance per group)", why)
            self._partial_since = now
            return
        self.shared = (
            f"{why}. This stage reads the whole topic (a run's 16-step windows are spread over the "
            f"partitions, and its end-of-run markers reach only one instance): run one instance per group, "
            f"give this one its own --bus-group, or scale out with --stage spatial (several per group) and "
            f"one --stage temporal. Leaving without committing, so the other instance re-reads what this one took"
        )
        log.error("%s", self.shared)
        with self._cond:
            self._cond.notify_all()

    def _commit(self, offsets: dict[Any, int]) -> None:
        from kafka.structs import OffsetAndMetadata

        if time.monotonic() < self._commit_after:  # the group is rebalancing: polls (the join) come first
            return
        owned = self._consumer.assignment()
        mine = {tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items() if tp in owned}
        try:
            if self.dead_letters:
                self._dl_producer.flush(timeout=2)
            if mine:
                self._consumer.commit(mine, timeout_ms=2000)
        except Exception as exc:  # a failed commit means redelivery, which dedup absorbs
            log.warning("offset commit failed (records may be redelivered): %s", exc)
            # back to polling: a commit retried at every snapshot would starve the rejoin it waits for
            self._commit_after = time.monotonic() + 2 * self._max_poll_interval

    def _refresh_lag(self) -> None:
        self._lag_at = time.monotonic()
        consumer = self._consumer
        try:
            parts = consumer.assignment()
            if parts:
                ends = consumer.end_offsets(list(parts))
                with self._cond:
                    handed = dict(self._handed)
                lag = 0
                for tp in parts:
                    done = handed.get(tp)
                    if done is None:  # the fetch position: asking the group's committed offset (an
                        # OffsetFetch) in the middle of a rebalance makes kafka-python join again, forever
                        done = consumer.position(tp)
                    # the end as the fetches saw it too: the embedded broker's ListOffsets answers
                    # the last-written batch's first offset + 1, short of the end
                    end = max(ends[tp], consumer.highwater(tp) or 0)
                    lag += max(0, end - done)
                self._lag = int(lag)
            elif self._had_partitions and time.monotonic() - (self.unassigned_since or 0) > self._max_poll_interval:
                # lost its partitions and not back within a rebalance: the group's lag from its
                # committed offsets, not a reassuring 0 (never during a join: these calls would stall it)
                from kafka.structs import TopicPartition

                ids = consumer.partitions_for_topic(self.topic) or ()
                tps = [TopicPartition(self.topic, p) for p in ids]
                if tps:
                    ends = consumer.end_offsets(tps)
                    self._lag = int(sum(max(0, ends[tp] - (consumer.committed(tp, timeout_ms=500) or 0)) for tp in tps))
                self._lag_at = time.monotonic() + 4 * self.lag_interval  # at most every few seconds
        except Exception as exc:
            log.debug("lag unavailable: %s", exc)

    def _send_dead_letter(self, key: bytes | None, value: bytes | None, reason: str, why: str, origin: str) -> None:
        body, headers = dead_letter_value(value)
        try:
            self._dl_producer.send(
                self.deadletter_topic,
                key=key,
                value=body,
                headers=[
                    ("sdcwatch.reason", why.encode()),
                    ("sdcwatch.reason_code", reason.encode()),
                    ("sdcwatch.origin", origin.encode()),
                    *headers,
                ],
            )
        except Exception as exc:  # the count stays; the service must keep going
            log.warning("could not dead-letter %s: %s", origin, exc)


class TopicReader:
    """Every partition of one topic, read whole without a consumer group, from its start or its end
    (``sdcwatch capture``, ``sdcwatch incidents``), re-fetching offset gaps as :class:`KafkaSource` does.

    :class:`TransportError` names the address when no broker answers within ``connect_timeout``
    seconds. ``consumer``: an open kafka-python consumer to read through instead (a test's).
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        from_beginning: bool,
        connect_timeout: float = 10.0,
        gap_wait_s: float = GAP_WAIT_S,
        consumer: Any = None,
        **security: Any,
    ) -> None:
        from kafka import TopicPartition

        self.topic = topic
        self.bootstrap = bootstrap
        self.from_beginning = from_beginning
        self.gaps = OffsetGaps(gap_wait_s)
        self._partition = TopicPartition
        self._parts: list[Any] = []
        self._existed: bool | None = None  # whether the topic existed at the first look
        self._consumer = consumer if consumer is not None else self._connect(connect_timeout, security)

    def _connect(self, connect_timeout: float, security: dict[str, Any]) -> Any:
        from kafka.errors import KafkaError

        try:
            return new_consumer(
                self.bootstrap,
                security=security_settings(security),
                group_id=None,
                enable_auto_commit=False,
                fetch_max_wait_ms=200,
                max_partition_fetch_bytes=16 << 20,  # whole batches of the largest telemetry messages
                bootstrap_timeout_ms=int(connect_timeout * 1000),
            )
        except (KafkaError, OSError, ValueError) as exc:
            raise TransportError(
                f"cannot reach Kafka at {self.bootstrap} within {connect_timeout:g} s ({exc})"
            ) from None

    def assign(self) -> bool:
        """Take every partition of the topic once it exists; False while it does not."""
        if self._parts:
            return True
        parts = self._consumer.partitions_for_topic(self.topic)
        if self._existed is None:
            self._existed = bool(parts)
        if not parts:
            return False
        self._parts = [self._partition(self.topic, p) for p in sorted(parts)]
        self._consumer.assign(self._parts)
        if self.from_beginning or not self._existed:  # a topic that appeared since holds only new records
            self._consumer.seek_to_beginning(*self._parts)
        else:
            self._consumer.seek_to_end(*self._parts)
        for tp in self._parts:  # resolved now: records sent from here on are read, and gaps seen
            position = self._consumer.position(tp)
            if position is not None:
                self.gaps.expect(tp, position)
        return True

    def poll_messages(self, timeout: float) -> list[Any]:
        """The next messages (kafka-python's, with their offset and timestamp), partition by
        partition in offset order, never past a gap that is still being re-fetched."""
        if not self.assign():
            time.sleep(timeout)
            return []
        batches = self._consumer.poll(timeout_ms=int(timeout * 1000), max_records=10_000)
        held = self.gaps.refetch(self._consumer, batches, time.monotonic())
        return [m for msgs in held.values() for m in msgs]

    def poll(self, timeout: float) -> list[bytes | None]:
        """The values of the next messages (:meth:`poll_messages`)."""
        return [m.value for m in self.poll_messages(timeout)]

    def at_end(self) -> bool:
        """Whether everything on the topic so far has been read."""
        return self.past(self.end_mark())

    def end_mark(self) -> dict[Any, int]:
        """The end offset of every partition now: what the topic holds so far."""
        return dict(self._consumer.end_offsets(self._parts)) if self._parts else {}

    def past(self, mark: dict[Any, int]) -> bool:
        """Whether every partition has been read up to ``mark`` (from :meth:`end_mark`)."""
        return all(self._consumer.position(tp) >= end for tp, end in mark.items())

    def close(self) -> None:
        self._consumer.close()
