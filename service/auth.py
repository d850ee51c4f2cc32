"""The service's side of the job keys: :class:`Authenticator` verifies each signed message before it is
decoded, binds each run to the key of its first verified message when that key is issued for the run's
name, and keeps the start each run announced (decisions carry it). Unsigned messages are refused, or
accepted for runs no key has claimed (``unsigned = "accept"``). A failure is dead-lettered ``auth``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from sdcwatch.core.control import JobStart
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.signing import AuthError, JobKey, Keyring, RunBindings, is_signed
from sdcwatch.core.validate import check_choice

__all__ = ["Authenticator", "UNSIGNED_POLICIES", "RUN_REFUSALS"]

log = logging.getLogger("sdcwatch.service.auth")

#: What the service does with an unsigned message when it holds keys.
UNSIGNED_POLICIES = ("refuse", "accept")
#: Why a run was refused to a key (the ``reason`` label of ``sdcwatch_auth_runs_refused_total``):
#: the key is not issued for the name, another key holds the run, no binding is free, or an unsigned
#: message for a run a key holds.
RUN_REFUSALS = ("run_name", "bound", "full", "unsigned")


class Authenticator:
    """Opens signed messages and enforces run-to-key bindings.

    Args:
        keyring: the keys this service accepts (and the run names each is issued for).
        unsigned: ``refuse`` (default) or ``accept`` unsigned messages for runs no key has claimed.
        max_runs: bindings kept (far above the runs a service watches); ``idle_s``: how long a run
            sends nothing before a new one may take its binding when they are all used.
        log_every: seconds between two log lines about runs refused to one key for one reason.

    ``refused`` counts the messages refused for a run by (key id or "unsigned", reason): a small,
    bounded set of labels (the keys times :data:`RUN_REFUSALS`).
    """

    def __init__(
        self,
        keyring: Keyring,
        *,
        unsigned: str = "refuse",
        max_runs: int = 100_000,
        idle_s: float = 900.0,
        log_every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_choice("auth.unsigned", unsigned, UNSIGNED_POLICIES)
        if not len(keyring):
            raise ConfigError("auth.key_file", "holds no key")
        self.keyring = keyring
        self.unsigned = unsigned
        self.log_every = log_every
        self.bindings = RunBindings(max_runs, idle_s=idle_s, may_use=keyring.may_use, clock=clock)
        self.refused: dict[tuple[str, str], int] = {}
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # (kid, reason) -> (when, count then)

    def open(self, value: bytes) -> tuple[bytes, str | None]:
        """(the message inside ``value``, its key id; None for an unsigned one the policy accepts)."""
        if is_signed(value):
            kid, message = self.keyring.verify(value)
            return message, kid
        if self.unsigned == "refuse":
            raise AuthError("signature", "the message is not signed and this service requires signed telemetry")
        return value, None

    def bind(self, runs: Iterable[str], kid: str | None) -> None:
        """Check that ``kid`` (None: unsigned) may speak for each run, binding new ones; AuthError if not."""
        b = self.bindings
        if kid is None:
            for run in runs:
                bound = b.kid_of(run)
                if bound is not None:
                    self._refuse("unsigned", "unsigned", run, f"run {run[:80]!r} signs with key {bound!r}")
                    raise AuthError("signature", f"run {run[:80]!r} signs with key {bound!r}; this message is unsigned")
            return
        now = b.clock()
        for run in runs:
            refusal = b.check(run, kid, now)
            if refusal is not None:
                self._refuse(kid, refusal[0], run, refusal[1])
                raise AuthError("signature", refusal[1])

    def note_start(self, message: bytes, kid: str | None) -> JobStart:
        """A job's start announcement (``message``, opened): the run's nonce for its decisions.
        Only a signed one, from a key that may speak for the run; AuthError or LimitError if not."""
        start = JobStart.decode(message)
        if kid is None:
            raise AuthError("signature", f"an unsigned start announcement for run {start.run[:80]!r}")
        self.bind((start.run,), kid)
        self.bindings.note_start(start.run, start.nonce, start.started_at)
        return start

    def _refuse(self, kid: str, reason: str, run: str, why: str) -> None:
        """Count a refused run and say so, naming it: at most one line per ``log_every`` seconds per
        (key, reason), with how many were refused since the last line."""
        label = (kid, reason)
        n = self.refused[label] = self.refused.get(label, 0) + 1
        now = self.bindings.clock()
        when, before = self._logged.get(label, (None, 0))
        if when is None or now - when >= self.log_every:
            self._logged[label] = (now, n)
            log.warning(
                "auth: refused run %r (%s; %d such message(s) since the last line): %s",
                run[:80],
                reason,
                n - before,
                why,
            )

    def key_of(self, run: str) -> JobKey | None:
        """The key ``run`` is bound to (the service signs its control decisions with it), or None."""
        kid = self.bindings.kid_of(run)
        return None if kid is None else self.keyring.get(kid)

    def nonce_of(self, run: str) -> str:
        """The nonce of the newest start ``run`` announced, which its decisions carry ("" when none)."""
        return self.bindings.nonce_of(run)

    def warn_unrestricted(self) -> None:
        """Say at start which keys carry no run patterns: each may claim any run name no key holds yet."""
        loose = self.keyring.unrestricted
        if loose:
            log.warning(
                "auth: key(s) %s carry no runs= patterns: each may claim any run name no other key holds "
                "yet (add ' runs=PATTERN,...' to their lines in the key file)",
                ", ".join(loose),
            )
