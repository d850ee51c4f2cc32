"""The schema of ``sdcwatch serve``'s configuration: one small dataclass per section, checking its values when
built (ConfigError naming the dotted key); a component's section is built on its definition (``[detectors]``:
the pipeline's settings and each detector's ``Config``; ``[metrics]``: the exporter's; ``[guard]``: ``ControlPolicy``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.kafka import TEXT_SECURITY_KEYS
from sdcwatch.core.limits import RecordLimits
from sdcwatch.core.signing import Keyring
from sdcwatch.core.validate import (
    check_choice,
    check_int,
    check_number,
    check_type,
    did_you_mean,
    topic_problem,
    url_problem,
)
from sdcwatch.core.vocabulary import ANOMALY_TOPIC, CONTROL_TOPIC, DEADLETTER_TOPIC, SUMMARY_TOPIC, TELEMETRY_TOPIC
from sdcwatch.detectors.registry import default_classes
from sdcwatch.exporters.metrics_settings import (
    DEFAULT_MAX_HOSTS,
    DEFAULT_MAX_LAYERS,
    DEFAULT_MAX_PIECES,
    DEFAULT_METRICS_ADDRESS,
    DEFAULT_METRICS_PORT,
    DEFAULT_TOP_K,
    check_address,
    check_cardinality,
    check_port,
)
from sdcwatch.service.control_policy import ControlPolicy
from sdcwatch.service.hosts import HostSettings
from sdcwatch.service.pipeline import STAGES, PipelineSettings

__all__ = [
    "BusConfig",
    "MetricsConfig",
    "AlertsConfig",
    "StateConfig",
    "DetectorsConfig",
    "LimitsConfig",
    "GuardPolicyConfig",
    "HostsConfig",
    "AuthConfig",
    "ServeConfig",
    "SECTIONS",
    "SECURITY_KEYS",
    "hints",
]

#: Kafka security settings that may be given as text (kafka-python keyword -> value type).
SECURITY_KEYS = TEXT_SECURITY_KEYS
_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
# OAUTHBEARER needs a token-provider object, which text configuration cannot give.
_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "AWS_MSK_IAM")
_NEEDS_PASSWORD = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@functools.lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, type]:
    """Field name -> type of the settable fields of a config dataclass (``tuple[str, ...]`` is
    ``tuple``; a nested dataclass is a sub-section). A field whose metadata says ``fixed`` (a
    pipeline setting the service keeps at its default) has no key."""
    resolved = typing.get_type_hints(cls)
    return {
        f.name: typing.get_origin(resolved[f.name]) or resolved[f.name]
        for f in fields(cls)
        if not f.metadata.get("fixed")
    }


class _Section:
    """Shared checks: every field has the declared type (ints are accepted for floats)."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for name, kind in hints(type(self)).items():
            setattr(self, name, check_type(f"{self.section}.{name}", getattr(self, name), kind))
        self._validate()

    def _validate(self) -> None:
        """Section-specific value checks; raise ConfigError with the dotted key."""

    def _fail(self, name: str, problem: str) -> typing.NoReturn:
        raise ConfigError(f"{self.section}.{name}", problem)

    def _positive(self, *names: str) -> None:
        for name in names:
            check_number(f"{self.section}.{name}", getattr(self, name), 0, lo_open=True)


