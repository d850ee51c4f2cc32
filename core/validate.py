"""The validators every layer uses: each raises :class:`~sdcwatch.core.errors.ConfigError`
naming the dotted key of the bad value, so a setting made in code is checked like a loaded one.

>>> check_positive("spike", window=9)
>>> check_positive("spike", window=0)
Traceback (most recent call last):
...
sdcwatch.core.errors.ConfigError: spike.window: must be a positive number, got 0
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

from sdcwatch.core.errors import ConfigError

__all__ = [
    "check_positive",
    "check_type",
    "describe",
    "is_host",
    "url_problem",
    "redact_url",
    "is_secret",
    "topic_problem",
    "did_you_mean",
    "KIND_NAMES",
]

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
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
