"""The service's side of the job keys: verify each message before it is decoded, bind runs to keys.

With a keyring (``[auth]`` in ``sdcwatch serve``), :class:`Authenticator` opens each signed
message (:mod:`sdcwatch.core.signing`) before anything reaches a decoder or a detector, and checks
that the key may speak for every run the message names: a run's first verified message binds it to
that key id. A message that fails is dead-lettered ``auth`` and counted; the rest of the poll goes
on. Unsigned messages are refused (``unsigned = "refuse"``, the default once keys are set) or, while
a fleet moves to signing, accepted for runs that no key has claimed (``unsigned = "accept"``); an
unsigned message never speaks for a run bound to a key.
"""

from __future__ import annotations

from typing import Iterable

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.signing import AuthError, JobKey, Keyring, RunBindings, is_signed

__all__ = ["Authenticator", "UNSIGNED_POLICIES"]

#: What the service does with an unsigned message when it holds keys.
UNSIGNED_POLICIES = ("refuse", "accept")


class Authenticator:
    """Opens signed messages and enforces run-to-key bindings.

    Args:
        keyring: the keys this service accepts.
        unsigned: ``refuse`` (default) or ``accept`` unsigned messages for runs no key has claimed.
        max_runs: bindings kept (the oldest forgotten first; far above the runs a service watches).
    """

    def __init__(self, keyring: Keyring, *, unsigned: str = "refuse", max_runs: int = 100_000) -> None:
        if unsigned not in UNSIGNED_POLICIES:
            raise ConfigError("auth.unsigned", f"must be one of {', '.join(UNSIGNED_POLICIES)}, got {unsigned!r}")
        if not len(keyring):
            raise ConfigError("auth.key_file", "holds no key")
        self.keyring = keyring
        self.unsigned = unsigned
        self.bindings = RunBindings(max_runs)

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
        for run in runs:
            if kid is None:
                bound = b.kid_of(run)
                if bound is not None:
                    raise AuthError("signature", f"run {run[:80]!r} signs with key {bound!r}; this message is unsigned")
                continue
            why = b.check(run, kid)
            if why is not None:
                raise AuthError("signature", why)

    def key_of(self, run: str) -> JobKey | None:
        """The key ``run`` is bound to (the service signs its control decisions with it), or None."""
        kid = self.bindings.kid_of(run)
        return None if kid is None else self.keyring.get(kid)
