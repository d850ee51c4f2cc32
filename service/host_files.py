"""The host files beside the service's state, for schedulers and operators (docs/hosts.md):
``hosts.json`` (every host's verdict) and ``quarantine.txt`` (one quarantined host a line), replaced
whole at each snapshot; ``host-clears.jsonl``, the operators' clears, applied once each and kept.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.rank_notes import clean_text
from sdcwatch.core.validate import check_number

__all__ = [
    "HOSTS_FILE",
    "QUARANTINE_FILE",
    "CLEARS_FILE",
    "HostClear",
    "write_host_files",
    "read_hosts",
    "record_clear",
    "read_clears",
    "apply_clears",
]

HOSTS_FILE = "hosts.json"
QUARANTINE_FILE = "quarantine.txt"
CLEARS_FILE = "host-clears.jsonl"
#: Longest host name, operator name or reason kept in a clear (bytes of UTF-8).
MAX_CLEAR_TEXT = 256
#: Where the pipeline's saved state keeps the time of the newest clear applied.
CARRIED_KEY = "host_clears_through"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostClear:
    """An operator's word that ``host`` was repaired: who (``by``), why, when (``wall``, epoch s)."""

    host: str
    by: str
    reason: str
    wall: float

    def __post_init__(self) -> None:
        for key in ("host", "by", "reason"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip() or clean_text(value, MAX_CLEAR_TEXT) != value:
                raise ConfigError(f"clear.{key}", f"must be a non-empty line of at most {MAX_CLEAR_TEXT} bytes")
        check_number("clear.wall", self.wall)

    @classmethod
    def from_dict(cls, d: Any) -> "HostClear":
        """The clear a line of the clears file holds; ConfigError when it is not one."""
        if not isinstance(d, dict):
            raise ConfigError("clear", "not a JSON object")
        return cls(d.get("host"), d.get("by"), d.get("reason"), d.get("wall"))


def _replace(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or stays as it was: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def write_host_files(folder: str | os.PathLike, verdicts: Iterable[Any], *, wall: float, clears_through: float) -> None:
    """``hosts.json`` (``{"written", "clears_through", "hosts": [verdict.to_dict(), ...]}``, worst
    first) and ``quarantine.txt`` in ``folder``; ``clears_through``: the time of the newest clear applied."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    listed = [v.to_dict() for v in verdicts]
    body = {"written": wall, "clears_through": clears_through, "hosts": listed}
    _replace(folder / HOSTS_FILE, json.dumps(body, allow_nan=False, ensure_ascii=False) + "\n")
    quarantined = [d["host"] for d in listed if d["verdict"] == "quarantine"]
    _replace(folder / QUARANTINE_FILE, "".join(f"{h}\n" for h in quarantined))


def read_hosts(folder: str | os.PathLike) -> dict[str, Any] | None:
    """What ``hosts.json`` in ``folder`` holds; None when there is none yet. ConfigError naming a damaged one."""
    path = Path(folder) / HOSTS_FILE
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(str(path), f"cannot read the hosts file: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("hosts"), list):
        raise ConfigError(str(path), "not a hosts file (no list of hosts)")
    return body


def read_clears(folder: str | os.PathLike) -> tuple[list[HostClear], int]:
    """The clears recorded in ``folder``, oldest first, and how many lines were not a clear (skipped)."""
    try:
        lines = (Path(folder) / CLEARS_FILE).read_text(encoding="utf-8", errors="replace").splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return [], 0
    clears, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            clears.append(HostClear.from_dict(json.loads(line)))
        except (ValueError, ConfigError):
            bad += 1
    return clears, bad


def record_clear(folder: str | os.PathLike, host: str, *, by: str, reason: str, wall: float | None = None) -> HostClear:
    """Append a clear of ``host`` to ``folder``'s clears file and return it. Its time is after every
    clear recorded before it, so the service, which applies the clears newer than the last it applied,
    takes each once."""
    folder = Path(folder)
    before = max((c.wall for c in read_clears(folder)[0]), default=0.0)
    now = time.time() if wall is None else wall
    clear = HostClear(host, by, reason, max(now, math.nextafter(before, math.inf)))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / CLEARS_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(asdict(clear), ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return clear


def apply_clears(pipeline: Any, folder: str | os.PathLike) -> float:
    """Apply to ``pipeline.hosts`` (the ledger) the clears of ``folder`` recorded after the last one
    applied, which ``pipeline.carried`` keeps with the state (a restart applies none twice); the time of
    the newest clear applied (0.0: none ever)."""
    through = float(pipeline.carried.get(CARRIED_KEY) or 0.0)
    try:
        clears, bad = read_clears(folder)
    except OSError as exc:  # an unreadable file holds the clears back, never the snapshot
        log.warning("host clears not read from %s: %s", Path(folder) / CLEARS_FILE, exc)
        return through
    if bad:
        log.warning("%d line(s) of %s are not a clear; skipped", bad, Path(folder) / CLEARS_FILE)
    for clear in [c for c in clears if c.wall > through]:
        known = pipeline.hosts.clear(clear.host, by=clear.by, reason=clear.reason, wall=clear.wall)
        log.info("host %s cleared by %s (%s)%s", clear.host, clear.by, clear.reason, "" if known else ": not tracked")
        through = max(through, clear.wall)
    pipeline.carried[CARRIED_KEY] = through
    return through
