"""The configuration of ``sdcwatch serve``: one small dataclass per section, loaded in layers.

Precedence, later wins::

    built-in defaults  <  TOML file (--config PATH, or SDCWATCH_CONFIG)
                       <  environment (SDCWATCH_<SECTION>_<KEY>, and the SDCWATCH_BOOTSTRAP shortcut)
                       <  command-line flags (--<section>-<key>, a few short aliases)

Environment names are the dotted key upper-cased with ``_`` for the dot: ``metrics.port`` is
``SDCWATCH_METRICS_PORT``, ``alerts.alertmanager_url`` is ``SDCWATCH_ALERTS_ALERTMANAGER_URL``
and one Kafka security setting, ``bus.security.sasl_plain_password``, is
``SDCWATCH_BUS_SECURITY_SASL_PLAIN_PASSWORD`` (so secrets need not sit in the file).
``SDCWATCH_BOOTSTRAP`` (the variable the in-rank emitter reads too) sets ``bus.bootstrap``.
Other ``SDCWATCH_*`` variables that do not start with a section name (``SDCWATCH_RUN`` ...)
belong to the emitter and are ignored here; a misspelt key inside a known section is an error.

Every section checks its values when it is built (``__post_init__``), so a config made in code
is as safe as a loaded one. A bad or unknown key raises :class:`~sdcwatch.core.errors.ConfigError`
naming the dotted key and where the value came from, e.g.
``alerts.alertmanger_url: unknown key (did you mean alertmanager_url?) (in serve.toml)``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import inspect
import os
import re
import textwrap
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Mapping

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 needs the backport
    import tomli as tomllib  # type: ignore[no-redef]

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.names import ANOMALY_TOPIC, DEADLETTER_TOPIC, SUMMARY_TOPIC, TELEMETRY_TOPIC
from sdcwatch.core.validate import check_type, describe, is_host, topic_problem, url_problem

__all__ = [
    "BusConfig",
    "MetricsConfig",
    "AlertsConfig",
    "StateConfig",
    "DetectorsConfig",
    "ServeConfig",
    "SECURITY_KEYS",
    "ENV_PREFIX",
    "load_config",
    "add_serve_arguments",
    "overrides_from_args",
    "config_from_args",
    "env_name",
    "flag_name",
    "config_reference",
]

ENV_PREFIX = "SDCWATCH_"

#: Kafka security settings that may be given as text (kafka-python 3.x keyword -> value type).
#: Object-valued ones (ssl_context, sasl_oauth_token_provider) cannot come from a file.
SECURITY_KEYS: dict[str, type] = {
    "security_protocol": str,
    "ssl_check_hostname": bool,
    "ssl_cafile": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_crlfile": str,
    "ssl_password": str,
    "ssl_ciphers": str,
    "sasl_mechanism": str,
    "sasl_plain_username": str,
    "sasl_plain_password": str,
    "sasl_kerberos_service_name": str,
    "sasl_kerberos_domain_name": str,
}
_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
# OAUTHBEARER needs a token-provider object, which text configuration cannot give.
_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "AWS_MSK_IAM")
_NEEDS_PASSWORD = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_SECRET = re.compile(r"password|secret|token", re.IGNORECASE)
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


# ---------------------------------------------------------------------------------------------
# the sections


class _Section:
    """Shared checks: every field has the declared type (ints are accepted for floats)."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            key = f"{self.section}.{f.name}"
            value = getattr(self, f.name)
            setattr(self, f.name, check_type(key, value, _kind(type(self), f.name)))
        self._validate()

    def _validate(self) -> None:
        """Section-specific value checks; raise ConfigError with the dotted key."""

    def _fail(self, name: str, problem: str) -> typing.NoReturn:
        raise ConfigError(f"{self.section}.{name}", problem)


