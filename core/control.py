"""The guard's wire: the decisions the detector service sends to a training job's guard (one JSON
object a :class:`Decision` on the control topic, signed, numbered and bound to the job's start for a
signed run), the start a guard announces on the telemetry topic (:class:`JobStart`), and the codes a
guarded step's records carry back (``guard_action``, ...). Both sides import this one definition.
"""

from __future__ import annotations

import json
import math
import os
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from sdcwatch.core.errors import ControlError
from sdcwatch.core.limits import LimitError
from sdcwatch.core.signing import AuthError, JobKey, is_signed

__all__ = [
    "CONTROL_ACTIONS",
    "Decision",
    "JobStart",
    "START_MAGIC",
    "decode_decision",
    "open_decision",
    "ACTIONS",
    "REASONS",
    "VERDICTS",
]

#: Actions; the code of an action is its index (``guard_action``): in increasing order of weight, then
#: ``leave`` (an eviction carried out by the rank's replica group leaving the quorum while the others
#: go on; appended so that older codes keep their meaning).
ACTIONS = ("none", "skip", "rerun", "rollback", "evict", "leave")
#: Why the guard acted; the code is the index (``guard_reason``).
REASONS = ("", "nonfinite", "spike", "control", "checksum")
#: What a rerun found; the code is the index (``guard_verdict``). ``reproducible``: the result
#: repeats and no other rank could recompute it (no ``peer``), so hardware and data are not told apart.
VERDICTS = ("", "transient", "persistent", "data", "reproducible")

#: Actions the service may ask for (the guard's local checks add ``rerun`` on their own).
CONTROL_ACTIONS = ("skip", "rollback", "evict")
_MAX_RANKS = 64
_MAX_TEXT = 1024
_FIELDS = frozenset(
    "run action reason ranks hosts since_step incident lr_factor issued_at seq checkpoint nonce".split()
)
_MAX_NONCE = 64
#: The prefix of a job start announcement on the telemetry topic (then its JSON).
START_MAGIC = b"SDCI"


@dataclass(frozen=True)
class Decision:
    """One decision for one run: ``action`` on ``ranks`` (empty: the run as a whole).

    ``since_step`` is the first step the problem was seen at: a rollback goes to a snapshot
    taken before it. ``lr_factor`` scales the learning rate after a rollback (1.0: unchanged).
    """

    run: str
    action: str
    reason: str
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    since_step: int | None = None
    incident: str = ""
    lr_factor: float = 1.0
    issued_at: float = field(default=0.0, compare=False)
    seq: int = field(default=0, compare=False)
    """The service's sequence number of the decision for its run, increasing (a guard that holds a
    job key acts on each number once: a replayed decision is refused)."""
    checkpoint: str = ""
    """A rollback's certified checkpoint: the newest the service marked clean at or before
    ``since_step`` (its path, or ``step N`` when the job named no path; "" when none is known)."""
    nonce: str = field(default="", compare=False)
    """The start of the job the decision is for (:class:`JobStart`): a guard that holds a job key
    takes only a decision carrying its own start's nonce, so none outlives a restart."""

    def __post_init__(self) -> None:
        _check(self)

    def to_dict(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "ranks": list(self.ranks), "hosts": list(self.hosts)}
        for key in ("seq", "checkpoint", "nonce"):  # only when set: an earlier guard refuses a field it does not know
            if not out[key]:
                del out[key]
        return out

    def encode(self) -> bytes:
        return json.dumps(self.to_dict(), allow_nan=False).encode("utf-8")

    def sign(self, key: JobKey) -> bytes:
        """The decision as a control message signed with ``key`` (the key its run is bound to); the
        envelope a guard of an earlier release reads (the decision carries its own nonce and number)."""
        return key.sign(self.encode(), fresh=False)


def _check(d: Decision) -> None:
    if not isinstance(d.run, str) or not d.run or len(d.run) > _MAX_TEXT:
        raise ControlError("run", f"must be a non-empty string, got {d.run!r}")
    if d.action not in CONTROL_ACTIONS:
        raise ControlError("action", f"must be one of {', '.join(CONTROL_ACTIONS)}, got {d.action!r}")
    if not isinstance(d.reason, str) or len(d.reason) > _MAX_TEXT:
        raise ControlError("reason", "must be a string of at most 1024 characters")
    if (
        not isinstance(d.ranks, tuple)
        or len(d.ranks) > _MAX_RANKS
        or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 1 << 24 for r in d.ranks)
    ):
        raise ControlError("ranks", f"must be at most {_MAX_RANKS} ranks in 0..2^24, got {d.ranks!r}")
    if not isinstance(d.hosts, tuple) or not all(isinstance(h, str) and len(h) <= 255 for h in d.hosts):
        raise ControlError("hosts", "must be a list of host names")
    if d.since_step is not None and (
        isinstance(d.since_step, bool) or not isinstance(d.since_step, int) or d.since_step < 0
    ):
        raise ControlError("since_step", f"must be a step >= 0 or null, got {d.since_step!r}")
    if (
        isinstance(d.lr_factor, bool)
        or not isinstance(d.lr_factor, (int, float))
        or not (math.isfinite(d.lr_factor) and 0 < d.lr_factor <= 1)
    ):
        raise ControlError("lr_factor", f"must be a number in (0, 1], got {d.lr_factor!r}")
    if d.action == "evict" and not d.ranks:
        raise ControlError("ranks", "an evict decision must name the rank(s) to evict")
    if isinstance(d.seq, bool) or not isinstance(d.seq, int) or not 0 <= d.seq < 1 << 63:
        raise ControlError("seq", f"must be an integer in [0, 2^63), got {d.seq!r}")
    if not isinstance(d.checkpoint, str) or len(d.checkpoint) > _MAX_TEXT or any(ord(c) < 32 for c in d.checkpoint):
        raise ControlError("checkpoint", "must be a string of at most 1024 characters, no control character")
    if d.nonce != "" and not (isinstance(d.nonce, str) and _is_nonce(d.nonce)):
        raise ControlError("nonce", f"must be at most {_MAX_NONCE} letters and digits")


