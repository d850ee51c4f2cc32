"""The validators every layer uses: each raises :class:`~sdcwatch.core.errors.ConfigError`
naming the dotted key of the bad value, so a setting made in code is checked like a loaded one.

>>> check_positive("spike", window=9)
>>> check_positive("spike", window=0)
Traceback (most recent call last):
...
sdcwatch.core.errors.ConfigError: spike.window: must be a positive number, got 0
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping
from urllib.parse import urlsplit

from sdcwatch.core.errors import ConfigError

__all__ = [
    "check_known",
    "check_int",
    "check_number",
    "check_choice",
    "settings_from",
    "check_positive",
    "check_type",
    "describe",
    "is_host",
    "url_problem",
    "redact_url",
    "is_secret",
    "topic_problem",
    "did_you_mean",
    "duration_seconds",
    "KIND_NAMES",
]

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
#: Seconds in a unit of a duration (a number alone is seconds): the commands' one duration syntax.
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?)\s*([smhdw]?)")

#: How a value of each settable type is named in an error message.
KIND_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    Path: "a path",
    dict: "a table",
    tuple: "an array of strings",
}


def check_positive(owner: str, **values: float) -> None:
    """Raise ConfigError('<owner>.<key>') for any value that is not a positive number."""
    for key, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"{owner}.{key}", f"must be a positive number, got {v!r}")


def check_known(owner: str, given: Iterable[str], known: Iterable[str], *, where: str = "") -> None:
    """Raise ConfigError('<owner>.<key>') for the first key of ``given`` not in ``known``, naming
    the known ones (and the closest, when one is close); ``where`` says where it was read.

    >>> check_known("guard", ["window"], ["window", "warmup"])
    >>> check_known("guard", ["windw"], ["window", "warmup"])
    Traceback (most recent call last):
    ...
    sdcwatch.core.errors.ConfigError: guard.windw: unknown setting (did you mean window?) (known: warmup, window)
    """
    known = set(known)
    for key in given:
        if key not in known:
            place = f" in {where}" if where else ""
            raise ConfigError(
                f"{owner}.{key}",
                f"unknown setting{place}{did_you_mean(key, known)} (known: {', '.join(sorted(known))})",
            )


def _bound_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi:g}"
    return ""


def _in_bounds(v: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> bool:
    if lo is not None and (v <= lo if lo_open else v < lo):
        return False
    return not (hi is not None and (v >= hi if hi_open else v > hi))


def check_int(key: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` when it is an integer (not a bool) within ``[lo, hi]``, else raise naming ``key``.

    >>> check_int("probes.every", 0, lo=1)
    Traceback (most recent call last):
    ...
    sdcwatch.core.errors.ConfigError: probes.every: must be an integer >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int) or not _in_bounds(value, lo, hi, False, False):
        bound = _bound_text(lo, hi, False, False)
        raise ConfigError(key, f"must be an integer{' ' + bound if bound else ''}, got {value!r}")
    return value


def check_number(
    key: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """Return ``value`` when it is a finite number (not a bool) within its bounds (``lo_open``:
    ``lo`` itself refused), else raise naming ``key``.

    >>> check_number("guard.lr_factor", 0.0, 0, 1, lo_open=True)
    Traceback (most recent call last):
    ...
    sdcwatch.core.errors.ConfigError: guard.lr_factor: must be a number in (0, 1], got 0.0
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not _in_bounds(value, lo, hi, lo_open, hi_open):
        bound = _bound_text(lo, hi, lo_open, hi_open)
        raise ConfigError(key, f"must be a number{' ' + bound if bound else ''}, got {value!r}")
    return value


def check_choice(key: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return ``value`` when it is one of ``choices``, else raise naming ``key`` and the choices.

    >>> check_choice("guard.on_fault", "stop", ("rerun", "skip"))
    Traceback (most recent call last):
    ...
    sdcwatch.core.errors.ConfigError: guard.on_fault: must be one of rerun, skip, got 'stop'
    """
    options = list(choices)
    if value not in options:
        hint = did_you_mean(value, [str(c) for c in options]) if isinstance(value, str) else ""
        raise ConfigError(key, f"must be one of {', '.join(str(c) for c in options)}, got {value!r}{hint}")
    return value


def settings_from(
    cls: type, owner: str, settings: dict[str, Any], *, where: str = "", renamed: Mapping[str, str] | None = None
) -> Any:
    """An instance of the dataclass ``cls`` from ``settings`` (a dict read from TOML or JSON, or
    keyword settings), an unknown key refused naming it and the known ones (:func:`check_known`), a
    ``renamed`` one its new name. The dataclass's own ``__post_init__`` checks the values."""
    for key in settings:
        if renamed and key in renamed:
            raise ConfigError(f"{owner}.{key}", f"renamed: use {renamed[key]}")
    check_known(owner, settings, (f.name for f in dataclasses.fields(cls)), where=where)
    return cls(**settings)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``choices``, or "" when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def describe(value: Any) -> str:
    """A value with its type, the way a TOML user would call it (``integer 3``, ``string 'x'``)."""
    names = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "table", list: "array"}
    return f"{names.get(type(value), type(value).__name__)} {value!r}"


def check_type(key: str, value: Any, kind: type) -> Any:
    """Return ``value`` as ``kind`` (int -> float, str -> Path) or raise naming ``key``."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is Path and isinstance(value, str):
        value = Path(value)
    if kind is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = tuple(value)
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if not ok:
        got = describe(value)
        if is_secret(key):  # name the key, never the value
            got = got.split(" ")[0] + " (value not shown: the key holds a secret)"
        raise ConfigError(key, f"must be {KIND_NAMES.get(kind, kind.__name__)}, got {got}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")
    return value


def is_host(text: str) -> bool:
    """True for an IP address or a syntactically valid host name."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(text))


def url_problem(url: str) -> str:
    """What is wrong with an http(s) URL, or "" when nothing is (credentials in it never shown)."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        parts.port  # raises ValueError on a bad port
    except ValueError as exc:
        return f"{shown!r} is not a valid URL ({str(exc).replace(url, shown)})"
    if parts.scheme not in ("http", "https"):
        return f"{shown!r} must start with http:// or https://"
    if not parts.hostname:
        return f"{shown!r} has no host"
    return ""


_SECRET = re.compile(r"password|secret|token", re.IGNORECASE)


def is_secret(key: str) -> bool:
    """Whether the value of the setting ``key`` must never be shown (passwords, tokens, secrets).

    >>> is_secret("bus.security.sasl_plain_password"), is_secret("metrics.port")
    (True, False)
    """
    return bool(_SECRET.search(key))


def redact_url(url: str) -> str:
    """``url`` with the password of its user info replaced, for logs and errors.

    >>> redact_url("http://ops:hunter2@am:9093/api"), redact_url("http://am:9093")
    ('http://ops:***@am:9093/api', 'http://am:9093')
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}" if user else f"***@{host}").geturl()


def topic_problem(topic: str) -> str:
    """What is wrong with a Kafka topic name, or "" when nothing is."""
    if not _TOPIC.match(topic) or topic in (".", ".."):
        return f"{topic!r} is not a Kafka topic name (1-249 of letters, digits, '.', '_', '-')"
    return ""


def duration_seconds(text: str) -> float | None:
    """Seconds of a duration (``90``, ``90s``, ``30m``, ``1.5h``, ``7d``, ``2 w``), None for anything else.

    >>> duration_seconds("36h"), duration_seconds("10 min")
    (129600.0, None)
    """
    m = _DURATION.fullmatch(text.strip())
    return None if m is None else float(m[1]) * _UNITS[m[2] or "s"]