@dataclass
class BusConfig(_Section):
    """[bus]: where telemetry comes from and incidents go (a Kafka cluster)."""

    section: ClassVar[str] = "bus"

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
    group: str = "sdcwatch-detectors"
    """Kafka consumer group of the service; instances sharing it share the partitions (whole steps).
    A temporal stage reads the summaries topic as group <group>.temporal."""
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
        for name in ("telemetry_topic", "anomalies_topic", "deadletter_topic", "summaries_topic"):
            topic = getattr(self, name)
            problem = topic_problem(topic)
            if problem:
                self._fail(name, problem)
            if topic in topics:
                self._fail(name, f"{topic!r} is also bus.{topics[topic]}; each topic has one purpose")
            topics[topic] = name
        if not self.group.strip():
            self._fail("group", "must not be empty")
        self._validate_security()

    def _validate_security(self) -> None:
        sec = self.security
        for name, value in sec.items():
            key = f"security.{name}"
            if name not in SECURITY_KEYS:
                self._fail(key, f"unknown Kafka security setting{_did_you_mean(name, SECURITY_KEYS)}")
            check_type(f"bus.{key}", value, SECURITY_KEYS[name])
            if SECURITY_KEYS[name] is str and not value:
                self._fail(key, "must not be empty (leave it out instead)")
        protocol = sec.get("security_protocol", "PLAINTEXT")
        if protocol not in _PROTOCOLS:
            self._fail("security.security_protocol", f"{protocol!r} is not one of {', '.join(_PROTOCOLS)}")
        mechanism = sec.get("sasl_mechanism")
        if mechanism is not None:
            if mechanism not in _MECHANISMS:
                self._fail("security.sasl_mechanism", f"{mechanism!r} is not one of {', '.join(_MECHANISMS)}")
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

    def kafka_security(self) -> dict[str, Any]:
        """The security keywords for kafka-python (KafkaTransport, KafkaSource, admin clients)."""
        return dict(self.security)


@dataclass
class MetricsConfig(_Section):
    """[metrics]: the Prometheus /metrics endpoint of the service."""

    section: ClassVar[str] = "metrics"

    address: str = "127.0.0.1"
    """Address the /metrics HTTP server listens on; 0.0.0.0 (or ::) to be scraped from other hosts."""
    port: int = 9400
    """Port of the /metrics HTTP server; 0 turns the endpoint off."""

    def _validate(self) -> None:
        if not is_host(self.address):
            self._fail("address", f"{self.address!r} is neither an IP address nor a host name")
        if not 0 <= self.port <= 65535:
            self._fail("port", f"{self.port} out of range 0-65535 (0 = off)")

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
        _positive(self, "timeout_s")


@dataclass
class StateConfig(_Section):
    """[state]: where the service keeps its snapshot so a restart resumes without repeated alerts."""

    section: ClassVar[str] = "state"

    dir: Path = Path("sdcwatch-state")
    """Folder for the state snapshot (created if missing); relative paths are from the working directory."""
    snapshot_interval_s: float = 30.0
    """Seconds between periodic snapshots; one is always written on a clean stop (Ctrl-C, SIGTERM)."""

    def _validate(self) -> None:
        self.dir = self.dir.expanduser()
        if str(self.dir) in ("", "."):
            self._fail("dir", "must name a folder for the snapshot (not the working directory itself)")
        if self.dir.exists() and not self.dir.is_dir():
            self._fail("dir", f"{self.dir} exists and is not a folder")
        _positive(self, "snapshot_interval_s")


@dataclass
class DetectorsConfig(_Section):
    """[detectors]: tunables of the online detectors and the incident book."""

    section: ClassVar[str] = "detectors"

    top_k: int = 3
    """Most ranks an incident names as suspects (the strongest evidence first)."""
    resolve_after_steps: int = 50
    """An incident is resolved after this many consecutive steps without a new finding."""
    align_timeout_s: float = 5.0
    """Seconds the step aligner waits for the last ranks of a step before closing it without them."""
    stage: str = "both"
    """What this instance runs: "both" (one process does everything, the default); or, to scale out,
    "spatial" (alignment and the cross-rank detectors; run several in one consumer group, each
    takes whole steps) and one "temporal" (the detectors over time, incidents and alerts, on the
    spatial instances' step summaries)."""

    def _validate(self) -> None:
        for name in ("top_k", "resolve_after_steps"):
            if getattr(self, name) < 1:
                self._fail(name, f"must be at least 1, got {getattr(self, name)}")
        _positive(self, "align_timeout_s")
        if self.stage not in ("both", "spatial", "temporal"):
            self._fail("stage", f"{self.stage!r} is not one of both, spatial, temporal")


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

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(name, f"must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")

    def to_dict(self, *, redact: bool = True) -> dict[str, dict[str, Any]]:
        """Plain nested dict (TOML shape); secrets are shown as ``***`` unless ``redact=False``."""
        out: dict[str, dict[str, Any]] = {}
        for name in SECTIONS:
            section = getattr(self, name)
            values: dict[str, Any] = {}
            for f in fields(section):
                value = getattr(section, f.name)
                if isinstance(value, Path):
                    value = str(value)
                elif isinstance(value, dict):
                    value = {k: ("***" if redact and _SECRET.search(k) else v) for k, v in value.items()}
                values[f.name] = value
            out[name] = values
        return out