@dataclass
class BusConfig(_Section):
    """[bus]: where telemetry comes from and incidents go (a Kafka cluster)."""

    section: ClassVar[str] = "bus"
    TOPICS: ClassVar[tuple[str, ...]] = (
        "telemetry_topic",
        "anomalies_topic",
        "deadletter_topic",
        "summaries_topic",
        "control_topic",
    )

    bootstrap: str = "localhost:9092"
    """Kafka bootstrap servers, comma-separated host:port (what kafka-python calls bootstrap_servers)."""
    telemetry_topic: str = TELEMETRY_TOPIC
    """Topic the training ranks write their records to; the service consumes it."""
    anomalies_topic: str = ANOMALY_TOPIC
    """Topic the service writes incident changes to (opened, updated, resolved), as JSON."""
    deadletter_topic: str = DEADLETTER_TOPIC
    """Topic malformed telemetry messages are moved to, untouched, for a person to inspect."""
    summaries_topic: str = SUMMARY_TOPIC
    """Topic from the spatial to the temporal stage when the service runs split (detectors.stage)."""
    control_topic: str = CONTROL_TOPIC
    """Topic the service writes decisions for the training jobs' guards to (when guard.actions is on)."""
    group: str = "sdcwatch-detectors"
    """Kafka consumer group of the service. Stage both (the default) and the temporal stage: one instance
    per group; each would see only part of every run (an instance that finds it shares its group exits
    with an error: share_timeout_s). To scale out, several --stage spatial instances share a group (whole
    steps each) and one --stage temporal reads the summaries topic as group <group>.temporal."""
    share_timeout_s: float = 30.0
    """Stage both and temporal: seconds an instance may hold only part of its topic's partitions before it
    concludes another instance shares its group and exits with an error, committing nothing (the other
    re-reads what it took). Longer than a restart's overlap with the instance before it; 0 = never."""
    connect_timeout_s: float = 30.0
    """Seconds to wait for the broker to answer when connecting (serve: each Kafka client at start-up);
    then the command exits with an error naming the address."""
    security: dict = field(default_factory=dict)
    """Kafka security settings passed to kafka-python as keywords: security_protocol, ssl_cafile,
    sasl_mechanism, sasl_plain_username, sasl_plain_password, ... (see SECURITY_KEYS)."""

    def _validate(self) -> None:
        for server in self.bootstrap_servers:
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                self._fail("bootstrap", f"{server!r} is not host:port (port 1-65535)")
        if not self.bootstrap_servers:
            self._fail("bootstrap", "must name at least one host:port")
        topics: dict[str, str] = {}
        for name in self.TOPICS:
            topic = getattr(self, name)
            problem = topic_problem(topic)
            if problem:
                self._fail(name, problem)
            if topic in topics:
                self._fail(name, f"{topic!r} is also bus.{topics[topic]}; each topic has one purpose")
            topics[topic] = name
        if not self.group.strip():
            self._fail("group", "must not be empty")
        check_number("bus.share_timeout_s", self.share_timeout_s, 0)
        self._positive("connect_timeout_s")
        self._validate_security()

    def _validate_security(self) -> None:
        sec = self.security
        for name, value in sec.items():
            key = f"security.{name}"
            if name not in SECURITY_KEYS:
                self._fail(key, f"unknown Kafka security setting{did_you_mean(name, SECURITY_KEYS)}")
            check_type(f"bus.{key}", value, SECURITY_KEYS[name])
            if SECURITY_KEYS[name] is str and not value:
                self._fail(key, "must not be empty (leave it out instead)")
        protocol = check_choice("bus.security.security_protocol", sec.get("security_protocol", "PLAINTEXT"), _PROTOCOLS)
        mechanism = sec.get("sasl_mechanism")
        if mechanism is not None:
            check_choice("bus.security.sasl_mechanism", mechanism, _MECHANISMS)
            if not protocol.startswith("SASL_"):
                self._fail(
                    "security.sasl_mechanism",
                    f"needs security_protocol SASL_PLAINTEXT or SASL_SSL (it is {protocol})",
                )
            if mechanism in _NEEDS_PASSWORD:
                for needed in ("sasl_plain_username", "sasl_plain_password"):
                    if needed not in sec:
                        self._fail(f"security.{needed}", f"required by sasl_mechanism {mechanism}")
        elif protocol.startswith("SASL_"):
            self._fail("security.sasl_mechanism", f"required by security_protocol {protocol}")
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_crlfile"):
            if name in sec and not Path(sec[name]).expanduser().is_file():
                self._fail(f"security.{name}", f"no such file: {sec[name]}")

    @property
    def bootstrap_servers(self) -> list[str]:
        """The bootstrap list, split and stripped."""
        return [s.strip() for s in self.bootstrap.split(",") if s.strip()]


