"""What the commands that read a topic share (``capture``, ``incidents``, ``checkpoints``): their bus
options, read from the same flags, environment and file as ``sdcwatch serve``'s (job keys: docs/service.md,
"Reading a signed run"), the reader, how an anomalies message is verified, the refusals they count and
name, and stopping on Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from sdcwatch.core.errors import RecordError, TransportError
from sdcwatch.core.limits import reason_of
from sdcwatch.core.messages import open_signed
from sdcwatch.core.signing import AuthError, Keyring, is_signed
from sdcwatch.service.kafka_source import TopicReader

__all__ = [
    "add_bus_arguments",
    "bus_settings",
    "open_reader",
    "anomaly_opener",
    "Refusals",
    "stop_on_signals",
    "read_to_end",
]


def add_bus_arguments(parser: argparse.ArgumentParser, topic: str) -> None:
    """The options of a command that reads one topic (``topic``: its key in ``[bus]``, ``telemetry``
    or ``anomalies``): the broker, the topic, the serve configuration, the key file, how long to wait."""
    parser.add_argument(
        "--bus-connect-timeout-s",
        "--connect-timeout",
        dest="connect_timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the broker to answer, > 0 (default %(default)s)",
    )
    parser.add_argument(
        "--bus-bootstrap",
        "--bootstrap",
        dest="bootstrap",
        metavar="HOST:PORT",
        help="Kafka bootstrap servers [SDCWATCH_BOOTSTRAP; default: the serve configuration's]",
    )
    parser.add_argument(
        f"--bus-{topic}-topic",
        "--topic",
        dest="topic",
        metavar="TOPIC",
        help=f"{topic} topic [SDCWATCH_BUS_{topic.upper()}_TOPIC; default sdcwatch.{topic}]",
    )
    parser.add_argument(
        "--auth-key-file",
        "--key-file",
        dest="key_file",
        metavar="PATH",
        help="keys that verify signed messages, one kid:secret a line, as 'sdcwatch serve' takes them "
        "[SDCWATCH_AUTH_KEY_FILE; [auth] key_file]",
    )
    parser.add_argument("--config", metavar="PATH", help="serve configuration file (TOML) for the bus settings")


def bus_settings(args: argparse.Namespace, topic: str) -> tuple[Any, Keyring | None]:
    """The bus configuration (``[bus]``) and the keys (``[auth]``, None: no key file) a reader uses:
    the serve configuration with the command's flags on top (``topic``: the ``[bus]`` key the
    ``--topic`` flag overrides; ``--connect-timeout`` is ``bus.connect_timeout_s``, checked there);
    ConfigError naming a bad setting or an unreadable key file."""
    from sdcwatch.config import load_config

    overrides = {"bus.bootstrap": args.bootstrap, f"bus.{topic}": args.topic, "auth.key_file": args.key_file}
    cfg = load_config(args.config, overrides={**overrides, "bus.connect_timeout_s": args.connect_timeout})
    return cfg.bus, cfg.auth.keyring()


def open_reader(bus: Any, topic: str, *, from_beginning: bool, consumer: Any = None) -> TopicReader:
    """``topic`` on ``bus``'s broker, read as the service reads it: every partition, offset gaps
    re-fetched (:class:`~sdcwatch.service.kafka_source.TopicReader`), waiting ``bus.connect_timeout_s``
    for the broker. One that does not answer is a :class:`TransportError` that says where its
    address came from."""
    try:
        return TopicReader(
            bus.bootstrap,
            topic,
            from_beginning=from_beginning,
            connect_timeout=bus.connect_timeout_s,
            consumer=consumer,
            **bus.security,
        )
    except TransportError as exc:
        raise TransportError(
            f"{exc}; check --bus-bootstrap / SDCWATCH_BOOTSTRAP and that the broker is running"
        ) from None


def anomaly_opener(keyring: Keyring | None) -> Callable[[bytes | None], bytes | None]:
    """How a reader opens a message of the anomalies topic. With keys (the service's key file), only
    one the service signed with its key (``Keyring.service_key("anomalies")``): an unsigned one or one
    signed otherwise raises AuthError (anyone may write to the topic). Without keys, an unsigned one
    as it is, as before (a signed one: AuthError, no key to verify it)."""
    if keyring is None:
        return lambda value: open_signed(value, None)
    key = keyring.service_key("anomalies")

    def open_anomaly(value: bytes | None) -> bytes | None:
        if value is not None and not is_signed(value):
            raise AuthError("signature", "not signed by the service, whose key the key file gives")
        return None if value is None else key.open(value)

    return open_anomaly


@dataclass
class Refusals:
    """Messages a reader refused, by dead-letter reason (``auth``, ``malformed``...), each with the
    first refusal's words: what the summary line names."""

    counts: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, why: str) -> None:
        """Count one refusal (``reason``: its dead-letter reason code, ``why``: in words)."""
        self.counts[reason] += 1
        self.first.setdefault(reason, why)

    def refused(self, exc: RecordError) -> None:
        """Count a message that raised ``exc``."""
        self.add(reason_of(exc), str(exc))

    def __len__(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        """``3 auth (signature: signed with key 'x', which this service does not hold); 1 malformed (...)``."""
        return "; ".join(f"{n} {reason} ({self.first[reason]})" for reason, n in self.counts.most_common())


def stop_on_signals() -> tuple[threading.Event, list[int]]:
    """An event set on Ctrl-C or SIGTERM, and the signals that set it: the command stops there."""
    stop, got = threading.Event(), []

    def on_signal(signum: int, frame: Any) -> None:
        got.append(signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop, got


def read_to_end(reader: TopicReader, take: Callable[[Any], Any], stop: threading.Event) -> bool:
    """Hand every message the topic holds now to ``take``; False when the topic does not exist."""
    if not reader.assign():
        return False
    mark = reader.end_mark()
    while not stop.is_set() and not reader.past(mark):
        for msg in reader.poll_messages(0.5):
            take(msg)
    return True
