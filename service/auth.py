"""The service's side of the job keys: :class:`Authenticator` verifies each signed message before it is
decoded, refuses one signed before (:class:`SignerStarts`: each signer's start and the numbers it used)
unless it is the very message read again at its place in the topic (a rebalance or a restart: taken
again, counted apart),
binds each run to the key of its first verified message when that key is issued for the run's name, and
keeps the start each run announced (decisions carry it). Unsigned messages are refused, or accepted for
runs no key has claimed (``unsigned = "accept"``). A failure is dead-lettered ``auth``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

from sdcwatch.core.control import JobStart
from sdcwatch.core.errors import ConfigError
from sdcwatch.core.signing import SERVICE_KID, AuthError, Freshness, JobKey, Keyring, RunBindings, is_signed
from sdcwatch.core.validate import check_choice

__all__ = ["Authenticator", "SignerStarts", "UNSIGNED_POLICIES", "RUN_REFUSALS"]

log = logging.getLogger("sdcwatch.service.auth")

#: What the service does with an unsigned message when it holds keys.
UNSIGNED_POLICIES = ("refuse", "accept")
#: Why a message was refused to a key (the ``reason`` label of ``sdcwatch_auth_runs_refused_total``):
#: the key is not issued for the name, another key holds the run, no binding is free, an unsigned
#: message for a run a key holds; a replay (``replayed``: its number under its signer's start was
#: used), a start older than one forgotten (``stale``) or ahead of this clock (``future``), an envelope
#: without a start from a key that sends fresh ones (``unfresh``).
RUN_REFUSALS = ("run_name", "bound", "full", "unsigned", "replayed", "stale", "future", "unfresh")


class SignerStarts:
    """What each signer (a job key in one process, from its start) has had taken: the numbers of its
    messages, as a few spans, so a message signed once is taken once, across restarts of the service
    (kept in its state). ``check`` returns None or (reason, why).

    Bounded by key, so that one key's traffic never costs another key anything: at most ``max_starts``
    starts a key (its least recently heard forgotten first; a start of that key no newer than a
    forgotten one is then ``stale``), and at most ``max_gaps`` gaps between the spans of all its starts
    (a start that opens one more fills its own oldest gap: a message from that gap is then
    ``replayed``). A signer writing several partitions is read out of order across them, which opens
    gaps until the reading evens out: up to a poll's messages a partition (``max_poll_records``), so
    the bound sits well above it. A start stamped more than ``skew_s`` ahead of this clock is
    ``future``. A key that has sent a fresh envelope may not send one without a start (``unfresh``: an
    earlier release's emitter shares it, or a capture is replayed).

    ``check``'s ``at`` (topic/partition, offset) tells a re-read from a replay: a taken number read at
    an offset no later than the last checked in that partition is the message at that place read
    again (a rebalance or a restart re-delivers from the committed offset, which may be behind what
    was checked; a replay is appended past the end, and no writer can write at an earlier offset):
    ``redelivered``, not ``replayed``, and taken again (the pipeline drops what it already had). One
    offset a partition, kept in the snapshot with the numbers, so a restart tells them apart too. A
    topic deleted and made again restarts its offsets: its old offsets then shelter a replay.
    """

    def __init__(
        self,
        *,
        max_starts: int = 65_536,
        max_gaps: int = 65_536,
        skew_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_starts, self.max_gaps, self.skew_s, self.clock = max_starts, max_gaps, skew_s, clock
        # kid -> its starts, least recently heard first: nonce -> (started, spans [[lo, hi], ...])
        self._starts: dict[str, OrderedDict[bytes, tuple[float, list[list[int]]]]] = {}
        self._gaps: dict[str, int] = {}  # kid -> the gaps between the spans of all its starts
        self._floor: dict[str, float] = {}  # kid -> the newest start forgotten
        self._fresh: set[str] = set()  # keys that sent a fresh envelope
        self._read_to: dict[str, int] = {}  # topic/partition -> the last offset checked there

    def check(self, kid: str, fresh: Freshness | None, at: tuple[str, int] | None = None) -> tuple[str, str] | None:
        """None when the message (key ``kid``, its envelope's ``fresh``, read at ``at``: topic/partition,
        offset) is new, now noted; else (reason, why)."""
        refusal = self._check(kid, fresh)
        if at is not None:
            place, offset = at
            if offset > self._read_to.get(place, -1):
                self._read_to[place] = offset
            elif refusal is not None and refusal[0] == "replayed":
                return "redelivered", f"{place} offset {offset} read again (a rebalance): taken before"
        return refusal

    def _check(self, kid: str, fresh: Freshness | None) -> tuple[str, str] | None:
        if fresh is None:
            if kid in self._fresh:
                return "unfresh", f"key {kid!r} signs fresh messages; this one carries no signer start (a replay?)"
            return None
        nonce, started, number = fresh
        starts = self._starts.get(kid)
        held = None if starts is None else starts.get(nonce)
        if held is None:
            return self._new(kid, nonce, started, number)
        starts.move_to_end(nonce)
        spans = held[1]
        last = spans[-1]
        if number == last[1] + 1:  # the hot path: the next message of a signer heard in order
            last[1] = number
            return None
        i = bisect.bisect_right(spans, number, key=lambda sp: sp[0]) - 1
        if i >= 0 and number <= spans[i][1]:
            return "replayed", f"message {number} of key {kid!r}'s start {nonce.hex()} was taken before"
        before = len(spans)
        if i >= 0 and number == spans[i][1] + 1:
            spans[i][1] = number
        else:
            spans.insert(i + 1, [number, number])
            i += 1
        if i + 1 < len(spans) and spans[i][1] + 1 == spans[i + 1][0]:
            spans[i][1] = spans.pop(i + 1)[1]
        self._gaps[kid] += len(spans) - before
        # past the key's bound, this start's oldest gap is filled: a message from it is then refused
        if self._gaps[kid] > self.max_gaps and len(spans) > 1:
            spans[0][1] = spans.pop(1)[1]
            self._gaps[kid] -= 1
        return None

    def _new(self, kid: str, nonce: bytes, started: float, number: int) -> tuple[str, str] | None:
        if started <= self._floor.get(kid, float("-inf")):
            return "stale", f"key {kid!r}'s start {nonce.hex()} is no newer than one forgotten (a replay?)"
        if started - self.clock() > self.skew_s:
            return "future", f"key {kid!r}'s start {nonce.hex()} is stamped {started - self.clock():.0f} s ahead"
        self._fresh.add(kid)
        self._add(kid, nonce, started, [[number, number]])
        return None

    def _add(self, kid: str, nonce: bytes, started: float, spans: list[list[int]]) -> None:
        """Hold a start of ``kid``, forgetting the key's least recently heard past its bounds."""
        starts = self._starts.setdefault(kid, OrderedDict())
        replaced = starts.pop(nonce, None)
        starts[nonce] = (started, spans)
        gaps = self._gaps.get(kid, 0) + len(spans) - (1 if replaced is None else len(replaced[1]))
        self._gaps[kid] = gaps
        while len(starts) > self.max_starts or gaps > self.max_gaps and len(starts) > 1:
            _, (old_started, old_spans) = starts.popitem(last=False)
            gaps = self._gaps[kid] = gaps - (len(old_spans) - 1)
            self._floor[kid] = max(self._floor.get(kid, float("-inf")), old_started)

    def __len__(self) -> int:
        return sum(map(len, self._starts.values()))

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe: each start's spans, each key's floor, the keys that sign fresh."""
        return {
            "starts": [
                [kid, nonce.hex(), started, spans]
                for kid, starts in self._starts.items()
                for nonce, (started, spans) in starts.items()
            ],
            "floor": dict(self._floor),
            "fresh": sorted(self._fresh),
            "read_to": dict(self._read_to),
        }

    def restore(self, state: Any) -> None:
        """Take back a :meth:`snapshot`; an entry of another shape is skipped (an older state: none)."""
        if not isinstance(state, dict):
            return
        for item in state.get("starts") or ():
            try:
                kid, nonce, started, spans = item
                spans = [[int(lo), int(hi)] for lo, hi in spans][-self.max_gaps - 1 :] or [[0, -1]]
                self._add(str(kid), bytes.fromhex(nonce), float(started), spans)
            except (TypeError, ValueError):
                continue
        self._floor.update((str(k), float(v)) for k, v in (state.get("floor") or {}).items())
        self._fresh.update(str(k) for k in state.get("fresh") or ())
        for place, offset in (state.get("read_to") or {}).items():
            if isinstance(offset, int) and offset > self._read_to.get(str(place), -1):
                self._read_to[str(place)] = offset


class Authenticator:
    """Opens signed messages (each taken once: :class:`SignerStarts`) and enforces run-to-key bindings.

    Args:
        keyring: the keys this service accepts (and the run names each is issued for).
        unsigned: ``refuse`` (default) or ``accept`` unsigned messages for runs no key has claimed.
        max_runs: bindings kept (far above the runs a service watches); ``idle_s``: how long a run
            sends nothing before a new one may take its binding when they are all used.
        log_every: seconds between two log lines about runs refused to one key for one reason.

    ``refused`` counts the messages refused by (key id or "unsigned", reason): a small, bounded set
    of labels (the keys times :data:`RUN_REFUSALS`); ``redelivered`` counts by key id the messages
    read again at their place (a rebalance, a restart), taken again (not refusals). With
    ``accept``, a run that sent unsigned records and then binds to a key is listed in ``rebound``
    (:meth:`take_rebound`): what it sent unsigned must not stand (the service forgets it).
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
        self.starts = SignerStarts()
        self.refused: dict[tuple[str, str], int] = {}
        self.redelivered: dict[str, int] = {}
        self.rebound: list[str] = []
        self._unsigned_runs: OrderedDict[str, None] = OrderedDict()  # runs read unsigned, not bound yet
        self._max_unsigned = max_runs
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # (kid, reason) -> (when, count then)

    def open(self, value: bytes, origin: str = "") -> tuple[bytes, str | None]:
        """(the message inside ``value``, its key id; None for an unsigned one the policy accepts);
        ``origin`` (topic/partition/offset) tells a message read again at its place from a replay."""
        if is_signed(value):
            kid, message, fresh = self.keyring.verify_fresh(value)
            place, _, offset = origin.rpartition("/")
            refusal = self.starts.check(kid, fresh, (place, int(offset)) if offset.isdigit() else None)
            if refusal is not None and refusal[0] == "redelivered":
                self.redelivered[kid] = self.redelivered.get(kid, 0) + 1
            elif refusal is not None:
                self._refuse(kid, refusal[0], "a message", refusal[1])
                raise AuthError("signature", refusal[1])
            return message, kid
        if self.unsigned == "refuse":
            why = "the message is not signed and this service requires signed telemetry"
            self._refuse("unsigned", "unsigned", "a message", f"{why}: give the job its key (SDCWATCH_KEY_FILE)")
            raise AuthError("signature", why)
        return value, None

    def bind(self, runs: Iterable[str], kid: str | None) -> None:
        """Check that ``kid`` (None: unsigned) may speak for each run, binding new ones; AuthError if not."""
        b = self.bindings
        if kid is None:
            for run in runs:
                bound = b.kid_of(run)
                if bound is not None:
                    self._refuse(
                        "unsigned", "unsigned", f"run {run[:80]!r}", f"run {run[:80]!r} signs with key {bound!r}"
                    )
                    raise AuthError("signature", f"run {run[:80]!r} signs with key {bound!r}; this message is unsigned")
                if run not in self._unsigned_runs:
                    self._unsigned_runs[run] = None
                    if len(self._unsigned_runs) > self._max_unsigned:
                        self._unsigned_runs.popitem(last=False)
            return
        now = b.clock()
        unsigned_runs = self._unsigned_runs
        for run in runs:
            refusal = b.check(run, kid, now)
            if refusal is not None:
                self._refuse(kid, refusal[0], f"run {run[:80]!r}", refusal[1])
                raise AuthError("signature", refusal[1])
            if unsigned_runs and run in unsigned_runs:  # bound now: what came unsigned does not stand
                del unsigned_runs[run]
                self.rebound.append(run)
                log.warning(
                    "auth: run %r is bound to key %r: the records it sent unsigned before are discarded", run[:80], kid
                )

    def take_rebound(self) -> list[str]:
        """The runs bound to a key since the last call that had sent unsigned records before."""
        runs, self.rebound = self.rebound, []
        return runs

    def note_start(self, message: bytes, kid: str | None) -> JobStart:
        """A job's start announcement (``message``, opened): the run's nonce for its decisions.
        Only a signed one, from a key that may speak for the run; AuthError or LimitError if not."""
        start = JobStart.decode(message)
        if kid is None:
            raise AuthError("signature", f"an unsigned start announcement for run {start.run[:80]!r}")
        self.bind((start.run,), kid)
        self.bindings.note_start(start.run, start.nonce, start.started_at)
        return start

    def _refuse(self, kid: str, reason: str, what: str, why: str) -> None:
        """Count a refused message and say so, naming ``what`` (its run): at most one line per
        ``log_every`` seconds per (key, reason), with how many were refused since the last line."""
        label = (kid, reason)
        n = self.refused[label] = self.refused.get(label, 0) + 1
        now = self.bindings.clock()
        when, before = self._logged.get(label, (None, 0))
        if when is None or now - when >= self.log_every:
            self._logged[label] = (now, n)
            log.warning(
                "auth: refused %s (%s; %d such message(s) since the last line): %s", what, reason, n - before, why
            )

    def key_of(self, run: str) -> JobKey | None:
        """The key ``run`` is bound to (the service signs its control decisions with it), or None."""
        kid = self.bindings.kid_of(run)
        return None if kid is None else self.keyring.get(kid)

    def nonce_of(self, run: str) -> str:
        """The nonce of the newest start ``run`` announced, which its decisions carry ("" when none)."""
        return self.bindings.nonce_of(run)

    def warn_unrestricted(self) -> None:
        """Say at start which keys carry no run patterns (each may claim any run name no key holds yet),
        and when the service's own key is made from one job's key alone (that job can make it)."""
        if self.keyring.service is None and len(self.keyring) == 1:
            log.warning(
                "auth: the key file holds no %s line: the service's own key (its state and anomalies topics) "
                "is made from key %r alone, which its job can make too (add a line '%s:SECRET')",
                SERVICE_KID,
                self.keyring.kids[0],
                SERVICE_KID,
            )
        loose = self.keyring.unrestricted
        if loose:
            log.warning(
                "auth: key(s) %s carry no runs= patterns: each may claim any run name no other key holds "
                "yet (add ' runs=PATTERN,...' to their lines in the key file)",
                ", ".join(loose),
            )