@dataclass
class MetricsConfig(_Section):
    """[metrics]: the Prometheus /metrics endpoint of the service."""

    section: ClassVar[str] = "metrics"

    address: str = DEFAULT_METRICS_ADDRESS
    """Address the /metrics HTTP server listens on; 0.0.0.0 (or ::) to be scraped from other hosts."""
    port: int = DEFAULT_METRICS_PORT
    """Port of the /metrics HTTP server; 0 turns the endpoint off."""
    top_k: int = DEFAULT_TOP_K
    """Ranks with their own per-rank series on /metrics: the K with the highest outlier score (plus
    every rank an open incident names); the rest are summarised across ranks. 0: only the ranks an
    open incident names."""
    max_runs: int = 20
    """Runs with per-run series: those with open incidents first, then the most recently active."""
    max_layers: int = DEFAULT_MAX_LAYERS
    """Layers with per-layer series in each run: those of open incidents, then the widest spread across ranks
    (under pipeline or tensor parallelism, (model piece, layer) pairs)."""
    max_pieces: int = DEFAULT_MAX_PIECES
    """Model pieces (peer groups: same pp stage, tp rank...) of a run with cross-rank statistics series:
    those of open incidents, then the widest spread across their ranks; plain data parallel has one."""
    max_hosts: int = DEFAULT_MAX_HOSTS
    """Hosts judged suspect or quarantine across runs with a series of their own (sdcwatch_host_verdict),
    worst first; 0: none (the counts stay)."""

    def _validate(self) -> None:
        # the endpoint and the series bounds are the exporter's (MetricsServer, SdcwatchCollector)
        check_address(self.address)
        check_port(self.port)
        check_cardinality(top_k=self.top_k, max_layers=self.max_layers, max_pieces=self.max_pieces)
        check_int("metrics.max_runs", self.max_runs, lo=1)
        check_int("metrics.max_hosts", self.max_hosts, lo=0)

    @property
    def enabled(self) -> bool:
        return self.port != 0


@dataclass
class AlertsConfig(_Section):
    """[alerts]: where incident changes are announced besides the anomalies topic."""

    section: ClassVar[str] = "alerts"

    alertmanager_url: str = ""
    """Alertmanager base URL (alerts are posted to <url>/api/v2/alerts); empty = off."""
    webhook_url: str = ""
    """URL that receives each incident change as a JSON POST; empty = off."""
    log: bool = True
    """Also write each incident change as one line to the service log (stderr)."""
    timeout_s: float = 5.0
    """Seconds one HTTP delivery to Alertmanager or the webhook may take (sent from a background
    thread: a slow receiver never stalls detection)."""

    def _validate(self) -> None:
        for name in ("alertmanager_url", "webhook_url"):
            url = getattr(self, name)
            if url:
                problem = url_problem(url)
                if problem:
                    self._fail(name, problem)
        self._positive("timeout_s")


@dataclass
class AuthConfig(_Section):
    """[auth]: job keys. With a key file, the service reads only telemetry signed with one of its
    keys (a run is bound to the key of its first verified message) and signs each run's control
    decisions with that run's key. Kafka's own SASL/SSL and ACLs ([bus.security]) stay the first line."""

    section: ClassVar[str] = "auth"

    key_file: str = ""
    """File of the keys the service accepts, one ``kid:secret`` a line (the jobs hold one of them in
    ``SDCWATCH_KEY_FILE``); empty = off: every message is read, decisions go unsigned."""
    unsigned: str = "refuse"
    """With keys: ``refuse`` unsigned messages (dead-lettered ``auth``), or ``accept`` them for runs
    no key has claimed while a fleet moves to signing (a run bound to a key is never spoken for
    unsigned)."""

    def _validate(self) -> None:
        check_choice("auth.unsigned", self.unsigned, ("refuse", "accept"))
        if self.key_file:
            self.key_file = str(Path(self.key_file).expanduser())

    def keyring(self) -> Keyring | None:
        """The keys of ``key_file`` (a Keyring), None when off; ConfigError naming a bad line, never a secret."""
        return Keyring.from_file(self.key_file, "auth.key_file") if self.key_file else None


