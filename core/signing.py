"""Signed messages: a job key with which each rank signs what it sends and the service signs what it decides.

A key has an id (``kid``, so keys rotate) and a secret; a signed message is the unsigned one behind
an HMAC-SHA256 envelope (layout and where it is used: docs/messages.md); a fresh envelope also carries
the signer's start (a nonce and when) and the message's number under it, so the service refuses a
replay (:class:`~sdcwatch.service.auth.Authenticator`). The secret is never
printed: :class:`JobKey` and :class:`Keyring` show key ids only. A key may be issued for some run
names only (``runs=`` patterns in the key file); :class:`RunBindings` holds which key speaks for each
run. Standard library only.
"""

from __future__ import annotations

import fnmatch
import hmac
import itertools
import os
import struct
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Mapping

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
    "RUNS_FIELD",
    "SERVICE_KID",
    "Freshness",
]

SIGNED_MAGIC = b"SDCS"
_VERSION = 1
_FRESH = 2  # the envelope that carries the signer's start and the message's number
_TAG = 32
_START = struct.Struct(">8sdQ")  # nonce, started_at (unix s), number of the message under that start
#: (nonce, started_at, message number) of a fresh envelope.
Freshness = tuple[bytes, float, int]
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
#: What follows a key in a key file line to say which run names it may use (comma-separated patterns).
RUNS_FIELD = " runs="
#: The reserved key id of the service's own key in its key file (``sdcwatch.service:secret``): when
#: present, the only source of the keys the service signs its own topics with; never a job key.
SERVICE_KID = "sdcwatch.service"
_MAX_PATTERNS = 64


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

    __slots__ = ("kid", "_secret", "_prefix", "_fresh", "_start", "_numbers")

    def __init__(self, kid: str, secret: bytes) -> None:
        if not kid or len(kid.encode()) > _MAX_KID:
            raise ConfigError("key", f"a key id must be 1-{_MAX_KID} bytes")
        if len(secret) < _MIN_SECRET:
            raise ConfigError("key", f"the secret of key {kid!r} must be at least {_MIN_SECRET} bytes")
        self.kid = kid
        self._secret = bytes(secret)
        k = kid.encode()
        self._prefix = SIGNED_MAGIC + bytes((_VERSION, len(k))) + k
        self._fresh = SIGNED_MAGIC + bytes((_FRESH, len(k))) + k
        # this signer's start: a replay of what it signed, or of an earlier start's, is told apart
        self._start = (os.urandom(8), time.time())
        self._numbers = itertools.count()

    @classmethod
    def parse(cls, text: str, where: str = "key") -> "JobKey":
        return cls(*parse_key(text, where))

    def sign(self, message: bytes, *, fresh: bool = True) -> bytes:
        """The signed envelope around ``message``: fresh (this key's start and the message's number
        under it, signed too) unless ``fresh=False`` (a decision, which carries its own, and what
        readers of an earlier release must still verify)."""
        if not fresh:
            return self._prefix + _hmac_digest(self._secret, message, "sha256") + message
        body = _START.pack(*self._start, next(self._numbers)) + message
        return self._fresh + _hmac_digest(self._secret, body, "sha256") + body

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
    """The keys a service accepts, by id. ``verify`` returns (kid, message) or raises AuthError.

    ``runs`` maps a key id to the run-name patterns (``fnmatch``: ``job-a``, ``team-a-*``) it is
    issued for; a key with none may use any run name no other key holds (as before run patterns).
    ``service``: the service's own key (:data:`SERVICE_KID`), which verifies no job's message.
    """

    def __init__(
        self,
        keys: Mapping[str, JobKey] | Iterable[JobKey] = (),
        runs: Mapping[str, Iterable[str]] | None = None,
        service: JobKey | None = None,
    ) -> None:
        items = keys.values() if isinstance(keys, Mapping) else keys
        self._keys: dict[str, JobKey] = {}
        for k in items:
            if k.kid in self._keys:
                raise ConfigError("auth.keys", f"the key id {k.kid!r} is given twice")
            self._keys[k.kid] = k
        self._raw = {k.kid.encode(): k for k in self._keys.values()}  # by the id's bytes on the wire
        self._runs = {kid: tuple(p) for kid, p in (runs or {}).items() if kid in self._keys}
        self.service = service

    @classmethod
    def from_text(cls, text: str, where: str = "auth.key_file") -> "Keyring":
        """One ``kid:secret`` a line, optionally followed by `` runs=pattern,pattern``, and at most one
        line of the service's own key (:data:`SERVICE_KID`, without ``runs=``); blank lines and ``#``
        comments skipped."""
        keys, runs, service = [], {}, None
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                line, sep, patterns = line.rpartition(RUNS_FIELD) if RUNS_FIELD in line else (line, "", "")
                key = JobKey(*parse_key(line, f"{where} line {n}"))
                if key.kid == SERVICE_KID:
                    if sep or service is not None:
                        raise ConfigError(f"{where} line {n}", f"one {SERVICE_KID} line, without runs=")
                    service = key
                    continue
                keys.append(key)
                if sep:
                    runs[key.kid] = _patterns(patterns, f"{where} line {n}")
        return cls(keys, runs, service)

    @classmethod
    def from_file(cls, path: str | os.PathLike, where: str = "auth.key_file") -> "Keyring":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(where, f"cannot read {path}: {exc.strerror or exc}") from None
        ring = cls.from_text(text, where)
        if not ring and ring.service is None:
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

    @property
    def unrestricted(self) -> tuple[str, ...]:
        """The key ids issued without run patterns (each may claim any run name no key holds yet)."""
        return tuple(kid for kid in self._keys if kid not in self._runs)

    def runs_of(self, kid: str) -> tuple[str, ...] | None:
        """The run-name patterns of key ``kid``; None when it has none (any run name)."""
        return self._runs.get(kid)

    def may_use(self, kid: str, run: str) -> bool:
        """Whether key ``kid`` is one of this ring's and issued for run name ``run``."""
        if kid not in self._keys:
            return False
        patterns = self._runs.get(kid)
        return patterns is None or any(fnmatch.fnmatchcase(run, p) for p in patterns)

    def service_key(self, purpose: str) -> JobKey:
        """The service's own key for ``purpose`` (e.g. its state): made from the :data:`SERVICE_KID`
        key alone when the ring has one, else from every job key (whose holder cannot make it unless
        the ring holds only that key)."""
        keys = [self.service] if self.service is not None else [self._keys[kid] for kid in sorted(self._keys)]
        tags = b"".join(k.tag(purpose.encode()) for k in keys)
        return JobKey(f"service.{purpose}"[:_MAX_KID], hmac.digest(b"sdcwatch.service", tags, "sha256"))

    def verify(self, value: bytes) -> tuple[str, bytes]:
        """(kid, message) of a signed ``value``; AuthError saying what is wrong (never a secret)."""
        kid, message, _ = self.verify_fresh(value)
        return kid, message

    def verify_fresh(self, value: bytes) -> tuple[str, bytes, Freshness | None]:
        """(kid, message, its :data:`Freshness` or None for an envelope without it) of a signed
        ``value``; AuthError saying what is wrong (never a secret).

        The hot path of a signed ingest (one call per message): index and slice, one dict lookup,
        one HMAC in C.
        """
        if value[:4] != SIGNED_MAGIC or len(value) < 6:
            raise AuthError("signature", "the message is not signed" if value[:4] != SIGNED_MAGIC else "truncated")
        version = value[4]
        if version != _VERSION and version != _FRESH:
            raise AuthError("signature", f"envelope version {version}, this service reads {_VERSION} and {_FRESH}")
        start = 6 + value[5]
        key = self._raw.get(value[6:start])
        if key is None:
            kid = value[6:start].decode("utf-8", "replace")
            raise AuthError("signature", f"signed with key {kid[:_MAX_KID]!r}, which this service does not hold")
        body = value[start + _TAG :]
        if len(value) < start + _TAG or not hmac.compare_digest(value[start : start + _TAG], key.tag(body)):
            raise AuthError("signature", f"does not verify under key {key.kid!r} (forged or altered)")
        if version == _VERSION:
            return key.kid, body, None
        if len(body) < _START.size:
            raise AuthError("signature", "truncated")
        return key.kid, body[_START.size :], _START.unpack_from(body)

    def __repr__(self) -> str:
        return f"Keyring(kids={list(self._keys)!r})"


