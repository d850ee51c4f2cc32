"""Signed messages: a job key with which each rank signs what it sends and the service signs what it decides.

A key has an id (``kid``, so keys rotate) and a secret; a signed message is the unsigned one behind
an HMAC-SHA256 envelope (layout and where it is used: docs/messages.md). The secret is never
printed: :class:`JobKey` and :class:`Keyring` show key ids only. Standard library only.
"""

from __future__ import annotations

import hmac
import os
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Mapping

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.limits import LimitError

__all__ = [
    "SIGNED_MAGIC",
    "AuthError",
    "JobKey",
    "Keyring",
    "RunBindings",
    "job_key_from_env",
    "is_signed",
    "parse_key",
    "KEY_ENV",
    "KEY_FILE_ENV",
]

SIGNED_MAGIC = b"SDCS"
_VERSION = 1
_TAG = 32
#: The variable that holds a job key, ``kid:secret`` (prefer the file: a variable is visible to
#: whoever can read the process's environment).
KEY_ENV = "SDCWATCH_KEY"
#: The variable that names a file holding the job key, ``kid:secret`` on one line.
KEY_FILE_ENV = "SDCWATCH_KEY_FILE"
_MIN_SECRET = 16
try:  # OpenSSL's one-shot HMAC without hmac.digest's Python frame (it is what hmac.digest calls)
    from _hashlib import hmac_digest as _hmac_digest
except ImportError:  # pragma: no cover - a Python built without OpenSSL
    _hmac_digest = hmac.digest
_MAX_KID = 64


class AuthError(LimitError):
    """A message whose signature is missing, unknown or wrong, or whose key may not speak for its
    run (dead-letter reason ``auth``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem, "auth")


def parse_key(text: str, where: str) -> tuple[str, bytes]:
    """``kid:secret`` -> (kid, secret bytes); ConfigError naming ``where`` (never the secret)."""
    kid, sep, secret = text.strip().partition(":")
    kid = kid.strip()
    if not sep or not kid:
        raise ConfigError(where, "must be kid:secret (a key id, a colon, then the secret)")
    if len(kid.encode()) > _MAX_KID or not all(c.isalnum() or c in "-_." for c in kid):
        raise ConfigError(where, f"the key id {kid[:70]!r} must be 1-{_MAX_KID} letters, digits, '-', '_' or '.'")
    raw = secret.strip().encode("utf-8")
    if len(raw) < _MIN_SECRET:
        raise ConfigError(where, f"the secret of key {kid!r} is {len(raw)} bytes; at least {_MIN_SECRET} are needed")
    return kid, raw


class JobKey:
    """One key: signs messages (a rank, the service for one run) and verifies them (the guard)."""

    __slots__ = ("kid", "_secret", "_prefix")

    def __init__(self, kid: str, secret: bytes) -> None:
        if not kid or len(kid.encode()) > _MAX_KID:
            raise ConfigError("key", f"a key id must be 1-{_MAX_KID} bytes")
        if len(secret) < _MIN_SECRET:
            raise ConfigError("key", f"the secret of key {kid!r} must be at least {_MIN_SECRET} bytes")
        self.kid = kid
        self._secret = bytes(secret)
        k = kid.encode()
        self._prefix = SIGNED_MAGIC + bytes((_VERSION, len(k))) + k

    @classmethod
    def parse(cls, text: str, where: str = "key") -> "JobKey":
        return cls(*parse_key(text, where))

    def sign(self, message: bytes) -> bytes:
        """The signed envelope around ``message``."""
        return self._prefix + _hmac_digest(self._secret, message, "sha256") + message

    def tag(self, message: bytes | memoryview) -> bytes:
        """The tag of ``message`` under this key (HMAC-SHA256)."""
        return _hmac_digest(self._secret, message, "sha256")

    def open(self, value: bytes) -> bytes:
        """The message inside ``value`` signed with this key; AuthError when it is not."""
        kid, message = Keyring({self.kid: self}).verify(value)
        return message

    def __repr__(self) -> str:  # never the secret
        return f"JobKey(kid={self.kid!r})"

    __str__ = __repr__


def is_signed(value: bytes) -> bool:
    return value[:4] == SIGNED_MAGIC


class Keyring:
    """The keys a service accepts, by id. ``verify`` returns (kid, message) or raises AuthError."""

    def __init__(self, keys: Mapping[str, JobKey] | Iterable[JobKey] = ()) -> None:
        items = keys.values() if isinstance(keys, Mapping) else keys
        self._keys: dict[str, JobKey] = {}
        for k in items:
            if k.kid in self._keys:
                raise ConfigError("auth.keys", f"the key id {k.kid!r} is given twice")
            self._keys[k.kid] = k
        self._raw = {k.kid.encode(): k for k in self._keys.values()}  # by the id's bytes on the wire

    @classmethod
    def from_text(cls, text: str, where: str = "auth.key_file") -> "Keyring":
        """One ``kid:secret`` a line; blank lines and ``#`` comments skipped."""
        keys = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(JobKey(*parse_key(line, f"{where} line {n}")))
        return cls(keys)

    @classmethod
    def from_file(cls, path: str | os.PathLike, where: str = "auth.key_file") -> "Keyring":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(where, f"cannot read {path}: {exc.strerror or exc}") from None
        ring = cls.from_text(text, where)
        if not ring:
            raise ConfigError(where, f"{path} holds no key (one kid:secret a line)")
        return ring

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, kid: str) -> bool:
        return kid in self._keys

    def get(self, kid: str) -> JobKey | None:
        return self._keys.get(kid)

    @property
    def kids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def verify(self, value: bytes) -> tuple[str, bytes]:
        """(kid, message) of a signed ``value``; AuthError saying what is wrong (never a secret).

        The hot path of a signed ingest (one call per message): index and slice, one dict lookup,
        one HMAC in C.
        """
        if value[:4] != SIGNED_MAGIC or len(value) < 6:
            raise AuthError("signature", "the message is not signed" if value[:4] != SIGNED_MAGIC else "truncated")
        if value[4] != _VERSION:
            raise AuthError("signature", f"envelope version {value[4]}, this service reads {_VERSION}")
        start = 6 + value[5]
        key = self._raw.get(value[6:start])
        if key is None:
            kid = value[6:start].decode("utf-8", "replace")
            raise AuthError("signature", f"signed with key {kid[:_MAX_KID]!r}, which this service does not hold")
        message = value[start + _TAG :]
        if len(value) < start + _TAG or not hmac.compare_digest(value[start : start + _TAG], key.tag(message)):
            raise AuthError("signature", f"does not verify under key {key.kid!r} (forged or altered)")
        return key.kid, message

    def __repr__(self) -> str:
        return f"Keyring(kids={list(self._keys)!r})"