@dataclass
class StateConfig(_Section):
    """[state]: where the service keeps its snapshot so a restart resumes without repeated alerts."""

    section: ClassVar[str] = "state"

    dir: Path = Path("sdcwatch-state")
    """Folder for the state snapshot (created if missing); relative paths are from the working directory."""
    snapshot_interval_s: float = 30.0
    """Seconds between periodic snapshots; one is always written on a clean stop (Ctrl-C, SIGTERM)."""
    topic: str = ""
    """Compacted Kafka topic (created if missing) each snapshot also goes to, keyed by consumer group and
    stage, before the offsets are committed; an instance started without a state file, or with one older
    than the topic's snapshot, resumes from it: on another machine too. Empty = off. Stages both and temporal."""

    def _validate(self) -> None:
        if self.topic:
            problem = topic_problem(self.topic)
            if problem:
                self._fail("topic", problem)
        self.dir = self.dir.expanduser()
        if str(self.dir) in ("", "."):
            self._fail("dir", "must name a folder for the snapshot (not the working directory itself)")
        if self.dir.exists() and not self.dir.is_dir():
            self._fail("dir", f"{self.dir} exists and is not a folder")
        self._positive("snapshot_interval_s")


@dataclass
class _DetectorsSettings(PipelineSettings, _Section):
    """[detectors]: the incident book, the step aligner, the stage; one [detectors.<name>] table
    per detector."""

    section: ClassVar[str] = "detectors"

    # the pipeline's settings are PipelineSettings' fields (one definition, its docs and bounds)
    schema_wait_s: float = 2.0
    """Seconds a v2 telemetry message whose record layout (schema) the service has not learnt yet
    waits for the message that carries it, before it is dead-lettered (reason unknown_schema)."""
    stage: str = "both"
    """What this instance runs: "both" (one process does everything, the default); or, to scale out,
    "spatial" (alignment and the cross-rank detectors; run several in one consumer group, each
    takes whole steps) and one "temporal" (the detectors over time, incidents and alerts, on the
    spatial instances' step summaries)."""

    def __post_init__(self) -> None:
        _Section.__post_init__(self)  # the declared types (ints accepted for floats), then _validate

    def _validate(self) -> None:
        PipelineSettings.__post_init__(self)  # the pipeline's bounds; errors name detectors.<key>
        self._positive("schema_wait_s")
        check_choice("detectors.stage", self.stage, STAGES)

    def detector_configs(self) -> dict[str, Any]:
        """Detector name -> its ``Config``, for :func:`~sdcwatch.detectors.registry.default_detectors`."""
        return {name: getattr(self, name) for name, kind in hints(type(self)).items() if dataclasses.is_dataclass(kind)}


#: [detectors], with one field per default detector whose type is the detector's ``Config``.
DetectorsConfig = dataclasses.make_dataclass(
    "DetectorsConfig",
    [(cls.name, cls.Config, field(default_factory=cls.Config)) for cls in default_classes()],
    bases=(_DetectorsSettings,),
    namespace={"__module__": __name__, "__doc__": _DetectorsSettings.__doc__},
)


