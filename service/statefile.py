"""The pipeline's state file: written so that no crash leaves a half file, read with one clear error.

Written to a temporary file, synced and renamed over the old one, kept beside it as ``<name>.prev``
(resumed from when only it is left); a damaged file raises :class:`~sdcwatch.core.errors.ConfigError`
naming it and the ways out (docs/service.md, "The state file").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from sdcwatch.core.errors import ConfigError

__all__ = ["write_state", "read_state", "restoring", "restore_faults", "previous_state", "state_to_resume"]


def previous_state(path: str | os.PathLike) -> Path:
    """Where :func:`write_state` keeps the snapshot before the current one."""
    path = Path(path)
    return path.with_name(path.name + ".prev")


def state_to_resume(path: str | os.PathLike) -> Path:
    """The file a start resumes from: ``path``, or its ``.prev`` when only that is left (the file
    deleted, or lost by a crash): the snapshot before beats a cold start. A damaged ``path`` is
    still ``path`` (its error names the ways out; a write never leaves one, so it is not hidden)."""
    path = Path(path)
    prev = previous_state(path)
    return prev if not os.path.lexists(path) and prev.is_file() else path


def _recovery(path: Path) -> str:
    prev = previous_state(path)
    keep = f", or copy {prev.name} (the snapshot before it) over it" if prev.is_file() else ""
    return f"; start with --state-reset to move it aside and begin afresh{keep}"


def write_state(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write ``state`` (JSON-safe) to ``path``; the previous file is kept as ``<name>.prev``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(state, fh, separators=(",", ":"), allow_nan=False)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError:  # a full disk: no half-written file left behind; the last snapshot stays as it was
        tmp.unlink(missing_ok=True)
        raise
    try:
        if path.is_file():
            _keep_previous(path)
    except OSError:  # no room even for the copy: the new snapshot goes too, the current one stays
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _keep_previous(path: Path) -> None:
    """Keep the current file as ``<name>.prev`` while it stays in place (a hard link, or a copy, renamed
    over the old one): moving it aside would leave a moment with no state file at all."""
    prev = previous_state(path)
    staged = prev.with_suffix(prev.suffix + ".tmp")
    staged.unlink(missing_ok=True)
    try:
        os.link(path, staged)
    except OSError:
        try:
            shutil.copy2(path, staged)
        except OSError:
            staged.unlink(missing_ok=True)
            raise
    os.replace(staged, prev)


def read_state(path: str | os.PathLike) -> dict[str, Any] | None:
    """The state object in ``path``, None when there is no file; ConfigError when it is not one."""
    path = Path(path)
    recovery = _recovery(path)
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ConfigError("state.file", f"{path} is a folder, not a state file{recovery}") from None
    except OSError as exc:
        raise ConfigError("state.file", f"{path}: cannot read the state file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("state.file", f"{path}: not a state file (not UTF-8 text: {exc.reason}){recovery}") from None
    except ValueError as exc:
        what = "empty" if path.stat().st_size == 0 else f"not valid JSON, truncated or damaged ({exc})"
        raise ConfigError("state.file", f"{path}: not a valid state file: {what}{recovery}") from None
    if not isinstance(state, dict):
        raise ConfigError(
            "state.file", f"{path}: not a state file (a JSON {type(state).__name__}, not an object){recovery}"
        )
    return state


def restoring(path: str | os.PathLike) -> contextlib.AbstractContextManager:
    """Turn any fault met while restoring the state of ``path`` into one ConfigError naming it."""
    return restore_faults("state.file", str(path), "the state file", _recovery(Path(path)))


@contextlib.contextmanager
def restore_faults(key: str, where: str, what: str, recovery: str) -> Iterator[None]:
    """Turn any fault met while restoring ``what`` (read from ``where``) into one ConfigError
    naming ``where``, the fault and the way out (``recovery``); ``key``: the setting to blame."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(exc.key, f"{where}: {exc.problem}{recovery}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        fault = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ConfigError(key, f"{where}: {what} is structurally wrong ({fault}){recovery}") from None


def _sync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