SECTIONS: dict[str, type[_Section]] = {
    "bus": BusConfig,
    "metrics": MetricsConfig,
    "alerts": AlertsConfig,
    "state": StateConfig,
    "detectors": DetectorsConfig,
}

#: Short flags besides the canonical --<section>-<key> ones.
_FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "bus.bootstrap": ("--bootstrap",),
    "detectors.stage": ("--stage",),
    "alerts.alertmanager_url": ("--alertmanager-url",),
    "alerts.webhook_url": ("--webhook-url",),
}


# ---------------------------------------------------------------------------------------------
# value checks


def _kind(cls: type, name: str) -> type:
    return _hints(cls)[name]


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_origin(hints[f.name]) or hints[f.name] for f in fields(cls)}


def _positive(section: _Section, name: str) -> None:
    value = getattr(section, name)
    if not value > 0:
        section._fail(name, f"must be greater than 0, got {value}")


def _located(exc: ConfigError, where: str) -> ConfigError:
    """The same error with the source of the value appended (once)."""
    if where in exc.problem:
        return exc
    return ConfigError(exc.key, f"{exc.problem} ({where})")


def _did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _parse_text(key: str, text: str, kind: type) -> Any:
    """Turn text from the environment or a flag into ``kind``, naming ``key`` when it cannot."""
    raw = text.strip()
    if kind is str:
        return text
    if kind is Path:
        return Path(raw)
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(key, f"must be true or false (also 1/0, yes/no, on/off), got {text!r}")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(key, f"must be an integer, got {text!r}") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(key, f"must be a number, got {text!r}") from None
    raise ConfigError(key, "is a table; set its entries one by one")


# ---------------------------------------------------------------------------------------------
# layers: each turns its input into {dotted key: typed value} and {dotted key: where from}


def _all_keys() -> dict[str, type]:
    """Every settable dotted key and its type (security entries included)."""
    keys: dict[str, type] = {}
    for name, cls in SECTIONS.items():
        for fname, kind in _hints(cls).items():
            if kind is dict:
                for sname, skind in SECURITY_KEYS.items():
                    keys[f"{name}.{fname}.{sname}"] = skind
            else:
                keys[f"{name}.{fname}"] = kind
    return keys


def _resolve_key(dotted: str, where: str) -> type:
    """The type of ``dotted``, or a ConfigError naming it with a suggestion."""
    keys = _all_keys()
    if dotted in keys:
        return keys[dotted]
    parts = dotted.split(".")
    if parts[0] not in SECTIONS:
        raise ConfigError(parts[0], f"unknown section{_did_you_mean(parts[0], SECTIONS)} ({where})")
    section = parts[0]
    names = list(_hints(SECTIONS[section]))
    if len(parts) == 2:
        if _hints(SECTIONS[section]).get(parts[1]) is dict:
            raise ConfigError(dotted, f"is a table; set its entries one by one ({where})")
        raise ConfigError(dotted, f"unknown key{_did_you_mean(parts[1], names)} ({where})")
    if len(parts) == 3 and _hints(SECTIONS[section]).get(parts[1]) is dict:
        hint = _did_you_mean(parts[2], SECURITY_KEYS)
        raise ConfigError(dotted, f"unknown Kafka security setting{hint} ({where})")
    raise ConfigError(dotted, f"unknown key{_did_you_mean('.'.join(parts[1:]), names)} ({where})")