@dataclass
class LimitsConfig(_Section):
    """[limits]: what one telemetry record may claim; a record past a limit is dead-lettered with the reason."""

    section: ClassVar[str] = "limits"

    max_world: int = RecordLimits.max_world
    """Largest world size a record may claim (sizes every array of its step)."""
    max_layer_metrics: int = RecordLimits.max_layer_metrics
    """Most per-layer metrics in one record."""
    max_layers: int = RecordLimits.max_layers
    """Longest per-layer vector (layers of the model)."""
    max_values: int = RecordLimits.max_values
    """Most values in one record (scalars plus every layer value)."""
    max_step_values: int = RecordLimits.max_step_values
    """Most values one step may hold, world x values per rank (bounds the memory of a step)."""
    max_counter: float = RecordLimits.max_counter
    """Largest value of a counter scalar (emitter_dropped); counters must be finite and >= 0."""
    max_message_bytes: int = RecordLimits.max_message_bytes
    """Largest bus message decoded; larger ones are dead-lettered, truncated, without decoding."""
    max_step_jump: int = RecordLimits.max_step_jump
    """Steps a record may lead its run's last step by, unless most of the run's ranks confirm the jump."""

    def _validate(self) -> None:
        self.record_limits()  # RecordLimits names the key of a bad value

    def record_limits(self) -> RecordLimits:
        """These limits as the :class:`RecordLimits` the decoder applies."""
        return RecordLimits(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass
class GuardPolicyConfig(ControlPolicy, _Section):
    """[guard]: which decision each incident kind sends to the training job's guard (control topic).
    The settings are :class:`~sdcwatch.service.control_policy.ControlPolicy`'s; the guard's own
    live in the training job (sdcwatch.telemetry.GuardConfig)."""

    section: ClassVar[str] = "guard"

    def __post_init__(self) -> None:
        _Section.__post_init__(self)  # the declared types (ints accepted for floats)
        ControlPolicy.__post_init__(self)  # the values; errors name guard.<key>

    def policy(self) -> ControlPolicy:
        """The :class:`~sdcwatch.service.control_policy.ControlPolicy` these settings describe."""
        return ControlPolicy(**{f.name: getattr(self, f.name) for f in fields(ControlPolicy)})


@dataclass
class HostsConfig(HostSettings, _Section):
    """[hosts]: how the host ledger weighs evidence across runs and bounds what it tracks
    (:class:`~sdcwatch.service.hosts.HostSettings`)."""

    section: ClassVar[str] = "hosts"

    def __post_init__(self) -> None:
        _Section.__post_init__(self)  # the declared types (ints accepted for floats)
        HostSettings.__post_init__(self)  # the values; errors name hosts.<key>


@dataclass
class ServeConfig:
    """Everything ``sdcwatch serve`` needs, one attribute per section."""

    bus: BusConfig = field(default_factory=BusConfig)
    """[bus] Kafka cluster and topics."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """[metrics] Prometheus endpoint."""
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    """[alerts] Alertmanager, webhook, log."""
    state: StateConfig = field(default_factory=StateConfig)
    """[state] snapshot folder."""
    detectors: DetectorsConfig = field(default_factory=DetectorsConfig)
    """[detectors] tunables."""
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    """[limits] bounds on what one record may claim."""
    guard: GuardPolicyConfig = field(default_factory=GuardPolicyConfig)
    """[guard] decisions for the training jobs' guards."""
    hosts: HostsConfig = field(default_factory=HostsConfig)
    """[hosts] evidence per host across runs."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    """[auth] job keys: signed telemetry and control."""

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(name, f"must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        self._check_state_topic()

    def _check_state_topic(self) -> None:
        """The state topic has one purpose, and one writer per key: not a spatial stage's instances."""
        topic = self.state.topic
        if not topic:
            return
        for name in BusConfig.TOPICS:
            if getattr(self.bus, name) == topic:
                raise ConfigError("state.topic", f"{topic!r} is also bus.{name}; each topic has one purpose")
        if self.detectors.stage == "spatial":
            raise ConfigError(
                "state.topic",
                "spatial instances share one consumer group, each with a state of its own partitions: give each "
                "its state folder (the state topic is for stage both and the temporal stage)",
            )


SECTIONS: dict[str, type[_Section]] = {
    "bus": BusConfig,
    "metrics": MetricsConfig,
    "alerts": AlertsConfig,
    "state": StateConfig,
    "detectors": DetectorsConfig,
    "limits": LimitsConfig,
    "guard": GuardPolicyConfig,
    "hosts": HostsConfig,
    "auth": AuthConfig,
}
