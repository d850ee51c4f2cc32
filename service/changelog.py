"""The state changelog: the pipeline's snapshots in a compacted Kafka topic, so an instance on another
machine resumes a run's history; and the choice at start between the state file and the topic.

A snapshot is zlib-compressed JSON in chunks under the broker's message limit, each acknowledged
before the manifest that names them (a reader never takes half a snapshot); the chunks of the
snapshot before are tombstoned after. With job keys the manifest and the journal are signed with the
service's own key; a snapshot refused (unsigned, stamped in the future, older than one the service
wrote, its manifest deleted) gives way to a good state file (docs/service.md, "Older snapshots and tombstones").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from sdcwatch.core.errors import ConfigError, TransportError
from sdcwatch.core.kafka import new_admin, new_consumer, new_producer, security_settings
from sdcwatch.core.signing import AuthError, JobKey
from sdcwatch.core.validate import check_int
from sdcwatch.service.statefile import restore_faults, state_to_resume

__all__ = ["FORMAT", "FUTURE_SKEW_S", "ChangelogSnapshot", "StateChangelog", "resume_state"]

log = logging.getLogger("sdcwatch.service.changelog")

#: What a manifest says it is; a manifest of another format is refused, never guessed at.
FORMAT = "sdcwatch.state-changelog/1"
#: Chunk size when the broker does not say its limit: under Kafka's default message.max.bytes (1 MiB).
DEFAULT_CHUNK_BYTES = 900_000
_OVERHEAD = 16_384  # a record batch's headers and the key, below the broker's limit
#: Seconds a snapshot's stamp may be ahead of this machine's clock (a guard's skew for decisions).
FUTURE_SKEW_S = 30.0


@dataclass(frozen=True)
class ChangelogSnapshot:
    """One complete snapshot read back from the topic."""

    state: dict[str, Any]  # what DetectionPipeline.snapshot gave
    schemas: dict | None  # the wire-v2 record layouts the source had learnt
    written_at: float  # wall-clock time the writer took the snapshot
    snapshot: str  # its id
    size: int  # compressed bytes
    journal: dict | None = None  # the incident changes the writer had announced since (its journal)


class StateChangelog:
    """Snapshots of one consumer group's stage in the compacted topic ``topic``.

    The manifest's key is ``m:<stage>:<group>``, a chunk's ``c:<stage>:<snapshot>:<index>:<group>``;
    everything goes to partition 0, so a reader sees chunks before their manifest. ``chunk_bytes``
    None takes the topic's ``max.message.bytes`` (less room for the batch) when the broker says it,
    else :data:`DEFAULT_CHUNK_BYTES`. The topic is created (cleanup.policy=compact) if missing.
    ``key``: the service's own key (``Keyring.service_key``): the manifest and the journal are signed
    with it, and refused on read when they are not. None: unsigned, as without job keys.

    ``source_topic``: the topic the group reads. A manifest records where the snapshot's reading
    stood (``read_to``: the offsets committed after it); one behind what the group committed there is
    older than a snapshot the service wrote since, and is refused, as is an older one re-published
    over a newer one still on the log; a tombstone of the manifest (the service writes none) is
    ignored. ``refused`` counts both by reason (``older``, ``deleted``).
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        group: str,
        stage: str,
        security: Mapping[str, Any] | None = None,
        chunk_bytes: int | None = None,
        timeout: float = 10.0,
        key: JobKey | None = None,
        source_topic: str | None = None,
    ) -> None:
        if chunk_bytes is not None:
            check_int("state.topic.chunk_bytes", chunk_bytes, lo=1024)
        self.bootstrap, self.topic, self.group, self.stage = bootstrap, topic, group, stage
        self.security = security_settings(security or {})
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.key, self.source_topic = key, source_topic
        self.refused: Counter[str] = Counter()
        self._reached: dict[int, int] | None = None  # read_to: the group's offsets at start, then each snapshot's
        self._producer: Any = None
        self._live: set[bytes] = set()  # chunk keys of ours no newer manifest needs: tombstoned after the next one
        self.manifest_key = f"m:{stage}:{group}".encode()
        self.journal_key = f"j:{stage}:{group}".encode()
        self.host_states: dict[str, dict] = {}  # the host ledger's states read from the topic (key h:<host>)

    def write_journal(self, entries: Mapping[str, float]) -> None:
        """The incident changes announced since the last snapshot (the service's journal), acknowledged:
        an instance that takes over elsewhere does not announce them again. TransportError on failure."""
        body = {"entries": dict(entries), "group": self.group, "stage": self.stage}
        self._send("journal", [(self.journal_key, body)])

    def write_hosts(self, states: Mapping[str, dict | None]) -> None:
        """The host ledger's changed hosts, one record each keyed ``h:<host>`` (None: a tombstone),
        shared by every group and stage: an instance elsewhere adopts them. TransportError on failure."""
        self._send("host states", [(f"h:{host}".encode(), d) for host, d in states.items()])

    def _send(self, what: str, records: list[tuple[bytes, dict | None]]) -> None:
        """``records`` (key, JSON object sealed with our key; None: a tombstone), each acknowledged;
        TransportError naming ``what`` on failure."""
        from kafka.errors import KafkaError

        try:
            producer = self._open()
            values = [(key, None if d is None else self._seal(_json(d))) for key, d in records]
            self._wait(producer, [producer.send(self.topic, key=k, value=v, partition=0) for k, v in values])
        except (KafkaError, OSError, ValueError) as exc:
            raise TransportError(f"state topic {self.topic}: {what} not written ({exc})") from None

    def _host_state(self, key: bytes, value: bytes | None) -> None:
        """Keep one ``h:<host>`` record read from the topic (one not signed with our key is ignored)."""
        host = key[2:].decode("utf-8", "replace")
        try:
            state = None if value is None else json.loads(self._unseal(value))
        except ValueError as exc:
            log.warning("state topic %s: host %.64r refused (%s): ignored", self.topic, host, exc)
            return
        if isinstance(state, dict):
            self.host_states[host] = state
        else:
            self.host_states.pop(host, None)

    def _seal(self, value: bytes) -> bytes:
        return value if self.key is None else self.key.sign(value)

    def _unseal(self, value: bytes) -> bytes:
        """``value`` opened with the service's key; ValueError when it was not signed with it."""
        if self.key is None:
            return value
        try:
            return self.key.open(value)
        except AuthError as exc:
            raise ValueError(f"not signed with this service's key: {exc.problem}") from None

    def _chunk_key(self, snapshot: str, index: int) -> bytes:
        return f"c:{self.stage}:{snapshot}:{index}:{self.group}".encode()

    def _ours(self, key: bytes) -> bool:
        parts = key.decode("utf-8", "replace").split(":", 4)
        return len(parts) == 5 and parts[0] == "c" and parts[1] == self.stage and parts[4] == self.group

    # -- writing --------------------------------------------------------------------------------

    def write(
        self, state: dict[str, Any], schemas: dict | None = None, read_to: Mapping[int, int] | None = None
    ) -> None:
        """Write one snapshot: its chunks, each acknowledged, then its manifest, which records
        ``read_to`` (the source topic's offsets by partition, committed after it). TransportError
        when the bus does not take it (the manifest before stays the one a reader takes)."""
        from kafka.errors import KafkaError

        if self._reached is None:  # not read at start (--state-reset): from where the group stands
            self._reached = self._committed()
        reached = dict(self._reached)  # a partition not read since the start keeps its committed offset
        for p, o in (read_to or {}).items():
            reached[int(p)] = max(reached.get(int(p), 0), int(o))
        body = json.dumps({"state": state, "schemas": schemas}, separators=(",", ":"), allow_nan=False).encode()
        blob = zlib.compress(body)
        snapshot = f"{time.time_ns():x}{uuid.uuid4().hex[:6]}"
        try:
            producer = self._open()
            size = self._limit()
            keys = [self._chunk_key(snapshot, i) for i in range(max(1, -(-len(blob) // size)))]
            sent = [
                producer.send(self.topic, key=k, value=blob[i * size : (i + 1) * size], partition=0)
                for i, k in enumerate(keys)
            ]
            self._wait(producer, sent)
            manifest = {
                "format": FORMAT,
                "snapshot": snapshot,
                "chunks": len(keys),
                "bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest(),
                "written_at": time.time(),
                "group": self.group,
                "stage": self.stage,
                "read_to": {str(p): o for p, o in reached.items()},
            }
            sealed = self._seal(_json(manifest))
            self._wait(producer, [producer.send(self.topic, key=self.manifest_key, value=sealed, partition=0)])
        except (KafkaError, OSError, ValueError) as exc:
            raise TransportError(f"state topic {self.topic}: snapshot not written ({exc})") from None
        for key in self._live:  # the snapshot before is no longer needed: compaction drops it
            with contextlib.suppress(KafkaError, OSError, ValueError):
                producer.send(self.topic, key=key, value=None, partition=0)
        self._live, self._reached = set(keys), reached

    def _open(self) -> Any:
        if self._producer is None:
            self._ensure_topic()
            self.chunk_bytes = self._limit()
            self._producer = new_producer(
                self.bootstrap,
                self.security,
                acks="all",
                linger_ms=0,
                max_block_ms=int(self.timeout * 1000),
                request_timeout_ms=int(self.timeout * 1000),
                max_request_size=self.chunk_bytes + _OVERHEAD,
            )
        return self._producer

    def _wait(self, producer: Any, futures: list) -> None:
        """Every send acknowledged within the timeout, or the first failure raised."""
        deadline = time.monotonic() + self.timeout
        producer.flush(timeout=self.timeout)
        for fut in futures:
            fut.get(timeout=max(0.1, deadline - time.monotonic()))

    def _ensure_topic(self) -> None:
        """Create the topic, compacted, unless it exists; an admin API that does not answer is not
        fatal here (a broker that creates topics on first use still takes the snapshots)."""
        from kafka.admin import NewTopic
        from kafka.errors import KafkaError, TopicAlreadyExistsError

        try:
            ms = int(self.timeout * 1000)
            admin = new_admin(self.bootstrap, self.security, request_timeout_ms=ms, bootstrap_timeout_ms=ms)
        except (KafkaError, OSError, ValueError) as exc:
            raise TransportError(f"state topic {self.topic}: cannot reach Kafka at {self.bootstrap}: {exc}") from None
        try:
            if self.topic not in set(admin.list_topics()):
                with contextlib.suppress(TopicAlreadyExistsError):
                    admin.create_topics([NewTopic(self.topic, 1, 1, topic_configs={"cleanup.policy": "compact"})])
                log.info("created the compacted state topic %s", self.topic)
            self._limit_from(admin)
        except KafkaError as exc:
            log.warning("state topic %s: could not check or create it (%s)", self.topic, exc)
        finally:
            admin.close()

    def _limit_from(self, admin: Any) -> None:
        """The topic's ``max.message.bytes``, when the broker describes it, as the chunk size."""
        from kafka.admin import ConfigResource, ConfigResourceType

        if self.chunk_bytes is not None:
            return
        try:
            answer = admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, self.topic, {"max.message.bytes": None})], config_filter="all"
            )
            value = answer.get("topic", {}).get(self.topic, {}).get("max.message.bytes", {}).get("value")
            if value is not None and str(value).isdigit():
                self.chunk_bytes = max(1024, int(value) - _OVERHEAD)
        except Exception as exc:  # a broker that does not describe configs: the default size
            log.debug("max.message.bytes of %s unknown: %s", self.topic, exc)

    def _limit(self) -> int:
        return self.chunk_bytes or DEFAULT_CHUNK_BYTES

    # -- reading --------------------------------------------------------------------------------

    def read(self) -> ChangelogSnapshot | None:
        """The newest complete snapshot of this group's stage, None when the topic holds none or only
        one refused as older or deleted (logged, counted in ``refused``); ConfigError naming the
        topic, the key and the way out when it is damaged."""
        manifest, newest, chunks, journal, deleted = self._scan()
        self._live = {k for k in chunks if self._ours(k)}  # tombstoned after our first snapshot
        committed = self._reached = self._committed()
        where = f"state topic {self.topic}, key {self.manifest_key.decode()}"
        if deleted:  # not the service's: it never deletes its manifest
            self.refused["deleted"] += 1
            log.warning("%s: a tombstone deleted the snapshot (the service writes none): ignored", where)
        if manifest is None:
            if committed:
                log.warning(
                    "%s: no snapshot, though group %s read %s to %s", where, self.group, self.source_topic, committed
                )
            return None
        try:
            meta = self._manifest(manifest)
            whole = newest is not None and all(
                chunks.get(self._chunk_key(newest["snapshot"], i)) is not None for i in range(int(newest["chunks"]))
            )
            if whole and newest["written_at"] > meta["written_at"]:
                self._older(where, meta, f"snapshot {newest['snapshot']}, still on the topic, is taken")
                meta = newest
            read_to = {int(p): int(o) for p, o in (meta.get("read_to") or {}).items()}
            behind = {p: (read_to.get(p, 0), o) for p, o in committed.items() if read_to.get(p, 0) < o}
            if behind:  # the group commits only after a snapshot: a later one was written
                at = ", ".join(f"partition {p} at {o}, the snapshot's {r}" for p, (r, o) in behind.items())
                self._older(where, meta, f"group {self.group} committed {self.source_topic} past it: {at}")
                return None
            snapshot, n = str(meta["snapshot"]), int(meta["chunks"])
            keys = [self._chunk_key(snapshot, i) for i in range(n)]
            missing = [i for i, k in enumerate(keys) if chunks.get(k) is None]
            if missing:
                raise ValueError(
                    f"snapshot {snapshot} lists {n} chunk(s); {len(missing)} missing (first: {missing[0]})"
                )
            blob = b"".join(chunks[k] for k in keys)
            if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
                raise ValueError(f"snapshot {snapshot}: its chunks do not match the manifest's checksum")
            body = json.loads(zlib.decompress(blob))
            if not isinstance(body, dict) or not isinstance(body.get("state"), dict):
                raise ValueError(f"snapshot {snapshot} holds no state object")
        except (ValueError, KeyError, TypeError, zlib.error) as exc:
            raise ConfigError("state.topic", f"{where}: not a valid snapshot ({exc}){_RECOVERY}") from None
        self._reached = {p: max(o, committed.get(p, 0)) for p, o in {**committed, **read_to}.items()}
        return ChangelogSnapshot(
            body["state"], body.get("schemas"), float(meta["written_at"]), snapshot, len(blob), self._entries(journal)
        )

    def _manifest(self, value: bytes) -> dict:
        """A manifest's fields, checked (ours, signed with our key, not stamped ahead); ValueError."""
        meta = json.loads(self._unseal(value))
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"not a manifest of {FORMAT}")
        if (meta.get("group"), meta.get("stage")) != (self.group, self.stage):
            raise ValueError(f"written for group {meta.get('group')!r}, stage {meta.get('stage')!r}")
        meta["written_at"] = float(meta["written_at"])
        ahead = meta["written_at"] - time.time()
        if ahead > FUTURE_SKEW_S:
            raise ValueError(f"stamped {ahead:.0f} s in the future (more than {FUTURE_SKEW_S:g} s ahead)")
        return meta

    def _older(self, where: str, meta: dict, why: str) -> None:
        self.refused["older"] += 1
        log.warning(
            "%s: snapshot %s (written %.1f s ago) is older than one the service wrote since (re-published?): "
            "refused (%s)",
            where,
            meta["snapshot"],
            time.time() - meta["written_at"],
            why,
        )

    def _committed(self) -> dict[int, int]:
        """The offsets the group committed on ``source_topic``, by partition ({} when there is none or
        they cannot be read, logged: an older snapshot is then told only by a newer one on the log)."""
        from kafka.errors import KafkaError

        if self.source_topic is None:
            return {}
        try:
            ms = int(self.timeout * 1000)
            admin = new_admin(self.bootstrap, self.security, request_timeout_ms=ms, bootstrap_timeout_ms=ms)
            try:
                offsets = admin.list_group_offsets(self.group).get(self.group) or {}
            finally:
                admin.close()
        except (KafkaError, OSError, ValueError) as exc:
            log.warning("state topic %s: the offsets group %s committed are unknown (%s)", self.topic, self.group, exc)
            return {}
        return {
            tp.partition: om.offset for tp, om in offsets.items() if tp.topic == self.source_topic and om.offset >= 0
        }

    def _entries(self, journal: bytes | None) -> dict | None:
        """A journal's entries ({change key: wall time}); None for none, or one damaged or not signed
        with the service's key (which costs at most a repeated alert, never the resume)."""
        if journal is None:
            return None
        try:
            body = json.loads(self._unseal(journal))
            if (body.get("group", self.group), body.get("stage", self.stage)) != (self.group, self.stage):
                raise ValueError("written for another group or stage")
            entries = body["entries"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("state topic %s: the journal of announced incidents is refused (%s): ignored", self.topic, exc)
            return None
        return entries if isinstance(entries, dict) else None

    def _scan(self) -> tuple[bytes | None, dict | None, dict[bytes, bytes], bytes | None, bool]:
        """The topic read whole: the latest manifest of ours (a tombstone skipped), the valid one
        written last (its fields), every live chunk (tombstones applied), the latest journal of
        ours, and whether the manifest's last record is a tombstone."""
        from kafka import TopicPartition
        from kafka.errors import KafkaError

        manifest: bytes | None = None
        newest: dict | None = None
        deleted = False
        journal: bytes | None = None
        chunks: dict[bytes, bytes | None] = {}
        try:
            consumer = new_consumer(
                self.bootstrap,
                security=self.security,
                group_id=None,
                enable_auto_commit=False,
                fetch_max_wait_ms=100,
                max_partition_fetch_bytes=64 << 20,
                request_timeout_ms=int(self.timeout * 1000) + 1000,
                bootstrap_timeout_ms=int(self.timeout * 1000),
            )
        except (KafkaError, OSError, ValueError) as exc:
            raise TransportError(f"state topic {self.topic}: cannot reach Kafka at {self.bootstrap}: {exc}") from None
        try:
            ids = consumer.partitions_for_topic(self.topic)
            if not ids:
                return None, None, {}, None, False
            parts = [TopicPartition(self.topic, p) for p in sorted(ids)]
            consumer.assign(parts)
            consumer.seek_to_beginning(*parts)
            for msg in _read_to_end(consumer, parts, self.timeout * 3):
                if msg.key == self.manifest_key:
                    deleted = msg.value is None
                    if not deleted:
                        manifest = msg.value
                        with contextlib.suppress(ValueError, KeyError, TypeError):  # refused in read() if last
                            meta = self._manifest(msg.value)
                            if newest is None or meta["written_at"] > newest["written_at"]:
                                newest = meta
                elif msg.key == self.journal_key:
                    journal = msg.value
                elif msg.key is not None and msg.key.startswith(b"c:"):
                    chunks[msg.key] = msg.value
                elif msg.key is not None and msg.key.startswith(b"h:"):
                    self._host_state(msg.key, msg.value)
        except KafkaError as exc:
            raise TransportError(f"state topic {self.topic}: cannot be read ({exc})") from None
        finally:
            consumer.close()
        return manifest, newest, {k: v for k, v in chunks.items() if v is not None}, journal, deleted

    def restoring(self) -> contextlib.AbstractContextManager:
        """Turn any fault met while restoring a snapshot from the topic into one ConfigError."""
        where = f"state topic {self.topic}, key {self.manifest_key.decode()}"
        return restore_faults("state.topic", where, "the snapshot", _RECOVERY)

    def close(self) -> None:
        if self._producer is not None:
            with contextlib.suppress(Exception):
                self._producer.close(timeout=5)
            self._producer = None


_RECOVERY = "; start with --state-reset to begin afresh (the next snapshot replaces it)"


def _without_way_out(exc: ConfigError) -> str:
    """What is wrong, without the "start with --state-reset" an error adds: the other state is taken."""
    return exc.problem.split("; start with --state-reset", 1)[0]


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _read_to_end(consumer: Any, parts: list, timeout: float) -> Iterator[Any]:
    """Every message of ``parts`` from where the consumer stands to the end seen now, in offset order."""
    deadline = time.monotonic() + timeout
    ends = consumer.end_offsets(parts)
    while True:
        batches = consumer.poll(timeout_ms=200)
        for tp in parts:
            yield from batches.get(tp, ())
        # the end as the fetches saw it too (the embedded broker's ListOffsets can answer short)
        done = all(consumer.position(tp) >= max(ends[tp], consumer.highwater(tp) or 0) for tp in parts)
        if done and not batches:
            return
        if time.monotonic() > deadline:
            raise TransportError(f"reading {parts[0].topic} to its end took over {timeout:.0f} s")


def resume_state(
    pipeline: Any, path: str | os.PathLike, changelog: StateChangelog | None = None
) -> tuple[str | None, ChangelogSnapshot | None]:
    """Restore ``pipeline`` from the newer of the state file ``path`` (its ``.prev`` when only that is
    left, logged; its time: when it was written) and ``changelog``'s snapshot (its signed ``written_at``),
    saying which in a log line; (where the state came from: "file", "topic" or None, the topic's snapshot
    when taken). A refused or damaged one of the two gives way to the other when that one is good, in
    one log line; ConfigError naming it when there is no other. Then the host states on the topic
    (every instance's) are adopted by the ledger."""
    path = Path(path)
    found = state_to_resume(path)
    snap, refused, taken = None, None, None
    if changelog is not None:
        try:
            snap = changelog.read()
        except ConfigError as exc:
            refused = exc
    try:
        file_time: float | None = found.stat().st_mtime
    except OSError:
        file_time = None
    if snap is not None and (file_time is None or file_time < snap.written_at):
        try:
            with changelog.restoring():
                pipeline.restore(snap.state)
            taken = "topic"
        except ConfigError as exc:
            if file_time is None:
                raise
            snap, refused = None, exc  # the file's restore replaces what this one restored
    if taken is None:
        if refused is not None and file_time is None:
            raise refused
        if found != path:
            log.warning(
                "state file %s is missing: resuming from %s, the snapshot before it (written %.1f s ago); "
                "what was read between that snapshot and the lost one is not read again",
                path,
                found,
                max(0.0, time.time() - found.stat().st_mtime),
            )
        try:
            taken = "file" if pipeline.load(found) else None
        except ConfigError as bad:
            if snap is None:
                raise
            with changelog.restoring():
                pipeline.restore(snap.state)
            log.warning(
                "%s: resuming from the state topic's older snapshot instead (written %.1f s ago); the next "
                "snapshot replaces the file (the damaged one is kept as its .prev until the one after)",
                _without_way_out(bad),
                max(0.0, time.time() - snap.written_at),
            )
            taken = "topic"
        else:
            if refused is not None:
                log.warning(
                    "%s: resuming from the state file %s instead; the next snapshot replaces the topic's "
                    "(nothing to do)",
                    _without_way_out(refused),
                    found,
                )
            elif snap is not None:  # an older snapshot (re-published, or the topic behind) never wins
                log.info(
                    "resuming from the state file %s, the newer: the state topic's snapshot %s was written "
                    "%.1f s before it",
                    found,
                    snap.snapshot,
                    file_time - snap.written_at,
                )
            snap = None
    if taken is None and changelog is not None and changelog.refused:
        log.warning(
            "no state file at %s and the state topic's snapshot refused: starting cold (detectors warm up)", path
        )
    for host, d in (changelog.host_states if changelog is not None else {}).items():
        pipeline.hosts.adopt(host, d)
    return taken, snap