def _file_layer(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    where = f"in {path}"
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", f"no such file: {path}") from None
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}

    def walk(table: Mapping[str, Any], prefix: str) -> None:
        for name, value in table.items():
            dotted = f"{prefix}{name}"
            is_table_key = dotted in SECTIONS or (
                dotted.count(".") == 1 and dotted.split(".")[0] in SECTIONS
                and _hints(SECTIONS[dotted.split(".")[0]]).get(dotted.split(".")[1]) is dict
            )
            if is_table_key:
                if not isinstance(value, dict):
                    raise ConfigError(dotted, f"must be a table ([{dotted}]), got {describe(value)} ({where})")
                walk(value, dotted + ".")
                continue
            kind = _resolve_key(dotted, where)
            if isinstance(value, dict):
                raise ConfigError(dotted, f"must be a single value, got a table ({where})")
            try:
                values[dotted] = check_type(dotted, value, kind)
            except ConfigError as exc:
                raise _located(exc, where) from None

    walk(data, "")
    return values, {k: where for k in values}


def env_name(dotted: str) -> str:
    """The environment variable of a dotted key: ``metrics.port`` -> ``SDCWATCH_METRICS_PORT``."""
    return ENV_PREFIX + dotted.replace(".", "_").upper()


def flag_name(dotted: str) -> str:
    """The canonical flag of a dotted key: ``metrics.port`` -> ``--metrics-port``."""
    return "--" + dotted.replace(".", "-").replace("_", "-")


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    by_env = {env_name(k): k for k in _all_keys()}
    shortcut = ENV_PREFIX + "BOOTSTRAP"
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX):]
        section = next((s for s in SECTIONS if rest.startswith(s.upper() + "_")), None)
        if var == shortcut:
            dotted = "bus.bootstrap"
            if env_name(dotted) in env:  # the explicit name is more specific than the shortcut
                continue
        elif var in by_env:
            dotted = by_env[var]
        elif section is not None:
            # A misspelt key of a known section: name it, with the closest real variable.
            key = rest[len(section) + 1:].lower()
            for fname, kind in _hints(SECTIONS[section]).items():
                if kind is dict and key.startswith(fname + "_"):
                    key = f"{fname}.{key[len(fname) + 1:]}"
            dotted = f"{section}.{key}"
            close = difflib.get_close_matches(var, list(by_env), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(dotted, f"unknown key{hint} (environment {var})")
        else:
            continue  # SDCWATCH_RUN, SDCWATCH_CONFIG ...: the emitter's or the loader's own
        sources[dotted] = f"environment {var}"
        try:
            values[dotted] = _parse_text(dotted, env[var], _all_keys()[dotted])
        except ConfigError as exc:
            raise _located(exc, sources[dotted]) from None
    return values, sources


def _flag_layer(overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    flat: dict[str, Any] = {}

    def walk(table: Mapping[str, Any], prefix: str) -> None:
        for name, value in table.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{name}.")
            elif value is not None:
                flat[f"{prefix}{name}"] = value

    walk(overrides, "")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for dotted, value in flat.items():
        where = f"flag {flag_name(dotted)}"
        kind = _resolve_key(dotted, where)
        try:
            values[dotted] = _parse_text(dotted, value, kind) if isinstance(value, str) else value
        except ConfigError as exc:
            raise _located(exc, where) from None
        sources[dotted] = where
    return values, sources


# ---------------------------------------------------------------------------------------------
# loading


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServeConfig:
    """Build the serve configuration: defaults < TOML file < environment < ``overrides``.

    ``path`` defaults to ``$SDCWATCH_CONFIG`` when that is set. ``env`` defaults to
    ``os.environ``. ``overrides`` maps dotted keys (``{"metrics.port": 0}``) or nested sections
    (``{"metrics": {"port": 0}}``) to values; ``None`` values are skipped and text is parsed like
    the environment's, so the result of :func:`overrides_from_args` can be passed as it is.
    Raises ConfigError naming the dotted key and the source of the bad value.
    """
    env = os.environ if env is None else env
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    layers = []
    if path is not None:
        layers.append(_file_layer(Path(path)))
    layers.append(_env_layer(env))
    layers.append(_flag_layer(overrides or {}))
    for layer_values, layer_sources in layers:
        values.update(layer_values)
        sources.update(layer_sources)
    return _build(values, sources)


def _build(values: Mapping[str, Any], sources: Mapping[str, str]) -> ServeConfig:
    sections: dict[str, _Section] = {}
    for name, cls in SECTIONS.items():
        kwargs: dict[str, Any] = {}
        for fname, kind in _hints(cls).items():
            if kind is dict:
                prefix = f"{name}.{fname}."
                entries = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
                if entries:
                    kwargs[fname] = entries
            elif f"{name}.{fname}" in values:
                kwargs[fname] = values[f"{name}.{fname}"]
        try:
            sections[name] = cls(**kwargs)
        except ConfigError as exc:
            # A value's own source; for a missing companion key, where the section was set.
            where = sources.get(exc.key) or "; ".join(
                dict.fromkeys(src for key, src in sources.items() if key.startswith(name + "."))
            )
            raise (_located(exc, where) if where else exc) from None
    return ServeConfig(**sections)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# command line


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``--config`` and one flag per setting (``--<section>-<key>``, plus short aliases).

    Flags default to "not given" (absent from the namespace), so only what the user typed
    overrides the file and the environment. Kafka security settings have no flags on purpose:
    a password on the command line is visible to every user of the machine (``ps``).
    """
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"TOML configuration file (default: ${ENV_PREFIX}CONFIG if set); see sdcwatch/serve.example.toml",
    )
    docs = _field_docs_all()
    for dotted, kind in _all_keys().items():
        if dotted.count(".") != 1:
            continue
        section = SECTIONS[dotted.split(".")[0]]
        default = getattr(section(), dotted.split(".")[1])
        names = (flag_name(dotted), *_FLAG_ALIASES.get(dotted, ()))
        doc = docs.get(dotted, "")
        help_text = f"{doc} [{env_name(dotted)}; default: {_show(default)}]".replace("%", "%%")
        if kind is bool:
            parser.add_argument(*names, dest=dotted, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            metavar = {int: "N", float: "SECONDS" if dotted.endswith("_s") else "X", Path: "DIR"}.get(kind, "TEXT")
            if dotted.endswith("url"):
                metavar = "URL"
            parser.add_argument(*names, dest=dotted, metavar=metavar, default=argparse.SUPPRESS, help=help_text)
    return parser


def overrides_from_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The settings the user gave as flags, as ``{dotted key: value}`` for :func:`load_config`."""
    keys = _all_keys()
    return {k: v for k, v in vars(ns).items() if k in keys and v is not None}


def config_from_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> ServeConfig:
    """:func:`load_config` from a namespace parsed with :func:`add_serve_arguments`."""
    return load_config(getattr(ns, "config", None), env, overrides_from_args(ns))


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return "off"
    return str(value)


# ---------------------------------------------------------------------------------------------
# documentation, from the attribute docstrings (one source of truth for help, README, example)


@functools.lru_cache(maxsize=None)
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string right after each field), or {} without source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_docs_all() -> dict[str, str]:
    return {f"{s}.{k}": v for s, cls in SECTIONS.items() for k, v in _field_docs(cls).items()}


def config_reference() -> str:
    """A Markdown table of every setting: key, environment variable, flag, default, meaning."""
    docs = _field_docs_all()
    rows = ["| key | environment | flag | default | meaning |", "|---|---|---|---|---|"]
    for name, cls in SECTIONS.items():
        defaults = cls()
        for fname, kind in _hints(cls).items():
            dotted = f"{name}.{fname}"
            if kind is dict:
                rows.append(
                    f"| `{dotted}.<name>` | `{env_name(dotted)}_<NAME>` | - | - | {docs.get(dotted, '')} |"
                )
                continue
            flags = ", ".join(f"`{f}`" for f in (flag_name(dotted), *_FLAG_ALIASES.get(dotted, ())))
            if kind is bool:
                flags = f"`{flag_name(dotted)}` / `--no-{flag_name(dotted)[2:]}`"
            rows.append(
                f"| `{dotted}` | `{env_name(dotted)}` | {flags} | `{_show(getattr(defaults, fname))}` | {docs.get(dotted, '')} |"
            )
    rows.append(f"\n`{ENV_PREFIX}BOOTSTRAP` is a shortcut for `{env_name('bus.bootstrap')}`; "
                f"`{ENV_PREFIX}CONFIG` names the TOML file when `--config` is not given.")
    return "\n".join(rows)
