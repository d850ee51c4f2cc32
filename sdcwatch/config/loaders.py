"""Loading the serve configuration in layers, later wins: defaults < TOML file < environment < flags
(docs/service.md, "Settings"); a bad or unknown key raises ConfigError naming the dotted key and
where the value came from, never the value of a secret.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Mapping

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 needs the backport
    import tomli as tomllib  # type: ignore[no-redef]

from sdcwatch.config.schema import SECTIONS, SECURITY_KEYS, ServeConfig, hints
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import KIND_NAMES, check_type, describe, did_you_mean, is_secret

__all__ = ["ENV_PREFIX", "OTHER_ENV", "load_config", "env_name", "flag_name", "all_keys", "default_of", "parse_text"]

ENV_PREFIX = "SDCWATCH_"
#: ``SDCWATCH_*`` variables that are not serve settings: the emitter's, the probes' (``SDCWATCH_TRITON``,
#: ``SDCWATCH_COMPILED_GRAD_CHECK``), the loader's, ``sdcwatch bench``'s and dev.sh's.
OTHER_ENV = frozenset(
    {
        "SDCWATCH_RUN",
        "SDCWATCH_HOST",
        "SDCWATCH_BOOTSTRAP",
        "SDCWATCH_WIRE",
        "SDCWATCH_MESH",
        "SDCWATCH_COORDS",
        "SDCWATCH_KEY",
        "SDCWATCH_KEY_FILE",
        "SDCWATCH_TRITON",
        "SDCWATCH_COMPILED_GRAD_CHECK",
        "SDCWATCH_CONFIG",
        "SDCWATCH_VENV",
        "SDCWATCH_TORCH",
        "SDCWATCH_BENCH_DIR",
    }
)
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_name(dotted: str) -> str:
    """The environment variable of a dotted key: ``metrics.port`` -> ``SDCWATCH_METRICS_PORT``."""
    return ENV_PREFIX + dotted.replace(".", "_").upper()


def flag_name(dotted: str) -> str:
    """The canonical flag of a dotted key: ``metrics.port`` -> ``--metrics-port``."""
    return "--" + dotted.replace(".", "-").replace("_", "-")


def _walk(cls: type, prefix: str, keys: dict[str, type], tables: dict[str, type]) -> None:
    for fname, kind in hints(cls).items():
        dotted = f"{prefix}{fname}"
        if kind is dict:
            tables[dotted] = dict
            for sname, skind in SECURITY_KEYS.items():
                keys[f"{dotted}.{sname}"] = skind
        elif dataclasses.is_dataclass(kind):
            tables[dotted] = kind
            _walk(kind, dotted + ".", keys, tables)
        else:
            keys[dotted] = kind


@functools.lru_cache(maxsize=None)
def _key_space() -> tuple[dict[str, type], dict[str, type]]:
    keys: dict[str, type] = {}
    tables: dict[str, type] = {}
    for name, cls in SECTIONS.items():
        tables[name] = cls
        _walk(cls, name + ".", keys, tables)
    return keys, tables


def all_keys() -> dict[str, type]:
    """Every settable dotted key and its type (security entries and detector sub-sections included)."""
    return dict(_key_space()[0])


def default_of(dotted: str) -> Any:
    """The built-in default of a dotted key."""
    value: Any = ServeConfig()
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _resolve_key(dotted: str, where: str) -> type:
    """The type of ``dotted``, or a ConfigError naming it with a suggestion."""
    keys, tables = _key_space()
    if dotted in keys:
        return keys[dotted]
    if dotted in tables:
        raise ConfigError(dotted, f"is a table; set its entries one by one ({where})")
    parts = dotted.split(".")
    if parts[0] not in SECTIONS:
        raise ConfigError(parts[0], f"unknown section{did_you_mean(parts[0], SECTIONS)} ({where})")
    table = max((t for t in tables if dotted.startswith(t + ".")), key=len)
    rest = dotted[len(table) + 1 :]
    if tables[table] is dict:
        raise ConfigError(dotted, f"unknown Kafka security setting{did_you_mean(rest, SECURITY_KEYS)} ({where})")
    names = list(hints(tables[table]))
    raise ConfigError(dotted, f"unknown key{did_you_mean(rest, names)} ({where})")


def parse_text(key: str, text: str, kind: type) -> Any:
    """Turn text from the environment or a flag into ``kind``, naming ``key`` when it cannot."""
    raw = text.strip()
    if kind is str:
        return text
    if kind is Path:
        return Path(raw)
    if kind is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(key, f"must be true or false (also 1/0, yes/no, on/off), got {text!r}")
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(key, f"must be {KIND_NAMES[kind]}, got {text!r}") from None
    raise ConfigError(key, "is a table; set its entries one by one")


def _located(exc: ConfigError, where: str) -> ConfigError:
    """The same error with the source of the value appended (once)."""
    if where in exc.problem:
        return exc
    return ConfigError(exc.key, f"{exc.problem} ({where})")


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
    tables = _key_space()[1]

    def walk(table: Mapping[str, Any], prefix: str) -> None:
        for name, value in table.items():
            dotted = f"{prefix}{name}"
            if dotted in tables:
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


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    keys = _key_space()[0]
    by_env = {env_name(k): k for k in keys}
    shortcut = ENV_PREFIX + "BOOTSTRAP"
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX) :]
        section = next((s for s in SECTIONS if rest.startswith(s.upper() + "_")), None)
        if var == shortcut:
            dotted = "bus.bootstrap"
            if env_name(dotted) in env:  # the explicit name is more specific than the shortcut
                continue
        elif var in by_env:
            dotted = by_env[var]
        elif section is not None:
            # A misspelt key of a known section: name it, with the closest real variable.
            key = rest[len(section) + 1 :].lower()
            for fname, kind in hints(SECTIONS[section]).items():
                if (kind is dict or dataclasses.is_dataclass(kind)) and key.startswith(fname + "_"):
                    key = f"{fname}.{key[len(fname) + 1 :]}"
            raise ConfigError(f"{section}.{key}", f"unknown key{did_you_mean(var, by_env)} (environment {var})")
        elif var in OTHER_ENV:
            continue  # SDCWATCH_RUN, SDCWATCH_CONFIG ...: the emitter's or the loader's own
        else:  # a misspelt section (SDCWATCH_METRIC_PORT): never silently ignored
            raise ConfigError(
                var,
                f"unknown sdcwatch environment variable{did_you_mean(var, [*by_env, *OTHER_ENV])}; sections are "
                f"{', '.join(s.upper() for s in SECTIONS)}; the other variables sdcwatch reads are "
                f"{', '.join(sorted(OTHER_ENV))} (the emitter's, --config's, sdcwatch bench's and dev.sh's)",
            )
        sources[dotted] = f"environment {var}"
        try:
            values[dotted] = parse_text(dotted, env[var], keys[dotted])
        except ConfigError as exc:
            if is_secret(dotted):  # name the key, never the value
                exc = ConfigError(exc.key, "invalid value (not shown: the key holds a secret)")
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
            if isinstance(value, str):
                values[dotted] = parse_text(dotted, value, kind)
            else:
                values[dotted] = check_type(dotted, value, kind) if kind is tuple else value
        except ConfigError as exc:
            raise _located(exc, where) from None
        sources[dotted] = where
    return values, sources


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServeConfig:
    """Build the serve configuration: defaults < TOML file (``path``, default ``$SDCWATCH_CONFIG``) <
    environment (``env``, default ``os.environ``) < ``overrides``: dotted keys or nested sections to
    values, ``None`` skipped, text parsed like the environment's (as
    :func:`~sdcwatch.config.docs.overrides_from_args` gives them)."""
    env = os.environ if env is None else env
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    layers = [_file_layer(Path(path))] if path is not None else []
    layers += [_env_layer(env), _flag_layer(overrides or {})]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer_values, layer_sources in layers:
        values.update(layer_values)
        sources.update(layer_sources)
    return ServeConfig(**{name: _build(cls, name, None, values, sources) for name, cls in SECTIONS.items()})


def _build(cls: type, path: str, default: Any, values: Mapping[str, Any], sources: Mapping[str, str]) -> Any:
    """The dataclass at ``path`` from the values under it; sub-sections start from the parent's
    default (so ``detectors.spike.grad_norm.z_on`` keeps the grad-norm series' own ``min_ratio``)."""
    kwargs: dict[str, Any] = {}
    for fname, kind in hints(cls).items():
        dotted = f"{path}.{fname}"
        if kind is dict:
            entries = {k[len(dotted) + 1 :]: v for k, v in values.items() if k.startswith(dotted + ".")}
            if entries:
                kwargs[fname] = entries
        elif dataclasses.is_dataclass(kind):
            if any(k.startswith(dotted + ".") for k in values):
                base = getattr(default if default is not None else cls(), fname)
                kwargs[fname] = _build(kind, dotted, base, values, sources)
        elif dotted in values:
            kwargs[fname] = values[dotted]
    try:
        return dataclasses.replace(default, **kwargs) if default is not None else cls(**kwargs)
    except ConfigError as exc:
        # a detector's Config names its own key ("spike.warmup"): put it under its full path
        key = exc.key if exc.key.startswith(path + ".") else f"{path}.{exc.key.rsplit('.', 1)[-1]}"
        err = ConfigError(key, exc.problem)
        # A value's own source; for a missing companion key, where the section was set.
        where = sources.get(key) or "; ".join(
            dict.fromkeys(src for k, src in sources.items() if k.startswith(path + "."))
        )
        raise (_located(err, where) if where else err) from None