class RunBindings:
    """Which key each run is bound to: its first verified message binds it (bounded; oldest first out).

    A run bound to a key is spoken for by that key only; the service signs the run's control
    decisions with it. Kept in the service's state, so a restart keeps the bindings.
    """

    def __init__(self, max_runs: int = 100_000) -> None:
        self.max_runs = max_runs
        self._kid: OrderedDict[str, str] = OrderedDict()

    def check(self, run: str, kid: str) -> str | None:
        """None when ``kid`` may speak for ``run`` (binding it if new); else why not."""
        bound = self._kid.get(run)
        if bound == kid:  # the hot path: every message of a bound run
            return None
        if bound is None:
            if len(self._kid) >= self.max_runs:
                self._kid.popitem(last=False)
            self._kid[run] = kid
            return None
        if bound != kid:
            return f"run {run[:80]!r} is bound to key {bound!r}; this message is signed with key {kid!r}"
        return None

    def kid_of(self, run: str) -> str | None:
        return self._kid.get(run)

    def forget(self, run: str) -> None:
        self._kid.pop(run, None)

    def __len__(self) -> int:
        return len(self._kid)

    def snapshot(self) -> dict[str, str]:
        return dict(self._kid)

    def restore(self, state: Mapping[str, str]) -> None:
        for run, kid in state.items():
            if isinstance(run, str) and isinstance(kid, str):
                self._kid[run] = kid


def job_key_from_env(env: Mapping[str, str] | None = None) -> JobKey | None:
    """The job key of this process: the file ``SDCWATCH_KEY_FILE`` names, else ``SDCWATCH_KEY``
    (``kid:secret``); None when neither is set. ConfigError when one is set but unusable."""
    env = os.environ if env is None else env
    path = env.get(KEY_FILE_ENV)
    if path:
        ring = Keyring.from_file(path, KEY_FILE_ENV)
        if len(ring) != 1:
            raise ConfigError(KEY_FILE_ENV, f"{path} must hold exactly one key for a job, it holds {len(ring)}")
        return ring.get(ring.kids[0])
    text = env.get(KEY_ENV)
    if text:
        return JobKey(*parse_key(text, KEY_ENV))
    return None
