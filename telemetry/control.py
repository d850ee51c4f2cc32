"""Control decisions: what the detector service asks the training job's guard to do.

The service publishes one JSON object per decision to the control topic (``sdcwatch.control``),
keyed by run; the guard on rank 0 of that run reads it (:class:`KafkaControl`, from a background
thread of its own) and the ranks agree on it at the next step boundary. This module owns the
wire format (:class:`Decision`, :func:`decode_decision`) so the service (producer) and the
training side (consumer) share one definition, and the readers the guard polls:
:class:`KafkaControl` for a real bus, :class:`MemoryControl` for tests and in-process loops.

A reader never raises into, or blocks, the training loop: a bus that cannot be reached, or a
malformed message, costs one warning (malformed ones are counted in ``rejected``) and training
continues with the local checks only.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from sdcwatch.core.errors import SdcwatchError
from sdcwatch.core.kafka import new_consumer
from sdcwatch.core.names import CONTROL_TOPIC

__all__ = [
    "CONTROL_TOPIC",
    "CONTROL_ACTIONS",
    "Decision",
    "ControlError",
    "decode_decision",
    "MemoryControl",
    "KafkaControl",
]

log = logging.getLogger("sdcwatch.telemetry.control")

#: Actions the service may ask for (the guard's local checks add ``rerun`` on their own).
CONTROL_ACTIONS = ("skip", "rollback", "evict")
_MAX_RANKS = 64
_MAX_TEXT = 1024


class ControlError(SdcwatchError, ValueError):
    """A control message that is not a valid decision; names the field."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        super().__init__(f"control decision: {key}: {problem}")


@dataclass(frozen=True)
class Decision:
    """One decision for one run: ``action`` on ``ranks`` (empty: the run as a whole).

    ``since_step`` is the first step the problem was seen at: a rollback goes to a snapshot
    taken before it. ``lr_factor`` scales the learning rate after a rollback (1.0: unchanged).
    """

    run: str
    action: str
    reason: str
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    since_step: int | None = None
    incident: str = ""
    lr_factor: float = 1.0
    issued_at: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        _check(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "action": self.action,
            "reason": self.reason,
            "ranks": list(self.ranks),
            "hosts": list(self.hosts),
            "since_step": self.since_step,
            "incident": self.incident,
            "lr_factor": self.lr_factor,
            "issued_at": self.issued_at,
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_dict(), allow_nan=False).encode("utf-8")


def _check(d: Decision) -> None:
    if not isinstance(d.run, str) or not d.run or len(d.run) > _MAX_TEXT:
        raise ControlError("run", f"must be a non-empty string, got {d.run!r}")
    if d.action not in CONTROL_ACTIONS:
        raise ControlError("action", f"must be one of {', '.join(CONTROL_ACTIONS)}, got {d.action!r}")
    if not isinstance(d.reason, str) or len(d.reason) > _MAX_TEXT:
        raise ControlError("reason", "must be a string of at most 1024 characters")
    if (
        not isinstance(d.ranks, tuple)
        or len(d.ranks) > _MAX_RANKS
        or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 1 << 24 for r in d.ranks)
    ):
        raise ControlError("ranks", f"must be at most {_MAX_RANKS} ranks in 0..2^24, got {d.ranks!r}")
    if not isinstance(d.hosts, tuple) or not all(isinstance(h, str) and len(h) <= 255 for h in d.hosts):
        raise ControlError("hosts", "must be a list of host names")
    if d.since_step is not None and (
        isinstance(d.since_step, bool) or not isinstance(d.since_step, int) or d.since_step < 0
    ):
        raise ControlError("since_step", f"must be a step >= 0 or null, got {d.since_step!r}")
    if (
        isinstance(d.lr_factor, bool)
        or not isinstance(d.lr_factor, (int, float))
        or not (math.isfinite(d.lr_factor) and 0 < d.lr_factor <= 1)
    ):
        raise ControlError("lr_factor", f"must be a number in (0, 1], got {d.lr_factor!r}")
    if d.action == "evict" and not d.ranks:
        raise ControlError("ranks", "an evict decision must name the rank(s) to evict")