def _is_nonce(text: str) -> bool:
    return 0 < len(text) <= _MAX_NONCE and text.isascii() and text.isalnum()


def decode_decision(data: bytes | str | Mapping[str, Any]) -> Decision:
    """A :class:`Decision` from a control message; :class:`ControlError` naming what is wrong."""
    if isinstance(data, Mapping):
        obj: Any = data
    else:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ControlError("message", f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ControlError("message", f"must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _FIELDS
    if unknown:
        raise ControlError(sorted(unknown)[0], "unknown field")
    for key in ("run", "action"):
        if key not in obj:
            raise ControlError(key, "is required")
    ranks, hosts = obj.get("ranks", []), obj.get("hosts", [])
    if not isinstance(ranks, list) or not isinstance(hosts, list):
        raise ControlError("ranks" if not isinstance(ranks, list) else "hosts", "must be a list")
    issued = obj.get("issued_at", 0.0)
    if isinstance(issued, bool) or not isinstance(issued, (int, float)):
        raise ControlError("issued_at", "must be a number")
    lr = obj.get("lr_factor", 1.0)
    return Decision(
        run=obj["run"],
        action=obj["action"],
        reason=obj.get("reason", ""),
        ranks=tuple(ranks),
        hosts=tuple(hosts),
        since_step=obj.get("since_step"),
        incident=str(obj.get("incident", ""))[:_MAX_TEXT],
        lr_factor=float(lr) if isinstance(lr, int) and not isinstance(lr, bool) else lr,
        issued_at=float(issued),
        seq=obj.get("seq", 0),
        checkpoint=obj.get("checkpoint", ""),
        nonce=obj.get("nonce", ""),
    )


def open_decision(value: bytes, key: JobKey | None) -> Decision:
    """A decision from a control message. With ``key`` (the job's key), only a message signed with
    it is read: ControlError ``signature`` for an unsigned, forged or altered one."""
    if key is not None:
        try:
            value = key.open(value)
        except AuthError as exc:
            raise ControlError("signature", exc.problem) from None
    elif is_signed(value):
        raise ControlError("signature", "the decision is signed but this job holds no key (SDCWATCH_KEY_FILE)")
    return decode_decision(value)


@dataclass(frozen=True)
class JobStart:
    """One start of a job's guard: a fresh random ``nonce`` for ``run``, announced signed on the
    telemetry topic, which the service copies into each decision it signs for the run.

    torchrun keeps a run's name across restarts; the nonce does not survive one, so a decision
    signed for an earlier start (captured, replayed) is refused by the guard of a later one.
    """

    run: str
    nonce: str = field(default_factory=lambda: os.urandom(16).hex())
    started_at: float = 0.0

    def encode(self) -> bytes:
        return START_MAGIC + json.dumps(dataclasses.asdict(self), allow_nan=False).encode("utf-8")

    @classmethod
    def decode(cls, value: bytes) -> "JobStart":
        """The announcement in ``value`` (after the envelope); LimitError ``malformed`` naming what is wrong."""
        try:
            obj = json.loads(value[len(START_MAGIC) :]) if value[:4] == START_MAGIC and len(value) <= 4096 else None
        except (ValueError, UnicodeDecodeError):
            obj = None
        if not isinstance(obj, dict) or set(obj) != {"run", "nonce", "started_at"}:
            raise LimitError("start", "not a job start announcement (SDCI, then run, nonce, started_at)", "malformed")
        run, nonce, at = obj["run"], obj["nonce"], obj["started_at"]
        if not isinstance(run, str) or not 0 < len(run) <= _MAX_TEXT:
            raise LimitError("start", "run must be a non-empty string", "malformed")
        if not isinstance(nonce, str) or not _is_nonce(nonce):
            raise LimitError("start", f"nonce must be 1-{_MAX_NONCE} letters and digits", "malformed")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise LimitError("start", "started_at must be a number", "malformed")
        return cls(run, nonce, float(at))