def _patterns(text: str, where: str) -> tuple[str, ...]:
    patterns = tuple(p.strip() for p in text.split(","))
    if not patterns or len(patterns) > _MAX_PATTERNS or not all(0 < len(p) <= 1024 for p in patterns):
        raise ConfigError(where, f"runs= must be 1-{_MAX_PATTERNS} comma-separated run-name patterns")
    return patterns


class RunBindings:
    """Which key each run is bound to: its first verified message binds it, when ``may_use`` allows
    that key that run name. A run bound to a key is spoken for by that key only; the service signs
    the run's control decisions with it, carrying the start the run announced last (its nonce).

    At most ``max_runs`` bindings: a new run takes the place of the one unused longest only when that
    one has sent nothing for ``idle_s`` seconds, else it is refused (a flood of run names never
    unbinds a live run). Kept in the service's state, so a restart keeps the bindings.
    """

    def __init__(
        self,
        max_runs: int = 100_000,
        *,
        idle_s: float = 900.0,
        may_use: Callable[[str, str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_runs, self.idle_s, self.may_use, self.clock = max_runs, idle_s, may_use, clock
        self._kid: OrderedDict[str, str] = OrderedDict()  # least recently used first
        self._used: dict[str, float] = {}
        self._start: dict[str, tuple[float, str]] = {}  # run -> (started_at, nonce) of its newest start

    def check(self, run: str, kid: str, now: float) -> tuple[str, str] | None:
        """None when ``kid`` may speak for ``run`` (binding it if new; ``now``: ``clock()``); else (reason code, why):
        ``run_name`` (the key is not issued for it), ``bound`` (another key holds it), ``full``."""
        bound = self._kid.get(run)
        if bound == kid:  # the hot path: every message of a bound run
            if now - self._used[run] > 1.0:
                self._used[run] = now
                self._kid.move_to_end(run)
            return None
        if bound is not None:
            return "bound", f"run {run[:80]!r} is bound to key {bound!r}; this message is signed with key {kid!r}"
        if self.may_use is not None and not self.may_use(kid, run):
            return "run_name", f"key {kid!r} is not issued for run {run[:80]!r} (its runs= patterns)"
        if len(self._kid) >= self.max_runs:
            oldest = next(iter(self._kid))
            if now - self._used[oldest] < self.idle_s:
                return "full", f"run {run[:80]!r}: {len(self._kid)} runs are bound and none idle for {self.idle_s:g} s"
            self.forget(oldest)
        self._kid[run] = kid
        self._used[run] = now
        return None

    def kid_of(self, run: str) -> str | None:
        return self._kid.get(run)

    def note_start(self, run: str, nonce: str, started_at: float) -> None:
        """A start of bound ``run`` announced with ``nonce``: kept when newer than the one held."""
        if run in self._kid and started_at > self._start.get(run, (float("-inf"), ""))[0]:
            self._start[run] = (started_at, nonce)

    def nonce_of(self, run: str) -> str:
        """The nonce of the newest start ``run`` announced ("" when none)."""
        return self._start.get(run, (0.0, ""))[1]

    def forget(self, run: str) -> None:
        self._kid.pop(run, None)
        self._used.pop(run, None)
        self._start.pop(run, None)

    def __len__(self) -> int:
        return len(self._kid)

    def snapshot(self) -> dict[str, str | list]:
        """run -> key id, or [key id, started_at, nonce] for a run that announced its start."""
        return {run: [kid, *self._start[run]] if run in self._start else kid for run, kid in self._kid.items()}

    def restore(self, state: Mapping[str, str | list]) -> None:
        """Bindings from :meth:`snapshot` (counted as used now); those ``may_use`` no longer allows dropped."""
        now = self.clock()
        for run, held in state.items():
            kid, start = (held, None) if isinstance(held, str) else (held[0] if held else None, held[1:])
            if not isinstance(run, str) or not isinstance(kid, str):
                continue
            if self.may_use is not None and not self.may_use(kid, run):
                continue
            self._kid[run] = kid
            self._used[run] = now
            if start and len(start) == 2 and isinstance(start[0], (int, float)) and isinstance(start[1], str):
                self._start[run] = (float(start[0]), start[1])


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