def decode_decision(data: bytes | str | Mapping[str, Any]) -> Decision:
    """A :class:`Decision` from a control message; :class:`ControlError` naming what is wrong."""
    if isinstance(data, Mapping):
        obj: Any = data
    else:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ControlError("message", f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ControlError("message", f"must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - {
        "run",
        "action",
        "reason",
        "ranks",
        "hosts",
        "since_step",
        "incident",
        "lr_factor",
        "issued_at",
    }
    if unknown:
        raise ControlError(sorted(unknown)[0], "unknown field")
    for key in ("run", "action"):
        if key not in obj:
            raise ControlError(key, "is required")
    ranks, hosts = obj.get("ranks", []), obj.get("hosts", [])
    if not isinstance(ranks, list) or not isinstance(hosts, list):
        raise ControlError("ranks" if not isinstance(ranks, list) else "hosts", "must be a list")
    issued = obj.get("issued_at", 0.0)
    if isinstance(issued, bool) or not isinstance(issued, (int, float)):
        raise ControlError("issued_at", "must be a number")
    lr = obj.get("lr_factor", 1.0)
    return Decision(
        run=obj["run"],
        action=obj["action"],
        reason=obj.get("reason", ""),
        ranks=tuple(ranks),
        hosts=tuple(hosts),
        since_step=obj.get("since_step"),
        incident=str(obj.get("incident", ""))[:_MAX_TEXT],
        lr_factor=float(lr) if isinstance(lr, int) and not isinstance(lr, bool) else lr,
        issued_at=float(issued),
    )


class MemoryControl:
    """Decisions handed over in process (tests, the campaign): ``put`` them, the guard ``poll`` s."""

    def __init__(self, decisions: Iterable[Decision] = ()) -> None:
        self._queue: collections.deque[Decision] = collections.deque(decisions, maxlen=1024)
        self._lock = threading.Lock()
        self.rejected = 0

    def put(self, decision: Decision) -> None:
        with self._lock:
            self._queue.append(decision)

    def poll(self) -> list[Decision]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def close(self) -> None:
        pass


class KafkaControl:
    """Reads the control topic from a daemon thread of its own; ``poll()`` returns what arrived.

    Only decisions for ``run`` are kept; it starts at the end of the topic (a decision about an
    earlier run of the same name is not acted on). If kafka-python is missing or the bus cannot be
    reached, it logs one warning and stays empty: the guard's local checks still work.
    """

    def __init__(
        self, bootstrap: str, run: str, topic: str = CONTROL_TOPIC, *, poll_timeout: float = 0.2, **kafka_settings: Any
    ) -> None:
        self.bootstrap, self.run, self.topic = bootstrap, run, topic
        self.poll_timeout = poll_timeout
        self.kafka_settings = kafka_settings
        self.rejected = 0  # malformed messages
        self.received = 0  # decisions for this run
        self.available = True  # False once the bus was found unusable
        self._queue: collections.deque[Decision] = collections.deque(maxlen=1024)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdcwatch-guard-control", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Wait until the reader is positioned on the topic (tests; training never waits)."""
        return self._ready.wait(timeout) and self.available

    def poll(self) -> list[Decision]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def _give_up(self, why: str) -> None:
        self.available = False
        self._ready.set()
        log.warning(
            "sdcwatch guard: control topic %s at %s unavailable (%s); training continues with the "
            "guard's local checks only",
            self.topic,
            self.bootstrap,
            why,
        )

    def _run(self) -> None:
        try:
            from kafka import TopicPartition
        except Exception as exc:  # kafka-python missing
            self._give_up(f"kafka-python not importable: {exc}")
            return
        consumer = None
        try:
            consumer = new_consumer(
                self.bootstrap,
                security=self.kafka_settings,
                enable_auto_commit=False,
                group_id=None,
                request_timeout_ms=5000,
            )
            parts = consumer.partitions_for_topic(self.topic)
            existed = bool(parts)
            if not existed:
                self._ready.set()
            while not parts and not self._stop.is_set():
                # no topic yet: the service creates it with its first decision; everything in it is new
                self._stop.wait(1.0)
                consumer._client.cluster.request_update()
                parts = consumer.partitions_for_topic(self.topic)
            if self._stop.is_set():
                return
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            if existed:
                consumer.seek_to_end(*tps)
                for tp in tps:
                    consumer.position(tp)
                self._ready.set()
            else:
                consumer.seek_to_beginning(*tps)
            while not self._stop.is_set():
                batch = consumer.poll(timeout_ms=int(self.poll_timeout * 1000))
                for msgs in batch.values():
                    for m in msgs:
                        self._take(m.value)
        except Exception as exc:
            if not self._stop.is_set():
                self._give_up(str(exc))
        finally:
            if consumer is not None:
                try:
                    consumer.close()
                except Exception:
                    pass

    def _take(self, value: bytes) -> None:
        try:
            d = decode_decision(value)
        except ControlError as exc:
            self.rejected += 1
            if self.rejected == 1 or self.rejected % 100 == 0:
                log.warning("sdcwatch guard: ignored %d malformed control message(s); latest: %s", self.rejected, exc)
            return
        if d.run != self.run:
            return
        with self._lock:
            self._queue.append(d)
            self.received += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
