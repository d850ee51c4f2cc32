"""The service's side of the job keys: :class:`Authenticator` verifies each signed message before it is
decoded and binds each run to the key of its first verified message; unsigned messages are refused,
or accepted for runs no key has claimed (``unsigned = "accept"``). A failure is dead-lettered ``auth``.
"""

from __future__ import annotations

from typing import Iterable

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.signing import AuthError, JobKey, Keyring, RunBindings, is_signed
from sdcwatch.core.validate import check_choice

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
        check_choice("auth.unsigned", unsigned, UNSIGNED_POLICIES)
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
