"""What the service announced since its last snapshot, on disk: one alert per incident across a kill.

An instance killed between two snapshots re-reads what came after the last one and finds the same
incidents again, with the same ids. :class:`AnnouncementJournal` appends each incident change it
published to ``announced.jsonl`` beside the state (synced before the next one), empties it at each
snapshot, and a restarted service does not publish those changes again (docs/service.md, "The
state file"). With a state topic the journal is copied there too (``mirror``, ``adopt``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

from sdcwatch.core.incident import IncidentEvent

__all__ = ["AnnouncementJournal", "JOURNAL_FILE", "KEEP_BEFORE_S"]

log = logging.getLogger("sdcwatch.service.announced")

JOURNAL_FILE = "announced.jsonl"
_MAX_REMEMBERED = 100_000
#: Seconds an incident change announced before a restart is not repeated: the same id re-found
#: within it is the same incident re-read; past it, a run restarted under its name may truly fault
#: again at the same step.
KEEP_BEFORE_S = 3600.0


def _line(key: str, at: float) -> str:
    return json.dumps({"key": key, "at": round(at, 3)}) + "\n"


def _key(event: IncidentEvent) -> str:
    inc = event.incident
    if event.change != "updated":  # opened or resolved once, whatever it said
        return f"{event.change}|{inc.id}"
    return f"updated|{inc.id}|{inc.kind}|{inc.severity.value}|{len(inc.ranks)}"


class AnnouncementJournal:
    """The incident changes published since the last snapshot (``path``), and those a killed
    instance had published before this one started (not to be repeated)."""

    def __init__(self, path: str | Path, *, mirror: Callable[[dict[str, float]], None] | None = None) -> None:
        self.path = Path(path)
        self.mirror = mirror  # the state topic's write_journal: every entry after each change
        self.suppressed = 0  # changes not published again after a restart
        self.write_errors = 0
        self._said: dict[str, float] = {}  # published by this instance since its last snapshot (key -> time)
        # published before this instance started (key -> wall time), not yet found again
        self._before: dict[str, float] = {}
        self._file = None
        self._load()

    def adopt(self, entries: dict[str, float]) -> None:
        """Take what an instance elsewhere announced (the state topic's copy of its journal)."""
        now = time.time()
        for key, at in entries.items():
            if isinstance(key, str) and isinstance(at, (int, float)) and now - at < KEEP_BEFORE_S:
                self._before.setdefault(key, float(at))

    def _load(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("could not read %s (%s): incidents from before a crash may be announced again", self.path, exc)
            return
        entries = {}
        for line in text.splitlines()[:_MAX_REMEMBERED]:
            try:
                entry = json.loads(line)
                entries[entry["key"]] = float(entry["at"])
            except (ValueError, TypeError, KeyError):  # a line cut by the kill
                continue
        self.adopt(entries)
        if self._before:
            log.info("%d incident change(s) were announced before the last stop: not repeated", len(self._before))

    def said(self, event: IncidentEvent) -> bool:
        """Whether ``event`` was published already (by this instance since its snapshot, or before a kill)."""
        key = _key(event)
        # one from before the kill is taken off: the re-read reached it, its state is this instance's now
        said = self._before.pop(key, None) is not None or key in self._said
        self.suppressed += said
        return said

    def note(self, event: IncidentEvent) -> None:
        """Record a published change, on disk before the next one is handled."""
        key, now = _key(event), time.time()
        if len(self._said) < _MAX_REMEMBERED:
            self._said[key] = now
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(_line(key, now))
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 100 == 0:
                log.error("could not record an announced incident in %s (%s)", self.path, exc.strerror or exc)
            self.close()
        self._mirror()

    def _mirror(self) -> None:
        if self.mirror is None:
            return
        try:
            self.mirror({**self._before, **self._said})
        except Exception as exc:  # the local journal still holds
            self.write_errors += 1
            log.error("could not copy the announced incidents off this machine: %s", exc)

    def snapshot_written(self) -> None:
        """A snapshot holds every incident this instance announced: start the journal afresh,
        keeping what an earlier instance announced that the re-read records have not reached yet."""
        self.close()
        self._said.clear()
        now = time.time()
        self._before = {k: at for k, at in self._before.items() if now - at < KEEP_BEFORE_S}
        try:
            if self._before:
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text("".join(_line(k, at) for k, at in sorted(self._before.items())))
                tmp.replace(self.path)
            else:
                self.path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not rewrite %s: %s", self.path, exc)
        self._mirror()

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
